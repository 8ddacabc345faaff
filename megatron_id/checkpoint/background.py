"""train.async_save: a checkpoint copied to host memory during the save call, then written to
disk by a background thread while training goes on (torchtitan's async_mode and Megatron-LM's
--async-save do the same: a host copy, then a writer in the background).

The protocol is the synchronous one (files.py, integrity.py), moved into the thread:
  1. in the save call, every rank: DeepSpeed's save_checkpoint runs with `HostCopyEngine` in place
     of its checkpoint engine, so every file it would write is kept as (path, host copy of the
     state); the re-shardable optimizer state (collectives) is written there and then;
  2. in the background, every rank writes its files into the staging folder
     (`<save>/.incomplete/iter_X`), then a marker `.written-rank<r>`;
  3. rank 0's thread also writes the client state, waits for every rank's marker, removes them,
     writes the manifest (hashing every file), commits (rename, then `latest`) and prunes.
A kill at any moment before the commit leaves `latest` on the previous checkpoint and a staging
folder the next run removes. The next save and the end of the run wait for the previous write
(`BackgroundSave.wait`); an error in the thread is raised there, naming the checkpoint. A write
that fails for want of space (the room was checked before the thread started: space.py) removes
the staging folder at once, which tells rank 0's thread to stop waiting for the markers, and
is raised as one line saying so (DiskFullError).
Host memory: one copy of the model and optimizer state per rank while the write runs.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from ..errors import is_disk_full
from .files import commit, finish_staging, prune, write_client_state
from .integrity import CheckpointError, checkpoint_files, manifest_entries, write_manifest
from .space import checkpoint_disk_full, recording_engine, remove_partial

MARKER = ".written-rank"


def to_host(obj):
    """A copy of `obj` whose tensors are in host memory and no longer shared with training
    (the next optimizer step changes the originals in place). Containers are copied, other
    leaves kept."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, to_host(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [to_host(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_host(v) for v in obj)
    return obj


def host_copy_engine():
    """Keeps every save as a host copy (`files`: (path, state on the host))."""
    return recording_engine("HostCopyEngine", to_host)


def write_file(state, path: str) -> None:
    """One file of the checkpoint (a module function, so that tests can interrupt it)."""
    torch.save(state, path)


class BackgroundSave:
    """The writing, marking and (rank 0) committing of one staged checkpoint, in a thread."""

    def __init__(self, staged: Path, root: Path, files: list, client, rank: int, world: int, keep: int,
                 timeout_s: float, needed: int | None = None):
        self.staged, self.root, self.files, self.client = Path(staged), Path(root), files, client
        self.needed, self.removed = needed, None
        self.rank, self.world, self.keep, self.timeout_s = rank, world, keep, timeout_s
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.seconds = None
        self.thread = threading.Thread(target=self._run, name=f"save-{self.staged.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for path, state in self.files:
                write_file(state, path)
            self.files = None   # the host copy is freed as soon as it is on disk
            (self.staged / f"{MARKER}{self.rank}").write_text("")
            if self.rank == 0:
                if self.client is not None:
                    write_client_state(self.staged, self.client)
                self._commit()
            self.seconds = time.perf_counter() - self.started
        except BaseException as err:   # raised in the training thread by wait()
            self.error = err
            self.files = None
            if is_disk_full(err):   # the partial files go now (and rank 0 stops waiting for this rank)
                self.removed = remove_partial(self.root, self.staged)

    def _commit(self) -> None:
        markers = [self.staged / f"{MARKER}{r}" for r in range(self.world)]
        deadline = time.monotonic() + self.timeout_s
        while not all(m.exists() for m in markers):
            if not self.staged.is_dir():   # another rank's write failed and removed it
                raise CheckpointError(f"the staging folder {self.staged} was removed while rank 0 waited for the "
                                      f"other ranks' files: another rank's write failed (its error says why)")
            if time.monotonic() > deadline:
                missing = [r for r, m in enumerate(markers) if not m.exists()]
                raise CheckpointError(f"ranks {missing} did not finish writing {self.staged.name} within "
                                      f"{self.timeout_s / 60:.0f} min (train.collective_timeout_minutes)")
            time.sleep(0.05)
        for marker in markers:
            marker.unlink()
        folder = self.staged
        write_manifest(folder, manifest_entries(folder, checkpoint_files(folder)))
        commit(folder, self.root)
        finish_staging(self.root)
        prune(self.root, keep=self.keep, current=folder.name)

    def wait(self) -> float:
        """Block until this save is on disk (and, on rank 0, committed); the seconds it took."""
        self.thread.join()
        if self.error is not None and is_disk_full(self.error):
            raise checkpoint_disk_full(self.root, self.staged.name, self.needed,
                                       self.removed or remove_partial(self.root, self.staged)) from self.error
        if self.error is not None:
            raise CheckpointError(f"the background save of {self.staged.name} failed: {type(self.error).__name__}: "
                                  f"{self.error}. `latest` still names the previous checkpoint.") from self.error
        return self.seconds
