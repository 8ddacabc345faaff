"""Training metrics: TensorBoard scalars and the rank-0 console line.

Scalars (under train/): loss, perplexity, lr, grad_norm, tokens_per_s, tflops_per_device, mfu,
memory_gib, skipped_steps (non-finite steps so far); under valid/: loss and perplexity every train.eval_interval steps and at the end. Achieved FLOPs use the same count as `megatron-id params` (training FLOPs per token,
model/accounting.py) and MFU is against train.peak_tflops per device.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch

from ..model.accounting import report
from ..model.pattern import model_label


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))   # capped: a diverged loss must not overflow the log


def progress_bar(fraction: float, width: int = 20) -> str:
    filled = int(round(max(0.0, min(fraction, 1.0)) * width))
    return "[" + "#" * filled + "." * (width - filled) + f"] {100 * fraction:3.0f}%"


def memory_gib() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def defaults_that_decided(cfg) -> str:
    """A sentence naming the model shape and budget keys no config file or override set (the
    schema's defaults: the 125M model, 4K context, the paper's budget), '' when all were given."""
    from omegaconf import OmegaConf
    from ..config import defaulted_keys
    groups = {"the model": ("model.d_model", "model.n_layers", "model.n_heads", "model.vocab_size",
                            "model.seq_length"),
              "the budget": ("train.train_tokens", "train.global_batch_size")}
    parts = []
    for what, keys in groups.items():
        missing = defaulted_keys(cfg, keys)
        if missing:
            shown = ", ".join(f"{k}={OmegaConf.select(OmegaConf.structured(cfg), k)}" for k in missing)
            parts.append(f"{what}: {shown}")
    return ("the schema's defaults decided " + "; ".join(parts) +
            " (no config file or override sets them)") if parts else ""


class Metrics:
    def __init__(self, cfg, layout, is_logger: bool):
        self.layout, self.peak = layout, cfg.train.peak_tflops
        self.report = report(cfg.model)   # parameters and FLOPs, counted once
        self.flops_per_token = self.report.training_flops_per_token
        self.devices = layout.tensor * layout.pipe * layout.gradient_replicas
        self.interval = max(cfg.train.log_interval, 1)
        self.writer = None
        if is_logger and cfg.train.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(cfg.train.tensorboard_dir)
        self.is_logger = is_logger
        self.start = self.last = time.time()
        self.first_step = None

    def header(self, cfg, start_step: int) -> None:
        """One line before the first step: what is trained, on which layout, for how long."""
        if not self.is_logger:
            return
        m, lay, r = cfg.model, self.layout, self.report
        print(f"training {model_label(m)} d_model={m.d_model} n_layers={m.n_layers} ({r.parameters:,} parameters) | "
              f"TP={lay.tensor} PP={lay.pipe} DP={lay.data} ZeRO-{cfg.train.zero_stage} | global batch "
              f"{lay.global_batch_size} x {m.seq_length} tokens = micro-batch {lay.micro_batch_size} x "
              f"{lay.gradient_accumulation} accumulation x {lay.data} DP | steps {start_step + 1}-{lay.train_iters} | "
              f"planned memory {self._planned_gib(cfg):.1f} GiB per rank (megatron-id plan)",
              file=sys.stderr, flush=True)
        defaults = defaults_that_decided(cfg)
        if defaults:
            print(f"note: {defaults}", file=sys.stderr, flush=True)

    def _planned_gib(self, cfg) -> float:
        """The planner's estimate for this layout, to compare with the `mem` column."""
        from .distributed import uses_cuda
        from .plan import run_estimate_gib
        return run_estimate_gib(cfg, self.layout, on_gpu=uses_cuda())

    def step(self, step: int, loss: float, lr: float, grad_norm, start_step: int, skipped: int = 0) -> dict:
        now = time.time()
        seconds, self.last = now - self.last, now
        tokens_per_s = self.layout.tokens_per_step / max(seconds, 1e-9)
        tflops = self.flops_per_token * tokens_per_s / 1e12 / self.devices
        values = {"loss": loss, "perplexity": perplexity(loss), "lr": lr,
                  "tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
                  "mfu": tflops / self.peak if self.peak else 0.0, "memory_gib": memory_gib(),
                  "skipped_steps": skipped}
        if grad_norm is not None and math.isfinite(float(grad_norm)):
            values["grad_norm"] = float(grad_norm)
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(f"train/{name}", value, step)
            self.writer.flush()
        if self.is_logger and (step % self.interval == 0 or step == self.layout.train_iters):
            done = step - start_step
            eta = (now - self.start) / max(done, 1) * (self.layout.train_iters - step)
            print(f"step {step}/{self.layout.train_iters} {progress_bar(step / self.layout.train_iters)} | loss {loss:.4f} | ppl {values['perplexity']:.1f} | "
                  f"lr {lr:.2e} | grad {values.get('grad_norm', float('nan')):.3f} | "
                  f"{tokens_per_s:,.0f} tok/s | {tflops:.3f} TFLOP/s/dev | MFU {100 * values['mfu']:.2f}% | "
                  f"mem {values['memory_gib']:.2f} GiB | skipped {skipped} | ETA {eta:,.0f} s", file=sys.stderr, flush=True)
        return values

    def validation(self, step: int, loss: float | None) -> None:
        if loss is None:
            return
        if self.writer is not None:
            self.writer.add_scalar("valid/loss", loss, step)
            self.writer.add_scalar("valid/perplexity", perplexity(loss), step)
            self.writer.flush()
        if self.is_logger:
            print(f"validation at step {step} | loss {loss:.4f} | ppl {perplexity(loss):.1f}",
                  file=sys.stderr, flush=True)

    def close(self):
        if self.writer is not None:
            self.writer.close()
