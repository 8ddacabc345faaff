"""Slow ranks: each rank's time per step split into compute, data wait and communication,
gathered every train.straggler_interval steps; rank 0 names each rank that is
train.straggler_factor times slower than the median of its peers, with its host, pid and split.

    slow rank 3 (host gpu-node-17, pid 4121): 2.13x the other ranks' compute + data wait in the
    median step of steps 101-200 | compute 0.412 s, data 0.010 s, communication 0.021 s (median
    rank 5: compute 0.195 s, data 0.009 s, communication 0.240 s; train.straggler_factor=1.5)

Each rank keeps the split of every step of the window and sends that of its median step (by
compute + data wait): one slow step (a garbage-collection pause, a save, a hiccup of the host)
does not name a rank; a rank slow in most steps of the window is named.

How each part is measured, per step, on every rank:
- step: host wall time of Trainer.train_step (the step ends in the loss's `.item()`, so on CUDA
  the device's work is in it).
- data: the host time reading and staging micro-batches (StepTimer's data phase, timed on every
  step by the host clock; on CUDA the copy to the device is asynchronous and not in it).
- communication: time inside the step's data-parallel gradient reduction (the engine's
  allreduce_gradients, where DeepSpeed reduces at the accumulation boundary, ZeRO 0/1 wholly and
  ZeRO-2's last buckets) and, under pipelining, inside the schedule's gradient reductions and
  point-to-point sends and receives. Host clock on CPU; on CUDA a pair of CUDA events around each
  (no synchronisation; read after the step's own `.item()`).
- compute: the rest (step - data - communication): forward, backward, optimizer, and what the
  other parts do not see.

Why compute + data, not the step: a synchronous step takes as long on every rank, because the
fast ranks wait for the slow one inside the first collective they share with it (the gradient
reduction). That wait is communication on the fast ranks, so their compute stays their own and
the slow rank's compute + data stands out. Each rank is compared with the median of the OTHER
ranks of its pipeline stage, which do the same work (with many ranks the same as the median of
all; with two, the other rank: a median over both would hide a 2x rank as 1.33x). Ranks of
different stages are not compared: the last stage's LM head and loss make it slower by design.
A run where no stage has two ranks (PP = world size) is not judged.

Limits: collectives the model runs inside its layers (tensor- and context-parallel, ZeRO-3's
parameter gathers, ZeRO-2's buckets reduced during backward) are not separated from compute, so
a slow rank's tensor-parallel peers (and, at ZeRO-2/3, its data-parallel peers) can look slow as
well; the slowest named is then the likeliest culprit. As Megatron-LM's straggler detector
(core/README_STRAGGLER.md), which times the compute per rank and reports the extremes.

Cost: two clock reads per phase and per reduction each step (two CUDA events on GPU), a sort of
the window's steps and one all-gather of 3 numbers per rank every train.straggler_interval steps.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..parallel import state

# the PipelineEngine's instructions that are communication (deepspeed.runtime.pipe.schedule)
PIPELINE_COMMUNICATION = ("ReduceGrads", "ReduceTiedGrads", "SendActivation", "RecvActivation", "SendGrad",
                          "RecvGrad")


@dataclasses.dataclass(frozen=True)
class RankTime:
    """The split of one rank's median step of a window, in seconds."""
    rank: int
    host: str
    pid: int
    compute: float
    data: float
    communication: float
    stage: int = 0   # its pipeline stage: the ranks it is compared with

    @property
    def own(self) -> float:
        """The time this rank itself takes: what the others wait for."""
        return self.compute + self.data

    def split(self) -> str:
        return f"compute {self.compute:.3f} s, data {self.data:.3f} s, communication {self.communication:.3f} s"


def ratios(times: list[RankTime]) -> list[float | None]:
    """Each rank's compute + data wait over the median of the other ranks of its stage (inf over
    a median of 0; None for a rank alone in its stage)."""
    out = []
    for t in times:
        peers = [o.own for o in times if o.rank != t.rank and o.stage == t.stage]
        median = statistics.median(peers) if peers else None
        out.append(None if median is None else t.own / median if median > 0 else
                   (1.0 if t.own == 0 else float("inf")))
    return out


def slow_ranks(times: list[RankTime], factor: float) -> list[tuple[RankTime, float]]:
    """(rank, ratio) of each rank at `factor` x its peers' median or more, slowest first."""
    named = [(t, r) for t, r in zip(times, ratios(times)) if r is not None and r >= factor]
    return sorted(named, key=lambda x: -x[1])


