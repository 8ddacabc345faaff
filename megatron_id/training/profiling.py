"""Where a step's time goes: a profiler window (train.profile) and the per-step breakdown
(train.timing_breakdown).

ProfileWindow: torch.profiler over steps start_step .. start_step + steps - 1 on the ranks
listed, then a Chrome trace `<dir>/rank<r>.steps<a>-<b>.pt.trace.json` (chrome://tracing,
Perfetto, or TensorBoard's profiler plugin: `tensorboard --logdir <dir>`) and, on CUDA, a memory
snapshot `<dir>/rank<r>.steps<a>-<b>.memory.pickle` (https://pytorch.org/memory_viz). As
torchtitan's `profiling` section and flame's `--profiling.*`; Megatron-LM's --profile with
--profile-step-start/end.

StepTimer: wall time of a step's phases (data wait, forward, backward with the gradient
reduction DeepSpeed runs at the accumulation boundary, optimizer; under pipelining the 1F1B
schedule as one phase), measured on the steps that print a log line. On CUDA it synchronises
the device around each phase on those steps only (kernels are asynchronous: without it a phase
would show the time to launch its kernels, not to run them). With `every_step` set (the slow-rank
report, training/stragglers.py, reads the data phase of every step) the phases are also timed
on the other steps, by the host clock alone: no synchronisation there.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch


class StepTimer:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.enabled, self.phases, self.started = False, {}, 0.0
        self.every_step = False   # host times of the phases on every step too (no device synchronisation)

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def start(self, enabled: bool) -> None:
        self.enabled, self.phases = enabled, {}
        if enabled:
            self._sync()
            self.started = time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        if not self.enabled and not self.every_step:
            yield
            return
        if self.enabled:
            self._sync()
        began = time.perf_counter()
        try:
            yield
        finally:
            if self.enabled:
                self._sync()
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - began

    def result(self) -> dict | None:
        """{phase: seconds, ..., 'step': the whole step} or None when this step was not timed.
        What no phase covers (the LR update, the loss's reduction over data parallelism) is
        the difference between the step and the sum of the phases."""
        if not self.enabled:
            return None
        self._sync()
        return {**self.phases, "step": time.perf_counter() - self.started}


class ProfileWindow:
    def __init__(self, cfg, rank: int, device):
        p = cfg.train.profile
        self.active = p.dir is not None and rank in list(p.ranks)
        self.dir, self.first, self.last = (Path(p.dir) if p.dir else None), p.start_step, p.start_step + p.steps - 1
        self.rank, self.cuda = rank, torch.device(device).type == "cuda"
        self.memory = p.memory_snapshot and self.cuda
        self.profiler, self.started_at = None, None

    def before_step(self, step: int) -> None:
        """`step` is the number of the step about to run (1-based)."""
        if not self.active or self.profiler is not None or not self.first <= step <= self.last:
            return
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profiler.__enter__()
        self.started_at = step

    def after_step(self, step: int) -> None:
        if self.profiler is not None and step >= self.last:
            self._finish(step)

    def close(self, step: int) -> None:
        """The run ended inside the window: write what was traced."""
        if self.profiler is not None:
            self._finish(step)

    def _finish(self, step: int) -> None:
        self.profiler.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = self.dir / f"rank{self.rank}.steps{self.started_at}-{step}"
        trace = Path(f"{stem}.pt.trace.json")
        self.profiler.export_chrome_trace(str(trace))
        written = [str(trace)]
        if self.memory:
            torch.cuda.memory._dump_snapshot(f"{stem}.memory.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(f"{stem}.memory.pickle")
        self.profiler = None
        print(f"profile of steps {self.started_at}-{step} on rank {self.rank}: {', '.join(written)}",
              file=sys.stderr, flush=True)
