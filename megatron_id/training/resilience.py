"""In-job restarts and the cheap local saves they resume from.

Restarts (train.max_restarts > 0) are torch.distributed.elastic's: the launchers run the ranks
under its agent (training/launcher.py for `megatron-id train --nproc` and launch/local.sh; one
torchrun per node with c10d rendezvous in launch/slurm/train.sbatch). When a rank exits, is
killed or raises, the agent stops the others and starts every rank again with
TORCHELASTIC_RESTART_COUNT one higher; a hung rank makes its peers' collectives time out after
train.collective_timeout_minutes, they raise, and the same happens. A restarted run resumes
from the newest state it can find: its local saves when they are newer than train.save's
`latest`, else `latest`.

Local saves (train.local_save, train.local_save_interval; Megatron's non-persistent local
checkpoints): every rank writes its own shard (the module's state dict, its optimizer state,
DeepSpeed's step counters, its RNG and the client state a durable checkpoint records) to one
file in a node-local folder, keeping its two newest. No manifest, no staging folder, no
collective beyond the agreement at load: a local save costs one torch.save per rank. They are
read only by the run that wrote them, identified by a fingerprint of its resolved config and
layout, at the step every rank has; any mismatch (another layout, a changed key, a rank whose
file is missing or unreadable) falls back to train.save's checkpoint, said in one line. Each rank
removes its own files (its fingerprint's, by their names) when superseded and when the run ends.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint.deepspeed_files import safe_load
from ..checkpoint.files import ClientState, rng_state, set_rng_state
from ..config import Config, ConfigError, to_yaml
from ..errors import check_writable
from .faults import restart_attempt

KEEP = 2   # newest local saves kept per rank: a kill during the write of one leaves the one before
NAME = re.compile(r"^megatron-id-local\.(?P<fp>[0-9a-f]{16})\.rank(?P<rank>\d{5})\.step(?P<step>\d{9})\.pt"
                  r"(?P<partial>\.partial\d+)?$")   # (.partialPID: a write a kill cut short)


def check_resilience(cfg: Config) -> None:
    """Combinations refused before any work (train's checks, job-prepare's too)."""
    t = cfg.train
    if t.max_restarts > 0 and not t.save:
        raise ConfigError(f"train.max_restarts={t.max_restarts} without train.save: a restarted run resumes from a "
                          f"checkpoint, and this run keeps none; set train.save=<folder> (and train.local_save for "
                          f"cheap frequent saves), or train.max_restarts=0.")
    if not t.local_save:
        return
    if Path(t.local_save).exists() and not Path(t.local_save).is_dir():
        raise ConfigError(f"train.local_save={t.local_save} is a file, not a folder: give a node-local folder (it is "
                          f"made if missing), e.g. /tmp/<run name>.")
    check_writable(t.local_save, "train.local_save")   # (each rank writes there every interval)
    if t.zero_stage == 3:
        raise ConfigError(f"train.local_save={t.local_save} with train.zero_stage=3: a local save holds each rank's "
                          f"module state dict, which ZeRO-3 partitions; use train.zero_stage=1 or 2, or leave "
                          f"train.local_save unset (restarts then resume from train.save's checkpoints).")
    if cfg.data.carry_state:
        raise ConfigError(f"train.local_save={t.local_save} with data.carry_state=true: local saves do not hold the "
                          f"carried state yet; leave train.local_save unset (restarts resume from train.save, which "
                          f"does).")
    if t.save:
        local, durable = Path(t.local_save).absolute(), Path(t.save).absolute()
        if local == durable or durable in local.parents:
            raise ConfigError(f"train.local_save={t.local_save} is inside train.save={t.save}: give a node-local "
                              f"folder of its own (e.g. /tmp/<run name>, or $TMPDIR on a cluster node); checkpoint "
                              f"tools would meet its files in the checkpoint folder.")


def fingerprint(cfg: Config, layout_record: dict) -> str:
    """What a local save must match to be read: the resolved config and the layout."""
    text = to_yaml(cfg) + repr(sorted(layout_record.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _say(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


class LocalSaves:
    """This rank's local saves of this run (see the module docstring)."""

    def __init__(self, trainer):
        from ..checkpoint.engine_io import current_layout
        cfg = trainer.cfg
        self.folder = Path(cfg.train.local_save)
        self.interval = cfg.train.local_save_interval
        self.rank = dist.get_rank()
        self.fp = fingerprint(cfg, current_layout(trainer))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.saved_step = None

    def _path(self, step: int) -> Path:
        return self.folder / f"megatron-id-local.{self.fp}.rank{self.rank:05d}.step{step:09d}.pt"

    def _ours(self):
        """(step, path, partial) of this rank's files of this run, finished or cut short."""
        for path in self.folder.iterdir():
            m = NAME.match(path.name)
            if m and m["fp"] == self.fp and int(m["rank"]) == self.rank:
                yield int(m["step"]), path, m["partial"] is not None

    def steps(self) -> list[int]:
        """The steps of this rank's finished local saves of this run, oldest first."""
        return sorted(step for step, _, partial in self._ours() if not partial)

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    # ------------------------------------------------------------ save

    def save(self, trainer, client: ClientState) -> float:
        """This rank's shard at `client.step`, written atomically; returns the seconds it took."""
        started = time.perf_counter()
        engine = trainer.engine
        state = {"format": 1, "fingerprint": self.fp, "rank": self.rank, "step": client.step,
                 "client": client.to_dict(), "rng": rng_state(),
                 "module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
                 "counters": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                              "skipped_steps": engine.skipped_steps}}
        path = self._path(client.step)
        partial = path.with_name(path.name + f".partial{os.getpid()}")
        try:
            torch.save(state, partial)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        self.saved_step = client.step
        files = list(self._ours())
        finished = sorted((step, file) for step, file, partial in files if not partial)
        for _, file in finished[:-KEEP]:
            file.unlink(missing_ok=True)
        for _, stale, partial in files:   # an earlier attempt's write that a kill cut short
            if partial:
                stale.unlink(missing_ok=True)
        return time.perf_counter() - started

    def remove_all(self) -> None:
        """This rank's files of this run: the run ended, its durable checkpoint supersedes them.
        Partial files too: a rank killed while writing leaves its `.partialPID` behind."""
        for _, path, _ in list(self._ours()):
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------ resume

    def agreed_step(self) -> int | None:
        """The newest step of which every rank has a local save of this run (collective)."""
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.steps())
        common = set(everyone[0]).intersection(*map(set, everyone[1:]))
        return max(common) if common else None

    def resume(self, trainer, durable_step: int | None) -> ClientState | None:
        """Load the newest local save every rank has when it is newer than train.save's
        checkpoint (`durable_step`); returns its client state, or None (then the caller loads the
        durable checkpoint). Collective."""
        step = self.agreed_step()
        if step is None or (durable_step is not None and step <= durable_step):
            return None
        ok, client = True, None
        try:
            state = safe_load(self._path(step), mmap=False)   # (weights_only, DeepSpeed's few objects allowed)
            if state.get("fingerprint") != self.fp or state.get("step") != step:
                raise ValueError(f"{self._path(step)} is not this run's save of step {step}")
            self._load_into(trainer, state)
            client = ClientState.from_dict(state["client"], self._path(step))
            set_rng_state(state["rng"])
        except Exception as err:   # (a file cut short by a kill, a full disk): fall back, said
            print(f"rank {self.rank}: local save {self._path(step)} unreadable ({str(err).splitlines()[0][:200]})",
                  file=sys.stderr, flush=True)
            ok = False
        flag = torch.tensor([1.0 if ok else 0.0], device=getattr(trainer.engine, "device", "cpu"))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() < 1:
            _say(f"local save of step {step} not used (a rank could not read its file, above): resuming from "
                 f"train.save's checkpoint instead")
            return None
        where = f"train.save's step {durable_step}" if durable_step is not None else "no checkpoint in train.save"
        _say(f"resumed from the local saves of step {step} in {self.folder} (train.local_save; newer than {where})")
        self.saved_step = step
        return client

    def _load_into(self, trainer, state: dict) -> None:
        engine = trainer.engine
        engine.module.load_state_dict(state["module"])
        if trainer.cfg.train.zero_stage == 0:   # the guard itself (a torch optimizer)
            engine.optimizer.load_state_dict(state["optimizer"])
        else:   # DeepSpeed's ZeRO-1/2 optimizer takes one state per data-parallel rank: this rank's
            replicas = dist.get_world_size(engine.optimizer.dp_process_group)
            engine.optimizer.load_state_dict([state["optimizer"]] * replicas, load_optimizer_states=True,
                                             load_from_fp32_weights=True)
        for key, value in state["counters"].items():
            setattr(engine, key, value)


def agreed_attempt(device) -> int:
    """The in-job restart this attempt is (collective): the largest of the agents' restart counts.
    An agent counts the restarts of its own node's failures only (a node restarted because a peer
    failed counts none), and each agent's budget is train.max_restarts, so the largest is the
    count that meets the budget first."""
    count = torch.tensor([float(restart_attempt())], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def restart_line(cfg: Config, attempt: int) -> str | None:
    """Rank 0's first line in a restarted attempt; None in the first."""
    if attempt == 0:
        return None
    return (f"in-job restart {attempt} of at most {cfg.train.max_restarts} (train.max_restarts): every rank "
            f"started again after a rank failed; resuming from the newest checkpoint")

