"""Corpus preprocessing into Megatron-compatible indexed binaries (.bin/.idx) and the datasets
the trainer reads. Filled in by issue 4 (`python -m data_tools.preprocess`)."""
