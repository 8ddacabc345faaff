"""DeepSpeed's own files in a checkpoint folder: their names, and loading them safely.

    mp_rank_{r:02d}_model_states.pt                   per stage x TP rank (files.module_file):
                                                      weights at PP = 1, ZeRO-0's optimizer state
    zero_pp_rank_{dp}_mp_rank_{r:02d}_optim_states.pt per DP and (stage x TP) rank: the ZeRO-1/2/3
                                                      optimizer partitions
    zero_pp_rank_{dp}_mp_rank_{r:02d}_model_states.pt ZeRO-3: the model file of each DP rank (empty
                                                      placeholders and the parameter order)

Besides tensors these files hold a few DeepSpeed objects (`deepspeed_safe_globals`), allowed by
name so that every load keeps weights_only=True: torch then refuses anything else a file holds
instead of running it. read.py (ZeRO-3 weights), reshard.py (converting ZeRO-0/1/2 optimizer
state) and engine_io.py (a same-layout resume) all load them through here.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .integrity import CheckpointError


def zero_optim_file(dp: int, mp: int) -> str:
    """DeepSpeed's optimizer partition of DP rank `dp`, model-parallel rank `mp` (stage x TP)."""
    return f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"


def zero3_model_file(dp: int, mp: int) -> str:
    """ZeRO-3's model file of DP rank `dp`, model-parallel rank `mp`."""
    return f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt"


def deepspeed_safe_globals() -> list:
    """The only non-tensor objects in DeepSpeed's ZeRO files (DeepSpeed 0.19)."""
    # imported here, not at the top: deepspeed takes seconds to import, and generate and
    # export-hf read checkpoints (read.py) without ever needing it
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


def safe_load(path, mmap: bool = True):
    """torch.load of one of DeepSpeed's files on the CPU, weights_only=True with DeepSpeed's
    objects allowed; mmap: memory-mapped, nothing read until a tensor is touched."""
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def load_deepspeed_file(path: Path) -> dict:
    """One of DeepSpeed's files, memory-mapped (nothing is read until a tensor is touched)."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete or its layout record is wrong.")
    return safe_load(path)
