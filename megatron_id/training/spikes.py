"""Loss spikes: skip the update of a spiky batch; after a few, roll back and skip their data.

A step is a spike (train.spike_factor > 0) when its loss, the mean over the global batch, is
above train.spike_factor x the median of the last train.spike_window accepted steps' losses
(detection starts once that many were seen), or when its loss or gradient norm is not finite.
The decision is taken inside the optimizer step (GuardedAdamW, training/optim.py: the loss sum
and count travel in the all-reduce it does anyway), so every rank skips the same update, under
every engine and ZeRO stage. The step is logged with its step number and the global sample
indices of its batch, and counted (train/spikes).

Rollback (train.spike_rollback_after = M > 0): after M spikes within train.spike_rollback_window
steps, the run reloads the latest checkpoint of train.save in process and goes on from it with
the batches of those spikes that came after that checkpoint left out of the data order. The
data order is then the sampler's order with these sample ranges skipped (PretrainingSampler's
`skipped`): step s reads positions (s - 1) x global batch onwards of what is left. The ranges
are kept in every later checkpoint (ClientState.spikes), so a resume skips the same samples; a
kill before the next checkpoint resumes from the one rolled back to, meets the same spikes
(the same weights, data and RNG) and rolls back to the same place again. The data holds
train_iters x global batch samples: a run that skipped k samples reads the first k of its order
a second time at its end, and keeps its length in steps and its schedule [our choice].

As PaLM (section 5.1: restart ~100 steps before a spike and skip 200-500 batches), OLMo 2 and
Megatron-DeepSpeed's --train-range-to-skip, automated; llm-foundry's KillLossSpike (a window of
100, a multiple of its median) stops the run where this rolls back.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections import deque

from ..data.gpt_dataset import stream_positions
from ..errors import UserError


class LossSpikeError(UserError, RuntimeError):
    """M spikes within the window and no checkpoint to roll back to."""

    same_on_every_rank = True   # the decisions are agreed by all ranks


@dataclasses.dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    limit: float | None        # the loss above which the step was a spike (None: non-finite)
    samples: tuple[int, int]   # [first, end) of its global batch in the unskipped order (see below)

    def describe(self, total: int) -> str:
        why = "non-finite loss or gradient" if self.limit is None else f"loss {self.loss:.4g} > {self.limit:.4g}"
        samples = sample_text(self.samples, total)
        return f"step {self.step}: loss spike ({why}), update skipped; global samples {samples}"


def sample_text(span: tuple[int, int], total: int) -> str:
    """The dataset indices of a span of the unskipped order, e.g. '40-47' (indices wrap at `total`)."""
    first, end = span
    if total and first // total != (end - 1) // total:   # wraps past the data's end
        return f"{first % total}-{total - 1}, 0-{(end - 1) % total}"
    return f"{first % total if total else first}-{(end - 1) % total if total else end - 1}"


class SpikeMonitor:
    """The running median, the decision and the record: one per Trainer, the same on every rank
    (it only sees values every rank agreed on)."""

    def __init__(self, t, global_batch_size: int, total_samples: int):
        self.factor, self.window = t.spike_factor, t.spike_window
        self.rollback_after, self.rollback_window = t.spike_rollback_after, t.spike_rollback_window
        self.batch, self.total = global_batch_size, total_samples
        self.recent: deque[float] = deque(maxlen=max(self.window, 1))
        self.spikes: list[Spike] = []          # those within the rollback window
        self.skipped: list[tuple[int, int]] = []   # sample ranges left out of the order (sorted)
        self.count = 0                          # spikes in this run (undone ones included)
        self.rollbacks = 0

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def limit(self) -> float | None:
        """The loss above which the next step is a spike (None: no detection yet)."""
        if not self.enabled or len(self.recent) < self.window:
            return None
        return self.factor * statistics.median(self.recent)

    def batch_span(self, step: int) -> tuple[int, int]:
        """Step `step`'s global batch as [first, end) of the order without skips (its indices run
        over the data's end: index % total_samples is the dataset's)."""
        first = stream_positions((step - 1) * self.batch, 1, self.skipped)[0]
        return first, first + self.batch

    def batch_samples(self, step: int) -> list[int]:
        """The dataset indices of step `step`'s global batch (every DP rank's micro-batches)."""
        return [i % self.total for i in stream_positions((step - 1) * self.batch, self.batch, self.skipped)]

    def after_step(self, step: int, loss: float, spiked: bool, nonfinite: bool, limit: float | None) -> Spike | None:
        """Record step `step` (its loss, whether the guard vetoed it as a spike or as non-finite)."""
        if not self.enabled:
            return None
        if not spiked and not nonfinite:
            self.recent.append(loss)
            return None
        spike = Spike(step, loss, None if nonfinite else limit, self.batch_span(step))
        self.count += 1
        self.spikes = [s for s in self.spikes if s.step > step - self.rollback_window] + [spike]
        return spike

    def rollback_due(self) -> bool:
        return self.rollback_after > 0 and len(self.spikes) >= self.rollback_after

    def state(self) -> dict:
        """What a checkpoint records (ClientState.spikes): plain values."""
        return {"recent": list(self.recent), "spikes": [dataclasses.asdict(s) for s in self.spikes],
                "skipped": [list(r) for r in self.skipped], "count": self.count, "rollbacks": self.rollbacks}

    def load(self, saved: dict | None) -> None:
        """A checkpoint's record (None: written before spikes were recorded: nothing skipped)."""
        saved = saved or {}
        self.recent = deque(saved.get("recent", []), maxlen=max(self.window, 1))
        self.spikes = [Spike(s["step"], s["loss"], s["limit"], tuple(s["samples"])) for s in saved.get("spikes", [])]
        self.skipped = sorted(tuple(r) for r in saved.get("skipped", []))
        self.count, self.rollbacks = saved.get("count", 0), saved.get("rollbacks", 0)


