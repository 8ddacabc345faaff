"""Faults injected on purpose: drills of the failure paths (in-job restart, loss spikes, slow ranks)
and the tests that prove them, on a real run, without editing code.

    MEGATRON_ID_INJECT_FAULTS="raise:step=5:rank=1; hang:step=9:rank=2:attempt=1; slow:rank=3:seconds=0.2"

Each fault is `kind:key=value:...`, faults separated by `;`:

    raise  step=S rank=R     rank R raises a RuntimeError as step S begins
    hang   step=S rank=R     rank R stops answering as step S begins (sleeps; its peers' collectives
                             time out after train.collective_timeout_minutes)
    exit   step=S rank=R     rank R ends at once as step S begins (os._exit(status), default 1: no
                             Python cleanup, as a crash)
    slow   rank=R seconds=X  rank R sleeps X s in the compute of every step from step `from` (1)
    spike  step=S factor=F   step S's loss multiplied by F on every rank (a poisoned batch)

`step` is the number a step has in the logs (the first step is 1). `attempt` is the in-job
restart it fires in (TORCHELASTIC_RESTART_COUNT; default 0: a restarted run does not meet it
again; `any`: every attempt). Unknown kinds and keys are refused when the run starts, so a typo
does not pass as a drill that found nothing.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

from ..errors import UserError

ENV = "MEGATRON_ID_INJECT_FAULTS"
KEYS = {"raise": {"step", "rank"}, "hang": {"step", "rank"}, "exit": {"step", "rank", "status"},
        "slow": {"rank", "seconds", "from"}, "spike": {"step", "factor"}}
REQUIRED = {"raise": {"step", "rank"}, "hang": {"step", "rank"}, "exit": {"step", "rank"},
            "slow": {"rank", "seconds"}, "spike": {"step", "factor"}}


class FaultSpecError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    values: dict
    attempt: int | None   # None: every attempt

    def fires_in(self, attempt: int) -> bool:
        return self.attempt is None or self.attempt == attempt

    def get(self, key: str, default=None):
        return self.values.get(key, default)


def restart_attempt(env=None) -> int:
    """Which in-job restart this process belongs to (0: the first start)."""
    env = os.environ if env is None else env
    value = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        kind, *fields = part.split(":")
        kind = kind.strip()
        if kind not in KEYS:
            raise FaultSpecError(f"{ENV}: unknown fault {kind!r} in {part!r}; the kinds are {', '.join(KEYS)} "
                                 f"(megatron_id/training/faults.py)")
        values, attempt = {}, 0
        for field in fields:
            key, sep, value = field.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise FaultSpecError(f"{ENV}: {field!r} in {part!r} is not key=value (e.g. {kind}:step=5:rank=1)")
            if key == "attempt":
                if value != "any" and not value.isdigit():
                    raise FaultSpecError(f"{ENV}: attempt={value!r} in {part!r}: give a restart count (0, 1, ...) "
                                         f"or any")
                attempt = None if value == "any" else int(value)
                continue
            if key not in KEYS[kind]:
                raise FaultSpecError(f"{ENV}: {kind} takes {', '.join(sorted(KEYS[kind]))} and attempt, "
                                     f"not {key!r} (in {part!r})")
            try:
                number = float(value) if key in ("seconds", "factor") else int(value)
            except ValueError:
                raise FaultSpecError(f"{ENV}: {key}={value!r} in {part!r} is not a number") from None
            values[key] = number
        missing = REQUIRED[kind] - set(values)
        if missing:
            raise FaultSpecError(f"{ENV}: {part!r} needs {', '.join(sorted(missing))} "
                                 f"(e.g. {kind}:" + ":".join(f"{k}=1" for k in sorted(REQUIRED[kind])) + ")")
        faults.append(Fault(kind, values, attempt))
    return faults


class FaultInjector:
    """The faults of this rank in this attempt; the training loop calls its hooks."""

    def __init__(self, rank: int, env=None):
        env = os.environ if env is None else env
        self.rank, self.attempt = rank, restart_attempt(env)
        self.faults = [f for f in parse_faults(env.get(ENV, "")) if f.fires_in(self.attempt)]

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _mine(self, kind: str, step: int | None = None):
        for f in self.faults:
            if f.kind == kind and f.get("rank", self.rank) == self.rank and (step is None or f.get("step") == step):
                yield f

    def before_step(self, step: int) -> None:
        """As step `step` begins (the number it will have in the logs)."""
        for f in self._mine("raise", step):
            raise RuntimeError(f"injected fault ({ENV}): rank {self.rank} raises at step {step}, "
                               f"attempt {self.attempt}")
        for f in self._mine("exit", step):
            print(f"injected fault ({ENV}): rank {self.rank} exits at step {step}, attempt {self.attempt}",
                  file=sys.stderr, flush=True)
            os._exit(int(f.get("status", 1)))
        for f in self._mine("hang", step):
            print(f"injected fault ({ENV}): rank {self.rank} hangs at step {step}, attempt {self.attempt}",
                  file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

    def slow_down(self, step: int) -> None:
        """In a step's compute: the injected slowness of this rank, if any."""
        for f in self._mine("slow"):
            if step >= f.get("from", 1):
                time.sleep(f.get("seconds"))

    def loss_factor(self, step: int) -> float:
        """What step `step`'s loss is multiplied by (1: no spike injected)."""
        factor = 1.0
        for f in self.faults:
            if f.kind == "spike" and f.get("step") == step:
                factor *= f.get("factor")
        return factor
