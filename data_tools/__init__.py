"""Command-line tools for corpora: preprocess into Megatron-compatible indexed binaries
(.bin/.idx), merge, inspect, train a tokenizer. The formats and the tokenizer loading they use
live in the package (megatron_id.data)."""
