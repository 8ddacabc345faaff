"""Everything about a run's layout that can be checked before training starts, and the
DeepSpeed config generated from ours.

`training_layout(cfg, world_size)` returns sizes and step counts, or raises ConfigError naming
the setting and the fix: the layout itself through the one validator (parallel/layout.py: a
world size that is not TP x PP x DP, heads/vocab/FFN not divisible by TP, layers not divisible
into pipeline stages, ZeRO-2/3 with pipelines), then ZeRO-3 with train.reshardable_optimizer,
a global batch that micro-batch x DP does not divide and a token budget below one step, and
train.compile with what cannot compile (training/compilation.py).

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
from .carry import check_carry_layout
from .compilation import check_compile_config
from .distill import check_distill_layout
from .downstream import check_eval_tasks


@dataclass(frozen=True)
class Layout:
    tensor: int
    pipe: int
    data: int                  # data-parallel replicas that read different samples
    micro_batch_size: int
    gradient_accumulation: int
    global_batch_size: int
    tokens_per_step: int
    train_iters: int
    context: int = 1           # ranks sharing each sample, one block of it each

    @property
    def gradient_replicas(self) -> int:
        """Ranks whose gradients are averaged (DeepSpeed's data-parallel group): DP x CP."""
        return self.data * self.context


def training_layout(cfg: Config, world_size: int) -> Layout:
    p, t, m = cfg.parallel, cfg.train, cfg.model
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = check_layout(m, world_size, tp, pp, t.zero_stage, p.sequence_parallel)
    cp = p.context_parallel_size
    if cp != 1:
        dp = check_context_parallel(cfg, dp)
    check_compile_config(cfg)   # train.compile with what cannot compile
    if t.zero_stage == 3 and t.reshardable_optimizer:
        raise ConfigError(
            "train.reshardable_optimizer=true cannot be combined with train.zero_stage=3: the "
            "per-parameter optimizer state is read through ZeRO-1/2's fragment mappings, which "
            "ZeRO-3 does not have. Set train.reshardable_optimizer=false (a ZeRO-3 checkpoint "
            "still loads its weights at any layout with train.load_optimizer=false), or use "
            "train.zero_stage=1 or 2.")
    if not t.save_optimizer and (t.zero_stage == 3 or t.reshardable_optimizer):
        raise ConfigError(
            "train.save_optimizer=false cannot be combined with "
            + ("train.zero_stage=3: ZeRO-3 keeps the weights themselves in its optimizer files, so a "
               "checkpoint without them has no weights. Use train.zero_stage=1 or 2 for weights-only "
               "checkpoints, or keep train.save_optimizer=true (megatron-id export-hf writes the "
               "weights alone from any checkpoint)."
               if t.zero_stage == 3 else
               "train.reshardable_optimizer=true, which saves the optimizer state a second time (optim/). "
               "Set one of them: train.reshardable_optimizer=false for weights-only checkpoints, or "
               "train.save_optimizer=true to keep the optimizer state."))
    if t.zero_stage == 3 and t.fused_lm_head_loss:
        raise ConfigError(
            "train.fused_lm_head_loss=true cannot be combined with train.zero_stage=3: ZeRO-3 "
            "gathers a module's partitioned weights only around that module's own forward and "
            "backward, and the fused loss uses the LM head's weight outside lm_head.forward "
            "(parallel/fused_cross_entropy.py). Set train.fused_lm_head_loss=false, or use "
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
    layout = Layout(tp, pp, dp, t.micro_batch_size, t.global_batch_size // per_step,
                    t.global_batch_size, tokens_per_step, iters, cp)
    check_distill_layout(cfg, layout)   # what a teacher beside the student cannot run with
    check_carry_layout(cfg, layout)     # what data.carry_state cannot run with
    check_eval_tasks(cfg, layout)       # train.eval_tasks: known tasks and options, PP=1
    return layout


def check_context_parallel(cfg: Config, dp_and_cp: int) -> int:
    """parallel.context_parallel_size=C against the rest; returns the data-parallel size left."""
    p, m = cfg.parallel, cfg.model
    cp = p.context_parallel_size
    if cp < 1 or dp_and_cp % cp:
        raise ConfigError(f"parallel.context_parallel_size={cp} must be >= 1 and divide the ranks left after "
                          f"TP x PP ({dp_and_cp}): world = TP x CP x PP x DP.")
    if m.seq_length % cp:
        raise ConfigError(f"parallel.context_parallel_size={cp} splits model.seq_length={m.seq_length} into "
                          f"equal blocks: use a sequence length divisible by {cp}.")
    if p.pipeline_model_parallel_size > 1:
        raise ConfigError("parallel.context_parallel_size > 1 with parallel.pipeline_model_parallel_size > 1 "
                          "is not supported yet: use TP x CP x DP (set one of them to 1).")
    if p.sequence_parallel:
        raise ConfigError("parallel.context_parallel_size > 1 with parallel.sequence_parallel=true is not "
                          "supported yet: context parallelism already splits the sequence; set "
                          "parallel.sequence_parallel=false.")
    return dp_and_cp // cp


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
        # DeepSpeed counts every rank of its data-parallel group (DP x CP) as reading its own
        # micro-batch: under context parallelism the C ranks of a sample each hold one block
        "train_batch_size": layout.global_batch_size * layout.context,
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
            merged["gradient_accumulation_steps"] * layout.gradient_replicas:
        raise ConfigError("train.deepspeed overrides make train_batch_size differ from micro-batch "
                          "x gradient accumulation x data-parallel size; set the batch through "
                          "train.micro_batch_size and train.global_batch_size instead.")
    return merged
