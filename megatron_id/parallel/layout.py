"""The one layout validator: can `world_size` processes run this model at TP x PP x DP with ZeRO
stage z? Every problem is a LayoutError (a ConfigError: one line with the values and the fix),
raised before any process group or model exists.

    check_sizes        world size = TP x PP x DP                    (process groups, state.py)
    check_model_split  heads, SwiGLU and vocabulary over TP; layers over PP
                                                                     (parallelize, checkpoints,
                                                                      import-hf, convert-checkpoint)
    check_zero         ZeRO stage against pipelining
    check_layout       all of them: what training/layout.py and the planner ask

The batch arithmetic (global batch = micro-batch x accumulation x DP) and the step counts are
the trainer's, in training/layout.py, on top of `check_layout`.
"""
from __future__ import annotations

import math

from ..config import ConfigError, ModelConfig, ffn_hidden_size


class LayoutError(ConfigError):
    """A parallel layout that cannot work, with the numbers and the fix."""


def check_sizes(world_size: int, tensor: int, pipe: int = 1) -> int:
    """World size = TP x PP x DP; returns DP."""
    if tensor < 1 or pipe < 1:
        raise LayoutError(f"tensor ({tensor}) and pipeline ({pipe}) parallel sizes must be >= 1.")
    if world_size % (tensor * pipe):
        raise LayoutError(
            f"world size {world_size} does not factor into TP={tensor} x PP={pipe} x DP: "
            f"{world_size} is not a multiple of {tensor * pipe}. Launch a multiple of "
            f"{tensor * pipe} processes or change parallel.tensor_model_parallel_size / "
            f"parallel.pipeline_model_parallel_size.")
    return world_size // (tensor * pipe)


def padded_vocab_size(cfg: ModelConfig, tp: int) -> int:
    """Megatron's rule: pad to a multiple of make_vocab_size_divisible_by x TP (0: no padding)."""
    if cfg.make_vocab_size_divisible_by == 0:
        return cfg.vocab_size
    multiple = cfg.make_vocab_size_divisible_by * tp
    return math.ceil(cfg.vocab_size / multiple) * multiple


def check_model_split(cfg: ModelConfig, tensor: int, pipe: int = 1) -> None:
    """Everything TP splits must split evenly (each rank keeps whole heads), and the layers must
    divide into PP stages; all problems in one message."""
    problems = []
    if cfg.n_heads % tensor:
        problems.append(f"model.n_heads={cfg.n_heads} is not divisible by tensor parallel size {tensor} "
                        f"(each rank keeps whole heads); use a TP size that divides {cfg.n_heads}")
    if ffn_hidden_size(cfg) % tensor:
        problems.append(f"the SwiGLU hidden size {ffn_hidden_size(cfg)} is not divisible by tensor "
                        f"parallel size {tensor}; set model.ffn_hidden to a multiple of {tensor}")
    if padded_vocab_size(cfg, tensor) % tensor:
        problems.append(f"model.vocab_size={cfg.vocab_size} is not divisible by tensor parallel size "
                        f"{tensor} and vocabulary padding is off (model.make_vocab_size_divisible_by=0); "
                        f"set model.make_vocab_size_divisible_by=128 (Megatron's default) to pad")
    if cfg.n_layers % pipe:
        problems.append(f"model.n_layers={cfg.n_layers} cannot be divided into "
                        f"parallel.pipeline_model_parallel_size={pipe} equal stages; use a number "
                        f"of stages that divides {cfg.n_layers}")
    if problems:
        raise LayoutError("; ".join(problems) + ".")


def check_zero(zero_stage: int, pipe: int) -> None:
    if zero_stage not in (0, 1, 2, 3):
        raise LayoutError(f"train.zero_stage={zero_stage} is invalid: use 0, 1, 2 or 3.")
    if pipe > 1 and zero_stage >= 2:
        raise LayoutError(
            f"train.zero_stage={zero_stage} cannot be combined with pipeline parallelism "
            f"(parallel.pipeline_model_parallel_size={pipe}): DeepSpeed's pipeline engine supports "
            f"ZeRO stage 0 or 1 only. Set train.zero_stage=1, or "
            f"parallel.pipeline_model_parallel_size=1 to use ZeRO-{zero_stage}.")


def check_layout(cfg: ModelConfig, world_size: int, tensor: int, pipe: int, zero_stage: int,
                 sequence_parallel: bool = False) -> int:
    """Every check of a training layout; returns DP."""
    data = check_sizes(world_size, tensor, pipe)
    check_model_split(cfg, tensor, pipe)
    check_zero(zero_stage, pipe)
    if sequence_parallel and cfg.seq_length % tensor:
        raise LayoutError(f"parallel.sequence_parallel splits model.seq_length={cfg.seq_length} over "
                          f"TP={tensor} ranks: use a sequence length divisible by {tensor}.")
    return data
