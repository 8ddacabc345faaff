"""Inference beyond the training model's own forward: the fused decode step over slots
(fused_decode.py)."""
