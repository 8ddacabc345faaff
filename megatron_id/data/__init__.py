"""Data the trainer reads: Megatron indexed datasets and GPT-style sample packing."""
