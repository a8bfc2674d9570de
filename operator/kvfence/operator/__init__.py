"""kvfence.operator."""
