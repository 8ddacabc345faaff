"""Generation and decoding beyond the training model's own forward: generate.py (loading a
checkpoint or an export, generate_ids, the static / CUDA-graph step), the fused decode step over
slots composed from the mixers' decode interface (fused_decode.py, model/mixers/decode.py),
continuous batching (batching.py) and `megatron-id serve` (server.py)."""
