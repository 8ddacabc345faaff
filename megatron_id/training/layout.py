"""Everything about a run's layout that can be checked before training starts, and the
DeepSpeed config generated from ours.

`training_layout(cfg, world_size)` returns sizes and step counts, or raises ConfigError naming
the setting and the fix: the layout itself through the one validator (parallel/layout.py: a
world size that is not TP x PP x DP, heads/vocab/FFN not divisible by TP, layers not divisible
into pipeline stages, ZeRO-2/3 with pipelines), then ZeRO-3 with train.reshardable_optimizer,
a global batch that micro-batch x DP does not divide and a token budget below one step.

ZeRO-3 (PP = 1): DeepSpeed partitions every parameter of the tensor-parallel model over the DP
group when the engine is built (the model is built whole per TP rank first, no zero.Init) and
gathers them module by module in forward and backward. Its losses and gradient norms equal
ZeRO-1's at the same layout (tests/test_zero3.py). With DeepSpeed's defaults
(stage3_max_live_parameters and stage3_max_reuse_distance 1e9 elements) every parameter stays
gathered from its first use until the step, so the peak holds the whole TP shard as at ZeRO-1/2;
setting those (train.deepspeed.zero_optimization.*) below the model size trades re-gathering
in backward for memory.

Precision: `train.precision=bf16` means bf16 autocast with fp32 weights and optimizer state (as
in the paper), so the generated DeepSpeed config leaves DeepSpeed's own bf16 mode off: that mode
would store every weight, the SSM's Delta, A and C included, in bf16.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from ..config import Config, ConfigError
from ..parallel.layout import check_layout


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
    dp = check_layout(m, world_size, tp, pp, t.zero_stage, p.sequence_parallel)
    if t.zero_stage == 3 and t.reshardable_optimizer:
        raise ConfigError(
            "train.reshardable_optimizer=true cannot be combined with train.zero_stage=3: the "
            "per-parameter optimizer state is read through ZeRO-1/2's fragment mappings, which "
            "ZeRO-3 does not have. Set train.reshardable_optimizer=false (a ZeRO-3 checkpoint "
            "still loads its weights at any layout with train.load_optimizer=false), or use "
            "train.zero_stage=1 or 2.")
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
        # ZeRO-0: our GuardedAdamW clips (and skips non-finite steps); ZeRO-1/2/3: DeepSpeed does
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
