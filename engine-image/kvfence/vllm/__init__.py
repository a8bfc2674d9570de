"""kvfence.vllm."""
