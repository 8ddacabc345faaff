"""Everything about a run's layout that can be checked before training starts, and the
DeepSpeed config generated from ours.

`training_layout(cfg, world_size)` returns sizes and step counts, or raises ConfigError naming
the setting and the fix: a world size that is not TP x PP x DP, heads/vocab/FFN not divisible by
TP, layers not divisible into pipeline stages, ZeRO-2/3 with pipelines (DeepSpeed's
PipelineEngine accepts ZeRO-1 only), a global batch that micro-batch x DP does not divide.

Precision: `train.precision=bf16` means bf16 autocast with fp32 weights and optimizer state (as
in the paper), so the generated DeepSpeed config leaves DeepSpeed's own bf16 mode off: that mode
would store every weight, the SSM's Delta, A and C included, in bf16.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from ..config import Config, ConfigError
from ..parallel.state import ParallelConfigError, check_parallel_sizes


@dataclass(frozen=True)
class Layout:
    tensor: int
    pipe: int
    data: int
    micro_batch_size: int
    gradient_accumulation: int
    global_batch_size: int
    tokens_per_step: int
    train_iters: int


def training_layout(cfg: Config, world_size: int) -> Layout:
    p, t, m = cfg.parallel, cfg.train, cfg.model
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    try:
        dp = check_parallel_sizes(world_size, tp, pp, model_cfg=m)
    except ParallelConfigError as err:
        raise ConfigError(str(err)) from None
    if t.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"train.zero_stage={t.zero_stage} is invalid: use 0, 1, 2 or 3.")
    if pp > 1 and t.zero_stage >= 2:
        raise ConfigError(
            f"train.zero_stage={t.zero_stage} cannot be combined with pipeline parallelism "
            f"(parallel.pipeline_model_parallel_size={pp}): DeepSpeed's pipeline engine supports "
            f"ZeRO stage 0 or 1 only. Set train.zero_stage=1, or "
            f"parallel.pipeline_model_parallel_size=1 to use ZeRO-{t.zero_stage}.")
    if t.zero_stage == 3:
        raise ConfigError("train.zero_stage=3 is not supported yet (its interplay with tensor "
                          "parallelism is untested); use train.zero_stage=1 or 2.")
    if m.n_layers % pp:
        raise ConfigError(f"model.n_layers={m.n_layers} cannot be divided into "
                          f"parallel.pipeline_model_parallel_size={pp} equal stages; use a number "
                          f"of stages that divides {m.n_layers}.")
    if p.sequence_parallel and m.seq_length % tp:
        raise ConfigError(f"parallel.sequence_parallel splits model.seq_length={m.seq_length} over "
                          f"TP={tp} ranks: use a sequence length divisible by {tp}.")
    per_step = t.micro_batch_size * dp
    if t.micro_batch_size < 1 or t.global_batch_size < 1 or t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a positive multiple of "
            f"train.micro_batch_size={t.micro_batch_size} x data-parallel size {dp} = {per_step} "
            f"(global = micro-batch x gradient accumulation x DP).")
    tokens_per_step = t.global_batch_size * m.seq_length
    iters = math.ceil(t.train_tokens / tokens_per_step)
    if iters < 1:
        raise ConfigError(f"train.train_tokens={t.train_tokens} is less than one step.")
    return Layout(tp, pp, dp, t.micro_batch_size, t.global_batch_size // per_step,
                  t.global_batch_size, tokens_per_step, iters)


def _deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else copy.deepcopy(value)
    return out


def deepspeed_config(cfg: Config, layout: Layout) -> dict:
    """The DeepSpeed config for this run; `train.deepspeed` entries override any key."""
    t = cfg.train
    generated = {
        "train_batch_size": layout.global_batch_size,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.gradient_accumulation,
        # ZeRO-0: our GuardedAdamW clips (and skips non-finite steps); ZeRO-1/2: DeepSpeed does
        "gradient_clipping": cfg.optimizer.clip_grad if t.zero_stage > 0 else 0.0,
        "zero_allow_untested_optimizer": True,   # GuardedAdamW is an AdamW subclass
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": False},   # bf16 is autocast with fp32 weights (see module docstring)
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,     # we log ourselves
        "wall_clock_breakdown": False,
    }
    merged = _deep_merge(generated, dict(t.deepspeed))
    if merged["train_batch_size"] != merged["train_micro_batch_size_per_gpu"] * \
            merged["gradient_accumulation_steps"] * layout.data:
        raise ConfigError("train.deepspeed overrides make train_batch_size differ from micro-batch "
                          "x gradient accumulation x data-parallel size; set the batch through "
                          "train.micro_batch_size and train.global_batch_size instead.")
    return merged
