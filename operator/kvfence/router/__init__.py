"""kvfence.router."""
