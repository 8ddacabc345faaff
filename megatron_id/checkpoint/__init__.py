"""Checkpoints: the whole format and its protocol, in one place.

    files.py       the format: folder and file names, staging, atomic commit, `latest`, pruning,
                   the typed client state, reading one file (weights_only=True, memory-mapped),
                   writing a safetensors file one tensor at a time
    integrity.py   manifest.json (size + sha256 of every file) and the checks against it
    rules.py       what a run may do with its folders: resume or start, the train.save lock,
                   which optimizer state fits the current layout
    read.py        the weights of any (TP, PP) layout, memory-mapped: one tensor at a time
                   (export), whole (generate) or one rank's slices (loading at another layout);
                   writing a weights-only checkpoint (import)
    deepspeed_files.py  DeepSpeed's own files: their names and their safe loading
                   (weights_only=True with DeepSpeed's few objects allowed), for read.py,
                   reshard.py and engine_io.py
    reshard.py     optimizer state per parameter (optim/), loadable at any layout, and the
                   offline conversion from DeepSpeed's ZeRO files (`megatron-id convert-checkpoint`)
    engine_io.py   save and load of a DeepSpeed training run (the Trainer calls these)

Hugging Face conversion (megatron_id/hf) and generation read checkpoints through read.py only.
"""
