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

At the start of a run (`check_room_at_start`, before step 1) the same sizing pass runs, plus
Adam's two moments that torch creates only at the first step, so a disk too small for one
checkpoint is refused before any training rather than at the first save.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import DiskFullError, disk_full_error, free_bytes, human_bytes
from .files import STAGING, latest_folder, tag_for

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


def measure(trainer, root: Path, tag: str, weights_only: bool, files_context, keep: bool = True) -> int:
    """This rank's bytes of the checkpoint `tag` (a collective: DeepSpeed's save_checkpoint runs
    with the sizing engine). Kept on the trainer per kind of save (unless `keep` is false: before
    the first step, Adam's state is not there yet to be counted)."""
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
    if keep:
        cache[weights_only] = total
    return total


def adam_state_to_come(trainer) -> int:
    """Bytes of Adam's two moments that do not exist yet (torch creates them at the first step):
    one pair per tensor this rank's optimizer steps (under ZeRO, its flat fp32 partitions), in
    that tensor's dtype."""
    optimizer, total = trainer.guard, 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state.get(param):
                total += 2 * (param.numel() * param.element_size() + PER_TENSOR_OVERHEAD)
    return total


def _saves_ahead(trainer) -> int:
    """How many checkpoints of about one size this run adds to train.save at its fullest: every
    train.save_interval, train.extra_save_steps and the end, pruned to train.keep_last after each
    commit (the checkpoints already there count towards it)."""
    t, start, end = trainer.cfg.train, trainer.step, trainer.layout.train_iters
    saves = {s for s in range(start + 1, end + 1) if s % t.save_interval == 0 or s in t.extra_save_steps} | {end}
    there = sum(1 for p in Path(t.save).glob("iter_*") if p.is_dir()) if Path(t.save).is_dir() else 0
    if t.keep_last == 0:
        return len(saves)
    return max(1, min(len(saves), t.keep_last + 1 - there))


def check_room_at_start(trainer, root: Path, files_context) -> None:
    """Before step 1 (a collective, every rank): refuse a run whose train.save cannot hold one of
    its checkpoints, summed over the ranks that write to each file system as agree_on_room does,
    naming the bytes and the ways out; warn when the checkpoints it keeps at once will not fit.
    The async save's extra copy is in host memory, not on disk: the same bytes."""
    t = trainer.cfg.train
    root, tag = Path(root), tag_for(trainer.step)
    weights_only = not t.save_optimizer
    mine = measure(trainer, root, tag, weights_only, files_context, keep=weights_only)
    if not weights_only:
        mine += adam_state_to_come(trainer)
    host, device = _file_system(root)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (host, device, free_bytes(root), mine))
    by_fs: dict = {}
    for h, d, free, size in everyone:
        by_fs.setdefault((h, d), [free, 0])[1] += size
    short = [(free, size) for free, size in by_fs.values() if free is not None and size > free]
    light = None   # a weights-only checkpoint, for the refusal's way out where it fits
    if short and not weights_only:
        light = measure(trainer, root, tag, True, files_context)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (host, device, light))
        light = max(sum(b for h, d, b in everyone if (h, d) == fs) for fs in by_fs)
    # DeepSpeed's sizing pass made its (empty) folders there, on each host that writes; the run's
    # start removed any staging left by a killed save before, so nothing else is in it
    shutil.rmtree(root / STAGING, ignore_errors=True)
    dist.barrier()
    step = trainer.step + 1
    if short:
        free, size = short[0]
        ways = ["Free space there", "set train.save to a folder with room"]
        if t.reshardable_optimizer:
            ways.append("set train.reshardable_optimizer=false (its optim/ copy of the optimizer state is "
                        f"{human_bytes(reshardable_bytes(trainer), exact=False)} of each)")
        if light is not None and light <= free:
            ways.append(f"save weights only (train.save_optimizer=false: about {human_bytes(light, exact=False)} "
                        f"each; they resume with train.load_optimizer=false, Adam afresh)")
        err = DiskFullError(f"no space left on device for a checkpoint of this run in train.save={root}: one needs "
                            f"about {human_bytes(size)}, {human_bytes(free)} free there. Refused before step {step}: "
                            f"nothing was trained or written. {', '.join(ways[:-1])}, or {ways[-1]}.")
        err.same_on_every_rank = True
        raise err
    count = _saves_ahead(trainer)
    tight = [(free, size) for free, size in by_fs.values() if free is not None and count * size > free]
    if tight and dist.get_rank() == 0:
        free, size = tight[0]
        keep = "every checkpoint is kept (train.keep_last=0)" if t.keep_last == 0 else \
            f"train.keep_last={t.keep_last} with one more while each new one is written"
        print(f"warning: train.save={root} has {human_bytes(free, exact=False)} free and this run will hold up to "
              f"{count} more checkpoints there at once ({keep}), about {human_bytes(count * size, exact=False)}: a "
              f"later save will fail for want of space unless some is freed; lower train.keep_last, raise "
              f"train.save_interval, or free space.", file=sys.stderr, flush=True)


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
