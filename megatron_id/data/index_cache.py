"""The index cache shared by every rank: rank 0 builds, the others wait on files, not on a collective.

Index arrays are saved as .npy files keyed by a hash of their description and memory-mapped by
every rank. Under torch.distributed only global rank 0 builds a missing one; the others poll for
its description file, written last (its presence means the arrays are complete). Waiting on a
collective instead (a barrier) made every other rank time out after
train.collective_timeout_minutes when an index took longer than that to build (a large blend,
a 100B-token corpus), and the job died with a gloo traceback.

While it builds, rank 0 keeps a status file, `.build-<session>.json` in the cache folder, fresh
(rewritten every few seconds from a thread: what it builds, the estimate, the phase; removed
when the build is done, kept with the error when it fails); the
session id is broadcast once when the session starts (all ranks are there together, nobody has
started anything long yet), so waiters never read a status left by an earlier job. Waiters:
  - print where they are once when they first wait and every `report_every_s` after (one rank
    per node, so a 512-rank job does not print 511 lines; once per session, not per index: a
    blend of 200 prefixes is 400 indices);
  - stop with rank 0's error when its build fails (it writes the failure into the status file);
  - stop after `stale_after_s` without any sign of life from rank 0 (default: the collective
    timeout), naming the likely causes and fixes: rank 0 died (its log says why), or the cache
    folder is not shared by every node (data.index_cache_dir).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from ..atomic import write_atomic, write_atomic_text
from .sample_index import say

HEARTBEAT_S = 2.0        # how often rank 0 rewrites its status while building
POLL_S = 0.2             # how often a waiter looks
REPORT_EVERY_S = 30.0    # how often a waiter says it is still waiting
LONG_BUILD_S = 10.0      # rank 0 announces builds estimated to take longer than this


class IndexWaitError(RuntimeError):
    """A waiting rank gave up: rank 0's build failed or stopped showing progress."""


