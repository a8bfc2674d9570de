"""kvfence.engine."""
