"""Room on disk for a checkpoint (issue 41): sized before it is written, refused before any byte
is written when its file system has less free space, and a save that still fails for want of
space (the disk filled meanwhile) ends in one line saying so, with its partial files removed.

torch.save on a full disk does not raise an OSError but `RuntimeError: [enforce fail at
inline_container.cc:672] . unexpected pos`, and safetensors a SafetensorError: `is_disk_full`
(errors.py) knows them all.

Sizing: DeepSpeed's save_checkpoint runs once with `SizingEngine` in place of its checkpoint
engine, which counts the bytes of the tensors of every file it is handed and writes nothing
(the same substitution train.async_save makes to keep host copies). The figure is kept per
trainer and kind of save (weights only or not): the sizes do not change during a run.
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import disk_full_error, free_bytes, human_bytes
from .files import STAGING, latest_folder

# torch.save's zip container: per file, its pickle and record headers (about 1 KiB per tensor)
FILE_OVERHEAD = 64 * 1024
PER_TENSOR_OVERHEAD = 1024


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in a (nested) state, each distinct tensor once, plus the container's
    overhead (an estimate of what torch.save writes for it)."""
    seen, total = set(), 0

    def walk(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            key = (x.data_ptr(), x.numel(), x.dtype, x.device) if x.device.type != "meta" else id(x)
            if key not in seen:
                seen.add(key)
                total += x.numel() * x.element_size() + PER_TENSOR_OVERHEAD
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(obj)
    return total + FILE_OVERHEAD


def recording_engine(name: str, keep):
    """DeepSpeed's CheckpointEngine interface writing nothing: each file DeepSpeed saves is kept
    in `files` as (path, keep(state_dict)). The sizing pass keeps its bytes (`sizing_engine`),
    train.async_save a host copy (background.host_copy_engine). Neither needs DeepSpeed to clone
    views first (preserves_storage_sharing False): counting does not write, and the host copy
    copies each tensor compactly."""
    # deepspeed imports in seconds: only when a save is sized or staged
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class RecordingEngine(CheckpointEngine):
        def __init__(self):
            super().__init__()
            self.name, self.files = f"megatron_id.{name}", []

        def create(self, info):
            pass

        def save(self, state_dict, path: str):
            self.files.append((path, keep(state_dict)))

        def load(self, path: str, map_location=None):
            raise RuntimeError(f"{name} only records what is saved")

        def commit(self, info):
            return True

        def preserves_storage_sharing(self):
            return False
    return RecordingEngine()


def sizing_engine():
    """Counts what each file would hold (`files`: (path, bytes))."""
    return recording_engine("SizingEngine", tensor_bytes)


def reshardable_bytes(trainer) -> int:
    """optim/ (train.reshardable_optimizer): fp32 weights, exp_avg and exp_avg_sq of every
    parameter of the model, once (written by the ranks of TP rank 0 and DP rank 0)."""
    from ..model.accounting import report
    return 3 * 4 * report(trainer.cfg.model).parameters + FILE_OVERHEAD


def measure(trainer, root: Path, tag: str, weights_only: bool, files_context) -> int:
    """This rank's bytes of the checkpoint `tag` (a collective: DeepSpeed's save_checkpoint runs
    with the sizing engine). Kept on the trainer per kind of save."""
    cache = trainer.__dict__.setdefault("_checkpoint_bytes", {})
    if weights_only in cache:
        return cache[weights_only]
    engine = trainer.engine
    sizing, original = sizing_engine(), engine.checkpoint_engine
    engine.checkpoint_engine = sizing
    engine._copy_recovery_script = lambda *args, **kwargs: None   # its helper scripts: nothing written now
    try:
        with files_context(trainer, weights_only):
            engine.save_checkpoint(str(root / STAGING), tag=tag, save_latest=False)
    finally:
        engine.checkpoint_engine = original
        del engine._copy_recovery_script
    total = sum(size for _, size in sizing.files)
    if dist.get_rank() == 0:
        total += 64 * 1024   # client_state.pt and manifest.json
        if trainer.cfg.train.reshardable_optimizer and not weights_only:
            total += reshardable_bytes(trainer)
    cache[weights_only] = total
    return total


def _file_system(root: Path) -> tuple[str, int]:
    path = Path(root).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return socket.gethostname(), os.stat(path).st_dev


def agree_on_room(root: Path, tag: str, mine: int) -> int:
    """Every rank's bytes, summed per file system (per host: a folder shared by several hosts
    is then checked against each host's share only, never refused wrongly); raises on every
    rank, before any file is written, when one of them lacks the room. Returns the total."""
    host, device = _file_system(root)
    free = free_bytes(root)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (host, device, free, mine))
    total = sum(part[3] for part in everyone)
    by_fs: dict = {}
    for h, d, f, b in everyone:
        entry = by_fs.setdefault((h, d), [f, 0])
        entry[1] += b
    short = [(f, b) for f, b in by_fs.values() if f is not None and b > f]
    if short:
        needed = short[0][1]
        err = checkpoint_disk_full(root, tag, needed, "Nothing was written", before=True)
        err.same_on_every_rank = True
        raise err
    return total


def _latest(root: Path):
    try:
        return latest_folder(root)
    except Exception:   # an empty or dangling `latest`: not this message's concern
        return None


def checkpoint_disk_full(root: Path, tag: str, needed: int | None, removed: str, before: bool = False):
    """The error of a save that did not fit (`before`: refused before writing anything)."""
    folder = _latest(root)
    if folder is None:
        return disk_full_error(f"checkpoint {tag}", root, needed, f"{removed}; no checkpoint was saved there yet.",
                               "Free space there, or set train.save to a folder with room, and run again.",
                               show_free=before)
    return disk_full_error(f"checkpoint {tag}", root, needed, f"{removed}; `latest` still names {folder.name}.",
                           f"Free space there and resume from it (train.load={root}), or set train.save to a "
                           f"folder with room.", show_free=before)


def remove_partial(root: Path, staged: Path) -> str:
    """Remove the staging folder of a failed save (and .incomplete when empty); says what."""
    size = sum(f.stat().st_size for f in staged.rglob("*") if f.is_file()) if staged.is_dir() else 0
    shutil.rmtree(staged, ignore_errors=True)
    incomplete = Path(root) / STAGING
    if incomplete.is_dir() and not any(p.name.startswith("iter_") for p in incomplete.iterdir()):
        shutil.rmtree(incomplete, ignore_errors=True)   # DeepSpeed's helper scripts
    return f"Its partial files in {staged} ({human_bytes(size, exact=False)}) were removed" if size else \
        f"Its partial folder {staged} was removed"