def _distributed():
    """torch.distributed when a process group is up; without importing torch where nothing has
    (a group cannot exist then, and the data tools and benchmarks need no torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _write_json(path: Path, content: dict) -> None:
    write_atomic_text(path, json.dumps(content, indent=1, sort_keys=True))


def _write_array(path: Path, array: np.ndarray) -> None:
    def save(temporary: Path) -> None:
        with open(temporary, "wb") as f:   # a file object: given a name, np.save would append .npy to it
            np.save(f, array)
    write_atomic(path, save)


class BuildSession:
    """One group of index builds done together by every rank (build_gpt_datasets makes one).
    `stale_after_s`: how long a waiter accepts no sign of life from rank 0 (None: 10 minutes)."""

    def __init__(self, cache_dir, stale_after_s: float | None = None, report_every_s: float | None = None):
        self.cache_dir = Path(cache_dir)
        self.stale_after_s = 600.0 if stale_after_s is None else float(stale_after_s)
        self.report_every_s = REPORT_EVERY_S if report_every_s is None else report_every_s
        dist = _distributed()
        self.rank = dist.get_rank() if dist else 0
        self.is_builder = self.rank == 0
        token = [uuid.uuid4().hex[:12] if self.is_builder else None]
        if dist is not None and dist.get_world_size() > 1:
            dist.broadcast_object_list(token, src=0)   # everyone is here; nothing long has started
        self.status_path = self.cache_dir / f".build-{token[0]}.json"
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.reports = not self.is_builder and (self.rank == 1 or local_rank == 0)   # one waiter per node
        self._fields, self._lock, self._stop, self._beating = {}, threading.Lock(), threading.Event(), None
        self._last_report = None   # when a waiter last said where it is

    # ------------------------------------------------------------ rank 0

    def _write_status(self) -> None:
        _write_json(self.status_path, {**self._fields, "host": socket.gethostname(), "pid": os.getpid(),
                                       "heartbeat": time.time()})

    def _heartbeat(self) -> None:
        while True:
            with self._lock:
                self._write_status()
            if self._stop.wait(HEARTBEAT_S):
                return

    def build_and_save(self, key: str, description: dict, build, what: str, estimate_s: float) -> dict:
        """Build and save one index. The status file is written by a heartbeat thread every
        HEARTBEAT_S for the whole session (one write per build would cost more than the build
        for a blend of hundreds of small prefixes), so progress only updates it in memory."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        if estimate_s > LONG_BUILD_S:
            say(f"building {what} (~{estimate_s:.0f} s; once: cached in {self.cache_dir})")
        with self._lock:
            self._fields.update(key=key, what=what, estimate_s=estimate_s, started=time.time(), phase="starting")
        if self._beating is None:   # its first write is at once: waiters see rank 0 at work
            self._beating = threading.Thread(target=self._heartbeat, daemon=True, name="index-heartbeat")
            self._beating.start()

        def progress(text):
            with self._lock:
                self._fields["phase"] = text
        try:
            arrays = build(progress)
            progress("writing the arrays")
            for name, array in arrays.items():
                _write_array(self.cache_dir / f"{key}_{name}.npy", array)
            # written last: its presence means the arrays are complete
            _write_json(self.cache_dir / f"{key}_description.json", {**description, "arrays": sorted(arrays)})
        except BaseException as err:
            self._stop_heartbeat()
            self._fields["failed"] = f"{type(err).__name__}: {err}"
            self._write_status()   # stays: the waiters read what failed
            raise
        return arrays

    def _stop_heartbeat(self) -> None:
        if self._beating is not None:
            self._stop.set()
            self._beating.join()
            self._beating = None

    def close(self) -> None:
        """The end of the session's builds: the heartbeat stops and its status file goes (one
        that records a failure stays)."""
        self._stop_heartbeat()
        if self.is_builder and not self._fields.get("failed"):
            self.status_path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ------------------------------------------------------------ the other ranks

    def _read_status(self) -> dict | None:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):   # not there yet, or being replaced
            return None

    def wait_for(self, meta: Path, what: str) -> None:
        """Wait until rank 0 has written `meta`, saying so as we go."""
        began = last_sign = time.monotonic()
        seen = None   # the last status content read: any change is a sign of life
        if self.reports and self._last_report is None:   # once per session; then every report_every_s
            say(f"rank {self.rank}: waiting for rank 0 to build {what} (in {self.cache_dir})")
            self._last_report = began
        while not meta.is_file():
            time.sleep(POLL_S)
            now = time.monotonic()
            status = self._read_status()
            if status is not None and status != seen:
                seen, last_sign = status, now
            if status is not None and status.get("failed"):
                raise IndexWaitError(f"rank 0 failed while building {status.get('what', 'the data index')}: "
                                     f"{status['failed']} (rank 0's log has the details).")
            if now - last_sign > self.stale_after_s:
                raise IndexWaitError(self._stale_message(what, status, now - began))
            if self.reports and now - self._last_report >= self.report_every_s:
                self._last_report = now
                say(self._progress_line(what, status, now - began))

    def _progress_line(self, what: str, status: dict | None, waited: float) -> str:
        if status is None:
            return (f"rank {self.rank}: still waiting for rank 0 to build {what} ({waited:.0f} s): rank 0 has not "
                    f"started building in {self.cache_dir} yet")
        estimate = status.get("estimate_s")
        elapsed = max(0.0, status.get("heartbeat", 0) - status.get("started", 0))
        return (f"rank {self.rank}: still waiting for rank 0 to build {status.get('what', what)} ({waited:.0f} s "
                f"so far; rank 0: {status.get('phase')}, {elapsed:.0f} s of ~{estimate or 0:.0f} s estimated)")

    def _stale_message(self, what: str, status: dict | None, waited: float) -> str:
        minutes = self.stale_after_s / 60
        seen = (f"its status file {self.status_path} has not changed for {minutes:g} min"
                if status is not None else f"no status file from rank 0 appeared in {self.cache_dir}")
        return (f"rank {self.rank} waited {waited / 60:.1f} min for rank 0 to build {what}, and {seen}. "
                f"If rank 0 stopped, its log says why. If {self.cache_dir} is not on a file system every node "
                f"shares, set data.index_cache_dir to one that is. If rank 0 is only slow to reach the build, "
                f"raise train.collective_timeout_minutes (now {minutes:g}; waiting ranks give up after that long "
                f"without a sign of life from rank 0).")


def cached_arrays(description: dict, cache_dir, build, *, session: BuildSession | None = None,
                  what: str = "the data index", estimate_s: float = 0.0) -> tuple[dict, bool]:
    """The arrays for `description` from `cache_dir`, built first if missing: on rank 0 only
    under torch.distributed (`build(progress)` returns {name: array}; progress(text) names its
    phase for the waiters), the other ranks wait for its files. Returns (arrays memory-mapped
    read-only, built_here)."""
    cache_dir = Path(cache_dir)
    if session is None:
        with BuildSession(cache_dir) as session:
            return cached_arrays(description, cache_dir, build, session=session, what=what, estimate_s=estimate_s)
    key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
    meta = cache_dir / f"{key}_description.json"
    built = False
    if not meta.is_file():
        if session.is_builder:
            session.build_and_save(key, description, build, what, estimate_s)
            built = True
        else:
            session.wait_for(meta, what)
    names = json.loads(meta.read_text())["arrays"]
    return {n: np.load(cache_dir / f"{key}_{n}.npy", mmap_mode="r") for n in names}, built