class CommunicationClock:
    """Seconds spent in the collectives wrapped by `install`, per step."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds, self.events = cuda, 0.0, []

    @contextmanager
    def measure(self):
        if self.cuda:   # the device's time from the prior kernels' end to the collective's
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.events.append((start, end))
            return
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - began

    def take(self) -> float:
        """The seconds since the last take (on CUDA after the step's own synchronisation)."""
        seconds = self.seconds + sum(s.elapsed_time(e) for s, e in self._done()) / 1000
        self.seconds, self.events = 0.0, []
        return seconds

    def _done(self):
        for start, end in self.events:
            end.synchronize()   # already done: the step ended in .item()
            yield start, end


def _timed(fn, clock: CommunicationClock):
    def timed(*args, **kwargs):
        with clock.measure():
            return fn(*args, **kwargs)
    return timed


def communication_clock(engine, cuda: bool) -> CommunicationClock:
    """The clock of `engine`'s collectives, installed once per engine: the plain engine's
    allreduce_gradients; the PipelineEngine's communication instructions (its own reduction
    calls allreduce_gradients inside ReduceGrads, so that is not wrapped twice)."""
    clock = getattr(engine, "_communication_clock", None)
    if clock is not None:
        return clock
    clock = CommunicationClock(cuda)
    instructions = getattr(type(engine), "_INSTRUCTION_MAP", None)
    if instructions is not None:   # an instance copy: the class's map stays DeepSpeed's
        engine._INSTRUCTION_MAP = {kind: _timed(fn, clock) if kind.__name__ in PIPELINE_COMMUNICATION else fn
                                   for kind, fn in instructions.items()}
    else:
        engine.allreduce_gradients = _timed(engine.allreduce_gradients, clock)
    engine._communication_clock = clock
    return clock


class Stragglers:
    """The slow-rank report of one Trainer.train() call; `step` wraps each training step."""

    def __init__(self, trainer, metrics):
        t = trainer.cfg.train
        self.interval, self.factor, self.metrics = t.straggler_interval, t.straggler_factor, metrics
        # every stage has world / PP ranks: with one, no rank has a peer to be compared with
        self.active = self.interval > 0 and dist.get_world_size() // trainer.layout.pipe > 1
        if not self.active:
            return
        self.timer, self.device = trainer.timer, trainer.device
        self.timer.every_step = True
        self.clock = communication_clock(trainer.engine, torch.device(self.device).type == "cuda")
        self.clock.take()   # nothing from before this call (an evaluation's, a previous train())
        places = [None] * dist.get_world_size()
        dist.all_gather_object(places, (socket.gethostname(), os.getpid(), state.get_pipe_parallel_rank()))
        self.places = places
        self.window, self.first = [], None   # (compute, data, communication) of each step since the last report

    @contextmanager
    def step(self, number: int):
        """Around step `number` (its number in the logs); every train.straggler_interval-th step
        ends with the gather (a collective: every rank reaches it at the same step)."""
        if not self.active:
            yield
            return
        self.clock.take()   # not the collectives between steps (a pipelined evaluation's)
        began = time.perf_counter()
        yield
        seconds = time.perf_counter() - began
        data, communication = self.timer.phases.get("data", 0.0), self.clock.take()
        self.first = number if self.first is None else self.first
        self.window.append((max(seconds - data - communication, 0.0), data, communication))
        if number % self.interval == 0:
            self._report(number)

    def _report(self, last: int) -> None:
        """Every rank sends the split of its median step (by compute + data wait) of the window:
        a rank slow in one step (a pause, a hiccup of its host) is not named, one slow in most is."""
        median = sorted(self.window, key=lambda x: x[0] + x[1])[(len(self.window) - 1) // 2]
        mine = torch.tensor(median, dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in self.places]
        dist.all_gather(gathered, mine)
        first, self.window, self.first = self.first, [], None
        if self.metrics.is_logger:
            rows = torch.stack(gathered).cpu().tolist()
            self._name([RankTime(rank, host, pid, *split, stage)
                        for rank, ((host, pid, stage), split) in enumerate(zip(self.places, rows))], first, last)

    def _name(self, times: list[RankTime], first: int, last: int) -> None:
        """Rank 0: the console lines, the ranks/ scalars (every window) and the ranks named."""
        scores = [-1.0 if r is None else r for r in ratios(times)]
        slowest = max(range(len(times)), key=lambda r: scores[r])
        s = times[slowest]
        self.metrics.scalars({"ranks/slowest_ratio": scores[slowest], "ranks/slowest_rank": s.rank,
                              "ranks/slowest_compute_s": s.compute, "ranks/slowest_data_s": s.data,
                              "ranks/slowest_communication_s": s.communication}, last)
        named = slow_ranks(times, self.factor)
        self.metrics.scalars({"ranks/slow_ranks": len(named)}, last)
        if not named:
            return
        for t, ratio in named:
            peers = sorted((o for o in times if o.stage == t.stage and o.rank != t.rank), key=lambda o: o.own)
            median = peers[(len(peers) - 1) // 2]
            print(f"slow rank {t.rank} (host {t.host}, pid {t.pid}): {ratio:.2f}x the other ranks' compute + data "
                  f"wait in the median step of steps {first}-{last} | {t.split()} (median rank {median.rank}: "
                  f"{median.split()}; train.straggler_factor={self.factor})", file=sys.stderr, flush=True)
        self.metrics.text("ranks/slow", "; ".join(f"rank {t.rank} (host {t.host}, pid {t.pid}) {r:.2f}x: {t.split()}"
                                                  for t, r in named), last)
