"""Training metrics: TensorBoard scalars, a JSONL file, Weights & Biases, the rank-0 console line.

Scalars (under train/): loss, perplexity, lr, grad_norm, tokens_per_s, tflops_per_device, mfu,
memory_gib, skipped_steps (non-finite steps so far), and on logged steps time_<phase> (the step's
time breakdown, train.timing_breakdown); under valid/: loss and perplexity every
train.eval_interval steps and at the end, and valid/<name>/... for each of data.valid_sets.
Achieved FLOPs use the same count as `megatron-id params` (training FLOPs per token,
model/accounting.py) and MFU is against train.peak_tflops per device.

Every step's scalars go, on rank 0, to TensorBoard (train.tensorboard_dir), to one line of
train.metrics_file ({"step": s, "train/loss": ..., ...}: the same names and values) and to
wandb (train.wandb.project), as torchtitan's and Megatron-LM's loggers do.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path

import torch

from ..config import ConfigError
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
    def __init__(self, cfg, layout, is_logger: bool, start_step: int = 0, wandb_run_id: str | None = None):
        self.layout, self.peak = layout, cfg.train.peak_tflops
        self.report = report(cfg.model)   # parameters and FLOPs, counted once
        self.flops_per_token = self.report.training_flops_per_token
        self.devices = layout.tensor * layout.pipe * layout.gradient_replicas
        self.interval = max(cfg.train.log_interval, 1)
        self.writer = self.jsonl = self.wandb_run = None
        self.pending: dict = {}
        if is_logger and cfg.train.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(cfg.train.tensorboard_dir)
        if is_logger and cfg.train.metrics_file:
            self.jsonl = open_metrics_file(cfg.train.metrics_file, start_step)
        if is_logger and wandb_enabled(cfg):
            self.wandb_run = start_wandb(cfg, wandb_run_id)
        self.is_logger = is_logger
        self.start = self.last = time.time()
        self.first_step = None

    @property
    def wandb_run_id(self) -> str | None:
        return None if self.wandb_run is None else self.wandb_run.id

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
        if self.wandb_run is not None:
            where = getattr(self.wandb_run, "url", None) or f"{cfg.train.wandb.mode.value}, {self.wandb_run.dir}"
            print(f"wandb: run {self.wandb_run.id} ({where})", file=sys.stderr, flush=True)

    def _planned_gib(self, cfg) -> float:
        """The planner's estimate for this layout, to compare with the `mem` column."""
        from .distributed import uses_cuda
        from .plan import run_estimate_gib
        return run_estimate_gib(cfg, self.layout, on_gpu=uses_cuda())

    def logs(self, step: int) -> bool:
        """Whether `step` prints its line (and measures its time breakdown)."""
        return step % self.interval == 0 or step == self.layout.train_iters

    def step(self, step: int, loss: float, lr: float, grad_norm, start_step: int, skipped: int = 0,
             timing: dict | None = None) -> dict:
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
        for phase, value in (timing or {}).items():
            values[f"time_{phase}"] = value
        self._record({f"train/{name}": value for name, value in values.items()}, step)
        if self.is_logger and self.logs(step):
            done = step - start_step
            eta = (now - self.start) / max(done, 1) * (self.layout.train_iters - step)
            print(f"step {step}/{self.layout.train_iters} {progress_bar(step / self.layout.train_iters)} | loss {loss:.4f} | ppl {values['perplexity']:.1f} | "
                  f"lr {lr:.2e} | grad {values.get('grad_norm', float('nan')):.3f} | "
                  f"{tokens_per_s:,.0f} tok/s | {tflops:.3f} TFLOP/s/dev | MFU {100 * values['mfu']:.2f}% | "
                  f"mem {values['memory_gib']:.2f} GiB | skipped {skipped} | ETA {eta:,.0f} s", file=sys.stderr, flush=True)
            if timing:
                total = timing.get("step") or sum(v for k, v in timing.items() if k != "step")
                parts = " | ".join(f"{k.replace('_', ' ')} {v:.3f} s ({100 * v / max(total, 1e-9):.0f}%)"
                                   for k, v in timing.items() if k != "step")
                print(f"  time of step {step}: {parts} | step {total:.3f} s", file=sys.stderr, flush=True)
        return values

    def validation(self, step: int, loss: float | None, name: str | None = None) -> None:
        """The split's validation loss (name None), or that of data.valid_sets' `name`."""
        if loss is None:
            return
        tag = "valid" if name is None else f"valid/{name}"
        self._record({f"{tag}/loss": loss, f"{tag}/perplexity": perplexity(loss)}, step)
        if self.is_logger:
            what = "validation" if name is None else f"validation set {name}"
            print(f"{what} at step {step} | loss {loss:.4f} | ppl {perplexity(loss):.1f}",
                  file=sys.stderr, flush=True)

    def _record(self, scalars: dict, step: int) -> None:
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        self.pending.update(scalars)

    def end_step(self, step: int) -> None:
        """After a step's scalars (and its validations): one JSONL line and one wandb row."""
        if not self.pending:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **self.pending}) + "\n")
            self.jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(dict(self.pending), step=step)
        self.pending = {}

    def close(self):
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def open_metrics_file(path, start_step: int):
    """train.metrics_file for appending after step `start_step`: the lines of later steps (written
    by a run that stopped after its last checkpoint) are dropped first, so every step has one
    line; rewritten through a temporary file, so a kill never leaves half a file."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ConfigError(f"train.metrics_file={path} is a folder: give a file path, e.g. {path}/metrics.jsonl.")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= start_step:
                    kept.append(line)
            except (json.JSONDecodeError, AttributeError):
                raise ConfigError(f"train.metrics_file={path} holds a line that is not a JSON object ({line[:60]!r}): "
                                  f"it is not a metrics file of this trainer; give another path.") from None
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)
    return open(path, "a")


def wandb_enabled(cfg) -> bool:
    w = cfg.train.wandb
    return w.project is not None and w.mode.value != "disabled"


def check_wandb(cfg) -> None:
    """Before any work: wandb asked for and not installed is a one-line error with the fix."""
    if not wandb_enabled(cfg):
        return
    import importlib.util
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"train.wandb.project={cfg.train.wandb.project} asks for Weights & Biases, which is not "
                          f"installed: pip install 'megatron_id[wandb]' (or wandb), or set "
                          f"train.wandb.mode=disabled.")


def start_wandb(cfg, run_id: str | None):
    """wandb.init on rank 0; `run_id` (from the checkpoint resumed) continues that run."""
    import wandb
    from omegaconf import OmegaConf
    w = cfg.train.wandb
    os.environ.setdefault("WANDB_SILENT", "true")
    if w.dir:
        Path(w.dir).mkdir(parents=True, exist_ok=True)
    config = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    return wandb.init(project=w.project, entity=w.entity, name=w.name, group=w.group, tags=list(w.tags) or None,
                      mode=w.mode.value, dir=w.dir, id=run_id or uuid.uuid4().hex[:8], resume="allow",
                      config=config)