# ------------------------------------------------------------ the trainer's hooks (training/engine.py)

def arm(trainer) -> None:
    """Before a step: the guard learns the loss limit of the step and any injected poison."""
    step, spikes = trainer.step + 1, trainer.spikes
    samples = spikes.batch_samples(step) if trainer.faults else ()
    trainer.guard.begin_step(spikes.limit(), trainer.faults.loss_factor(step, samples))


def observe(trainer, loss: float, metrics) -> bool:
    """After a step (its non-finite count done): a spike is logged and counted (train/spikes).
    Returns whether M spikes within the window call for a rollback (roll_back, before any save)."""
    spikes = trainer.spikes
    spike = spikes.after_step(trainer.step, loss, trainer.guard.spiked, trainer.last_skipped, trainer.guard.loss_limit)
    if spikes.enabled:
        metrics.spikes(trainer.step, spikes.count, None if spike is None else spike.describe(spikes.total))
    return spike is not None and spikes.rollback_due()


def roll_back(trainer) -> None:
    """Reload the latest checkpoint of train.save in process and go on from it with the batches
    of the window's spikes after it skipped; the next checkpoints record them."""
    import sys

    import torch.distributed as dist

    from ..checkpoint.files import latest_folder, step_of
    spikes, t = trainer.spikes, trainer.cfg.train
    trainer.wait_for_saves()
    folder = latest_folder(t.save) if t.save else None
    steps = ", ".join(str(s.step) for s in spikes.spikes)
    if folder is None:
        raise LossSpikeError(
            f"stopping at step {trainer.step}: {len(spikes.spikes)} loss spikes within "
            f"{spikes.rollback_window} steps (steps {steps}; train.spike_rollback_after={spikes.rollback_after}) and "
            f"no checkpoint to roll back to ({trainer._last_checkpoint()}). Save sooner (train.save_interval), "
            f"raise train.spike_rollback_after, or set it to 0 to only skip the spiky updates.")
    at, count, rollbacks = step_of(folder.name), spikes.count, spikes.rollbacks + 1
    new = [s.samples for s in spikes.spikes if s.step > at]
    trainer.load_checkpoint(t.save)   # weights, optimizer, step, RNG and its spike record
    spikes.count, spikes.rollbacks = count, rollbacks
    spikes.skipped = sorted({*spikes.skipped, *new})
    trainer._restart_sampler()
    trainer.saved_step, trainer.nonfinite_in_a_row = trainer.step, 0
    if dist.get_rank() == 0:
        ranges = "; ".join(sample_text(r, spikes.total) for r in new)
        print(f"rolled back to {folder} (step {at}) after loss spikes at steps {steps} "
              f"(train.spike_rollback_after={spikes.rollback_after} within {spikes.rollback_window} steps); "
              f"skipping global samples {ranges} from now on", file=sys.stderr, flush=True)
