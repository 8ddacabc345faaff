"""Training metrics: TensorBoard scalars, a JSONL file, Weights & Biases, the rank-0 console line.

Scalars (under train/): loss, perplexity, lr, grad_norm, tokens_per_s, tflops_per_device, mfu,
memory_gib, skipped_steps (non-finite steps so far), spikes (loss spikes so far, with
train.spike_factor > 0: training/spikes.py), and on logged steps time_<phase> (the step's
time breakdown, train.timing_breakdown); under valid/: loss and perplexity every
train.eval_interval steps and at the end, and valid/<name>/... for each of data.valid_sets;
under ranks/ the slow-rank report every train.straggler_interval steps (training/stragglers.py).
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

from ..allocator import resident_bytes
from ..atomic import write_atomic_bytes
from ..config import ConfigError, defaulted_keys
from ..model.accounting import report
from ..model.pattern import model_label
from .distributed import uses_cuda
from .plan import run_estimate_gib


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))   # capped: a diverged loss must not overflow the log


def progress_bar(fraction: float, width: int = 20) -> str:
    filled = int(round(max(0.0, min(fraction, 1.0)) * width))
    return "[" + "#" * filled + "." * (width - filled) + f"] {100 * fraction:3.0f}%"


def memory_gib() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return (resident_bytes() or 0) / 2**30


def defaults_that_decided(cfg) -> str:
    """A sentence naming the model shape and budget keys no config file or override set (the
    schema's defaults: the 125M model, 4K context, the paper's budget), '' when all were given."""
    from omegaconf import OmegaConf
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
    def __init__(self, cfg, layout, is_logger: bool, start_step: int = 0, wandb_run_id: str | None = None,
                 metrics_record: dict | None = None, resumed: bool = False):
        self.layout, self.peak = layout, cfg.train.peak_tflops
        self.report = report(cfg.model)   # parameters and FLOPs, counted once
        self.flops_per_token = self.report.training_flops_per_token
        self.devices = layout.tensor * layout.pipe * layout.gradient_replicas
        self.interval = max(cfg.train.log_interval, 1)
        self.start_step = start_step
        self.writer = self.jsonl = self.wandb_run = None
        self.pending: dict = {}
        if is_logger and cfg.train.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(cfg.train.tensorboard_dir)
        if is_logger and cfg.train.metrics_file:
            self.jsonl = open_metrics_file(cfg.train.metrics_file, start_step, metrics_record, resumed)
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
        return run_estimate_gib(cfg, self.layout, on_gpu=uses_cuda())

    def logs(self, step: int) -> bool:
        """Whether `step` prints its line (and measures its time breakdown): the run's first step
        (step 1's loss, ln of the vocabulary at init, or a resume's first loss beside the one
        before it), every train.log_interval-th and the last (torchtitan logs step 1 too;
        Megatron-LM's first line comes at log_interval). Every step's scalars are recorded."""
        return step == self.start_step + 1 or step % self.interval == 0 or step == self.layout.train_iters

    def step(self, step: int, loss: float, lr: float, grad_norm, start_step: int, skipped: int = 0,
             timing: dict | None = None, parts: dict | None = None) -> dict:
        """parts (train.distill): {"objective": "kl", "kl": ..., "lm_loss": ...} in stage logits, whose
        loss is their weighted sum and whose perplexity is the next-token loss's; {"objective": "mse"}
        in stage layers, whose loss is the MSE and has no perplexity."""
        now = time.time()
        seconds, self.last = now - self.last, now
        tokens_per_s = self.layout.tokens_per_step / max(seconds, 1e-9)
        tflops = self.flops_per_token * tokens_per_s / 1e12 / self.devices
        parts = parts or {}
        lm_loss = parts.get("lm_loss", None if parts else loss)
        values = {"loss": loss, "lr": lr,
                  "tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
                  "mfu": tflops / self.peak if self.peak else 0.0, "memory_gib": memory_gib(),
                  "skipped_steps": skipped}
        if lm_loss is not None:
            values["perplexity"] = perplexity(lm_loss)
        if "kl" in parts:
            values["distill_kl"], values["lm_loss"] = parts["kl"], parts["lm_loss"]
        if grad_norm is not None and math.isfinite(float(grad_norm)):
            values["grad_norm"] = float(grad_norm)
        for phase, value in (timing or {}).items():
            values[f"time_{phase}"] = value
        self._record({f"train/{name}": value for name, value in values.items()}, step)
        if self.is_logger and self.logs(step):
            done = step - start_step
            eta = (now - self.start) / max(done, 1) * (self.layout.train_iters - step)
            if "kl" in parts:   # the objective, its parts, and the perplexity of the next-token loss
                said = (f"loss {loss:.4f} (kl {parts['kl']:.4f}, lm {parts['lm_loss']:.4f}) | "
                        f"ppl {values['perplexity']:.1f}")
            elif parts.get("objective") == "mse":
                said = f"loss {loss:.6f} (mse of the converted mixers)"
            else:
                said = f"loss {loss:.4f} | ppl {values['perplexity']:.1f}"
            print(f"step {step}/{self.layout.train_iters} {progress_bar(step / self.layout.train_iters)} | {said} | "
                  f"lr {lr:.2e} | grad {values.get('grad_norm', float('nan')):.3f} | "
                  f"{tokens_per_s:,.0f} tok/s | {tflops:.3f} TFLOP/s/dev | MFU {100 * values['mfu']:.2f}% | "
                  f"mem {values['memory_gib']:.2f} GiB | skipped {skipped} | ETA {eta:,.0f} s",
                  file=sys.stderr, flush=True)
            if timing:
                total = timing.get("step") or sum(v for k, v in timing.items() if k != "step")
                parts = " | ".join(f"{k.replace('_', ' ')} {v:.3f} s ({100 * v / max(total, 1e-9):.0f}%)"
                                   for k, v in timing.items() if k != "step")
                print(f"  time of step {step}: {parts} | step {total:.3f} s", file=sys.stderr, flush=True)
        return values

    def spikes(self, step: int, count: int, line: str | None) -> None:
        """train.spike_factor > 0: the spikes so far (train/spikes) and, on a spike, its line (the
        step and its batch's global sample indices, training/spikes.py), on every step."""
        self._record({"train/spikes": count}, step)
        if line is not None and self.is_logger:
            print(line, file=sys.stderr, flush=True)

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

    def scalars(self, values: dict, step: int) -> None:
        """Scalars from another part of the loop (the ranks/ report, train.eval_tasks'
        eval/<task>/<metric>), recorded with the step's own in every sink."""
        self._record(values, step)

    def text(self, name: str, value: str, step: int) -> None:
        """Text beside the step's scalars, under `name`: TensorBoard's text tab, the JSONL line and
        the wandb row (the slow ranks named, training/stragglers.py)."""
        if self.writer is not None:
            self.writer.add_text(name, value, step)
            self.writer.flush()
        self.pending[name] = value

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


def _metrics_lines(path: Path) -> list[tuple[int, str]]:
    """(step, line) of every line of an existing train.metrics_file; a line that is not one of
    ours is refused (the file is someone else's)."""
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line).get("step", 0)
        except (json.JSONDecodeError, AttributeError):
            raise ConfigError(f"train.metrics_file={path} holds a line that is not a JSON object ({line[:60]!r}): "
                              f"it is not a metrics file of this trainer; give another path.") from None
        lines.append((step if isinstance(step, int) else 0, line))
    return lines


def check_metrics_file(path) -> None:
    """Before any work: train.metrics_file must be a file we can write, and hold only our lines."""
    if not path:
        return
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ConfigError(f"train.metrics_file={path} is a folder: give a file path, e.g. {path}/metrics.jsonl.")
    found = path.parent
    while not found.exists() and found != found.parent:
        found = found.parent
    if not found.is_dir():
        raise ConfigError(f"train.metrics_file={path}: {found} is a file, not a folder: give a path in a folder.")
    target = path if path.exists() else found
    if not os.access(target, os.W_OK) or (target is found and not os.access(found, os.X_OK)):
        raise ConfigError(f"train.metrics_file={path}: {target} is not writable: check its permissions or give "
                          f"another path.")
    if path.is_file():
        _metrics_lines(path)


def _steps(lines) -> str:
    return f"{len(lines)} line{'s' if len(lines) != 1 else ''} (steps {lines[0][0]}-{lines[-1][0]})"


def open_metrics_file(path, start_step: int, record: dict | None = None, resumed: bool = False):
    """train.metrics_file for appending the steps after `start_step`. Only a resume of the run
    that wrote the file trims it: `record` (the checkpoint's, {"path", "bytes"}: the file and its
    size when that checkpoint was saved) names this file and what follows those bytes is that
    run's own continuation past the checkpoint (steps above start_step, in order): those lines
    are dropped, so every step has one line. Anything else (a fresh run, a checkpoint that
    records another file or none, lines it cannot tell as its own) appends after the existing
    lines and says so: nothing is dropped. Rewritten through a temporary file, so a kill never
    leaves half a file."""
    path = Path(path)
    check_metrics_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.stat().st_size == 0:
        return open(path, "a")
    lines = _metrics_lines(path)
    if not lines:
        return open(path, "a")
    mine = (resumed and isinstance(record, dict) and record.get("path") == str(path.resolve())
            and isinstance(record.get("bytes"), int) and record["bytes"] <= path.stat().st_size)
    if mine:
        data = path.read_bytes()
        head, tail = data[:record["bytes"]], data[record["bytes"]:]
        later = [(s, line) for s, line in _parsed(tail)] if head.endswith(b"\n") or not head else None
        steps = [s for s, _ in later or []]
        if later is not None and all(s > start_step for s in steps) and steps == sorted(set(steps)):
            if later:
                write_atomic_bytes(path, head)
                print(f"train.metrics_file={path}: dropped the {_steps(later)} this run wrote after its "
                      f"checkpoint of step {start_step}, which it resumes from", file=sys.stderr, flush=True)
            return open(path, "a")
    if resumed:
        why = ("its checkpoint records no metrics file (saved before the checkpoints recorded it, or without "
               "train.metrics_file)" if not isinstance(record, dict) or not record.get("path") else
               f"its checkpoint records {record.get('path')}" if record.get("path") != str(path.resolve()) else
               "the file changed since the checkpoint")
        print(f"warning: train.metrics_file={path} holds {_steps(lines)} this resume cannot tell as its own "
              f"({why}): its steps from {start_step + 1} are appended after them and nothing is dropped; a "
              f"step may then have two lines (the later one is this run's).", file=sys.stderr, flush=True)
    else:
        print(f"warning: train.metrics_file={path} holds {_steps(lines)} of an earlier run: this run starts at "
              f"step {start_step + 1} and appends after them (nothing is dropped; give a new path to keep runs "
              f"apart).", file=sys.stderr, flush=True)
    return open(path, "a")


def _parsed(data: bytes) -> list[tuple[int, str]]:
    out = []
    for line in data.decode(errors="replace").splitlines():
        if line.strip():
            try:
                step = json.loads(line).get("step", 0)
            except (json.JSONDecodeError, AttributeError):
                step = -1
            out.append((step if isinstance(step, int) else -1, line))
    return out


def metrics_position(jsonl) -> dict | None:
    """What a checkpoint records of train.metrics_file (open_metrics_file's `record`)."""
    if jsonl is None:
        return None
    jsonl.flush()
    return {"path": str(Path(jsonl.name).resolve()), "bytes": jsonl.tell()}


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
    if cfg.train.wandb.mode.value == "online" and wandb_credentials() is False:
        raise ConfigError(f"train.wandb.mode=online (the default) uploads to W&B, and no API key was found "
                          f"(WANDB_API_KEY, or {_netrc_path()} for {_wandb_host()}): run `wandb login` or set "
                          f"WANDB_API_KEY, or set train.wandb.mode=offline (upload later with `wandb sync`) or "
                          f"train.wandb.mode=disabled.")


def _wandb_host() -> str:
    from urllib.parse import urlparse
    return urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"


def _netrc_path() -> Path:
    return Path(os.environ.get("NETRC") or Path.home() / ".netrc")


def wandb_credentials() -> bool | None:
    """Whether wandb will find credentials for an online run, from where it looks (its
    environment variables, the .netrc entry of its host, its settings file); None when that
    cannot be read (wandb.init decides then)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        import netrc
        path = _netrc_path()
        if path.is_file() and netrc.netrc(str(path)).authenticators(_wandb_host()):
            return True
        settings = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb") / "settings"
        if settings.is_file() and "api_key" in settings.read_text(errors="replace"):
            return True
    except Exception:   # an unreadable .netrc or settings file: let wandb itself decide
        return None
    return False


def start_wandb(cfg, run_id: str | None):
    """wandb.init on rank 0; `run_id` (from the checkpoint resumed) continues that run."""
    import wandb
    from omegaconf import OmegaConf
    w = cfg.train.wandb
    os.environ.setdefault("WANDB_SILENT", "true")
    if w.dir:
        Path(w.dir).mkdir(parents=True, exist_ok=True)
    config = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    try:
        return wandb.init(project=w.project, entity=w.entity, name=w.name, group=w.group,
                          tags=list(w.tags) or None, mode=w.mode.value, dir=w.dir,
                          id=run_id or uuid.uuid4().hex[:8], resume="allow", config=config)
    except wandb.errors.Error as err:   # a rejected key, no network, a bad entity: one line, not 40
        text = " ".join(str(err).split())[:300]
        raise ConfigError(f"wandb.init failed for train.wandb.project={w.project} (mode {w.mode.value}): {text}. "
                          f"Fix it (`wandb login`, the network, train.wandb.entity), or set "
                          f"train.wandb.mode=offline (upload later with `wandb sync`) or disabled.") from None
