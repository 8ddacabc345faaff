"""Saving and loading a training run on DeepSpeed (collectives: every rank calls them).

`save(trainer, root, client)`: DeepSpeed's model and ZeRO files into the staging folder, the
re-shardable optimizer state (train.reshardable_optimizer), our client state, the manifest
(hashed by all ranks in parallel), then the commit and pruning on rank 0. A weights-only save
(`client.weights_only`: train.save_optimizer=false, and every save at step 0, before Adam has
any state) writes DeepSpeed's model files without its optimizer state (`_weights_only_files`).
`load(trainer, root)`: verify every file (all ranks in parallel), then the cheapest exact way:
  - the saving layout (and train.load_optimizer): DeepSpeed restores model and optimizer, its
    files memory-mapped (`_mapped_loads`);
  - another layout with optim/: weights and Adam state re-sharded per parameter (reshard.py);
  - another layout without it, train.load_optimizer=false, or a weights-only checkpoint: this
    rank's slices of the weights only, copied into the module one tensor at a time
    (read.iter_local_state), optimizer fresh;
  - otherwise an error with the ways out (a weights-only checkpoint past step 0 with
    train.load_optimizer=true too: Megatron's habit with --no-save-optim checkpoints).
Memory of each (benchmarks/checkpoint_memory.py, docs/checkpoints.md): a weights-only load holds
one tensor beyond the model; a same-layout resume the optimizer state DeepSpeed creates for it.
`trainer` is the Trainer of training/engine.py: engine, cfg, layout, guard, tp_group, pipelined.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..errors import DiskFullError, UserError, is_disk_full
from ..model import LanguageModel
from ..parallel.pipeline import from_model_names, pipeline_state_dict
from ..training.carry import CARRIED_FILE, LOAD_KEY, rows_layout
from . import reshard, space
from .background import BackgroundSave, host_copy_engine, write_file
from .deepspeed_files import safe_load
from .files import (
    STAGING,
    ClientState,
    commit,
    describe,
    finish_staging,
    latest_folder,
    layout_record,
    prune,
    read_client_state,
    staging_folder,
    tag_for,
    write_client_state,
)
from .integrity import (
    CheckpointError,
    checkpoint_files,
    manifest_entries,
    mark_settled,
    read_manifest,
    verify_checkpoint,
    warn_unverified,
    write_manifest,
)
from .read import iter_local_state
from .rules import cross_layout_error, optimizer_state_loadable, weights_only_resume_error


def current_layout(trainer) -> dict:
    return layout_record(trainer.layout, trainer.cfg.train.zero_stage)


def save(trainer, root, client: ClientState, background: bool = False):
    """The checkpoint of `client.step` under `root`, committed; with `background`, copied to host
    memory and returned as a running BackgroundSave (checkpoint/background.py) instead. Sized
    first and refused on every rank, before any file is written, when its file system lacks the
    room (space.py); a write that fails for want of space all the same removes the partial
    folder and says so (DiskFullError), `latest` still on the previous checkpoint."""
    root, tag = Path(root), tag_for(client.step)
    staged = root / STAGING / tag
    rank0 = dist.get_rank() == 0
    if rank0:
        staging_folder(root, tag)
    dist.barrier()
    if background:
        return _save_in_background(trainer, root, staged, client)
    carried = _carried_state(trainer, staged)
    try:
        needed = space.agree_on_room(root, tag, space.measure(trainer, root, tag, client.weights_only,
                                                              _weights_only_files)
                                     + (space.tensor_bytes(carried[1]) if carried else 0))
    except DiskFullError:
        if rank0:
            space.remove_partial(root, staged)
        raise
    except Exception as err:   # a disk so full that DeepSpeed's helper scripts did not fit
        if not is_disk_full(err):
            raise
        space.remove_partial(root, staged)
        raise space.checkpoint_disk_full(root, tag, None, "Nothing was written", before=True) from err
    try:
        with _weights_only_files(trainer, client.weights_only):
            trainer.engine.save_checkpoint(str(root / STAGING), tag=tag, save_latest=False)
        if trainer.cfg.train.reshardable_optimizer and not client.weights_only:
            reshard.save(trainer, staged)
        if carried:
            write_file(carried[1], str(carried[0]))
        if rank0:
            write_client_state(staged, client)
        dist.barrier()   # every rank's files are written
        _write_manifest(staged)
        if rank0:
            commit(staged, root)
            finish_staging(root)
            prune(root, keep=trainer.cfg.train.keep_last, current=tag)
    except Exception as err:
        if not is_disk_full(err):
            raise
        raise space.checkpoint_disk_full(root, tag, needed, space.remove_partial(root, staged)) from err
    dist.barrier()
    return root / tag


def check_room_at_start(trainer, root) -> None:
    """Before step 1, every rank: train.save can hold this run's checkpoints (space.py)."""
    space.check_room_at_start(trainer, Path(root), _weights_only_files)


def _save_in_background(trainer, root: Path, staged: Path, client: ClientState):
    engine = trainer.engine
    host, original = host_copy_engine(), engine.checkpoint_engine
    engine.checkpoint_engine = host   # DeepSpeed's files: kept in host memory, written by the thread
    try:
        with _weights_only_files(trainer, client.weights_only):
            engine.save_checkpoint(str(root / STAGING), tag=staged.name, save_latest=False)
    finally:
        engine.checkpoint_engine = original
    carried = _carried_state(trainer, staged)
    if carried:   # (already on the host: the thread writes it with DeepSpeed's files)
        host.files.append((str(carried[0]), carried[1]))
    rank0 = dist.get_rank() == 0
    reshardable = trainer.cfg.train.reshardable_optimizer and not client.weights_only
    # the host copies are what the thread writes: sized, and refused before anything is written
    mine = sum(space.tensor_bytes(state) for _, state in host.files)
    if rank0:
        mine += 64 * 1024 + (space.reshardable_bytes(trainer) if reshardable else 0)   # client state, optim/
    try:
        needed = space.agree_on_room(root, staged.name, mine)
    except DiskFullError:
        if rank0:
            space.remove_partial(root, staged)
        raise
    if reshardable:   # collectives: now, in this thread
        try:
            reshard.save(trainer, staged)
        except Exception as err:
            if not is_disk_full(err):
                raise
            raise space.checkpoint_disk_full(root, staged.name, needed, space.remove_partial(root, staged)) from err
    dist.barrier()   # every rank's copy is taken
    return BackgroundSave(staged, root, host.files, client if rank0 else None, dist.get_rank(),
                          dist.get_world_size(), trainer.cfg.train.keep_last,
                          timeout_s=60 * trainer.cfg.train.collective_timeout_minutes, needed=needed)


@contextmanager
def _weights_only_files(trainer, weights_only: bool):
    """DeepSpeed's save_checkpoint without the optimizer state: ZeRO-1/2 skip their optimizer
    files (`save_zero_checkpoint`, which DeepSpeed sets per rank), ZeRO-0 writes `optimizer: None`
    into its model files (the engine's optimizer is hidden for the call). ZeRO-3 keeps its
    files: they hold the weights themselves (train.save_optimizer=false is refused there; a
    step-0 save has no Adam state to leave out)."""
    engine, zero = trainer.engine, trainer.cfg.train.zero_stage
    if not weights_only or zero == 3:
        yield
        return
    saved = engine.save_zero_checkpoint, engine.optimizer
    engine.save_zero_checkpoint = False
    if zero == 0:
        engine.optimizer = None
    try:
        yield
    finally:
        engine.save_zero_checkpoint, engine.optimizer = saved


def _write_manifest(folder: Path) -> None:
    """Sizes and sha256 of every file, hashed by all ranks in parallel (rank r takes every
    world-th file), written by rank 0 last, before the commit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [checkpoint_files(folder) if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    mine = manifest_entries(folder, names[0][rank::world])
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        write_manifest(folder, {k: v for part in gathered for k, v in part.items()})


def verify(folder: Path) -> None:
    """Every file of a checkpoint against its manifest before loading it, hashed by all ranks
    in parallel; a damaged file is named on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = read_manifest(folder)
    problems = [] if manifest is None else verify_checkpoint(folder, sorted(manifest)[rank::world])
    gathered = [None] * world
    dist.all_gather_object(gathered, problems)
    problems = [p for part in gathered for p in part]
    if manifest is None and rank == 0:
        warn_unverified(folder)
    if problems:
        err = CheckpointError(problems[0] + (f" ({len(problems) - 1} more damaged files: see "
                                             f"megatron-id check-checkpoint {folder})" if len(problems) > 1 else ""))
        err.same_on_every_rank = True
        raise err
    mark_settled(folder)   # reading its files next (client state, shards) does not hash them again


def _say(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def _carried_state(trainer, staged: Path):
    """data.carry_state: (this rank's file, the state its rows carry into the next step), on the
    host; None without it."""
    carry = getattr(trainer, "carry", None)
    if carry is None:
        return None
    return staged / CARRIED_FILE.format(dist.get_rank()), carry.state_dict(carried_layout(trainer))


def carried_layout(trainer) -> dict:
    """What decides which rows and heads each rank's carried state holds."""
    return rows_layout(trainer.layout)


def load_carried_state(trainer, root) -> None:
    """This rank's rows continue from `root`/latest's carried state (data.carry_state), or every
    row starts from zero, said once: train.load_carried_state=false, or a checkpoint saved
    without it. Agreed by every rank: a rank that cannot take its file (another layout, which
    check_run refuses before any work; a file missing beside the other ranks') stops every rank
    with one message, where alone it would leave the others to fail in their next collective,
    each with a traceback."""
    folder = latest_folder(Path(root))
    if not trainer.cfg.train.load_carried_state:
        _say(f"{folder}: {LOAD_KEY}=false: every row starts its next window from zero")
        return
    path = folder / CARRIED_FILE.format(dist.get_rank())
    present, problem = path.is_file(), None
    if present:
        try:
            trainer.carry.load_state_dict(torch.load(path, map_location="cpu", weights_only=True),
                                          carried_layout(trainer), path, trainer.device)
        except UserError as err:
            problem = str(err)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (present, problem))
    problems = [p for _, p in gathered if p]
    if problems:
        err = ConfigError(problems[0])
        err.same_on_every_rank = True
        raise err
    missing = [rank for rank, (has, _) in enumerate(gathered) if not has]
    if missing and len(missing) < len(gathered):
        err = CheckpointError(f"{folder} holds the carried state (data.carry_state) of some ranks but not of rank "
                              f"{', '.join(map(str, missing))} ({CARRIED_FILE.format(missing[0])} is missing): "
                              f"resume from a whole checkpoint, or set {LOAD_KEY}=false to start every row from "
                              f"zero.")
        err.same_on_every_rank = True
        raise err
    if missing:
        _say(f"{folder}: its checkpoint holds no carried state (saved without data.carry_state): every row "
             f"starts its next window from zero")


def _verified_latest(trainer, root: Path) -> tuple[Path, ClientState, dict]:
    """`root`/latest, checked against its manifest: its folder, client state and the layout it was
    saved at (this run's when it predates recorded layouts)."""
    path = latest_folder(root)
    if path is None:
        raise CheckpointError(f"{root} has no `latest` checkpoint pointer: not a train.save folder.")
    verify(path)
    client = read_client_state(path)
    return path, client, client.layout or current_layout(trainer)


def load(trainer, root) -> ClientState:
    """Load `root`/latest into the trainer's engine; returns its client state (the caller takes
    step, evaluations, skipped steps and RNG from it)."""
    root = Path(root)
    path, client, saved = _verified_latest(trainer, root)
    current = current_layout(trainer)
    want_optimizer = trainer.cfg.train.load_optimizer
    if client.weights_only:   # import-hf, train.save_optimizer=false or a step-0 save: no optimizer state
        if want_optimizer and client.step > 0:
            raise weights_only_resume_error(path, client.step)
        load_weights(trainer, path, saved)
        _say(f"loaded the weights of {path} (saved at {describe(saved)}) into {describe(current)}: it is a "
             f"weights-only checkpoint (no optimizer state), so Adam starts fresh at step {client.step}")
    elif want_optimizer and optimizer_state_loadable(saved, current):
        with _mapped_loads(trainer):
            _, loaded = trainer.engine.load_checkpoint(str(root), tag=path.name, load_optimizer_states=True,
                                                       load_lr_scheduler_states=False)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {path}.")
    elif want_optimizer and reshard.has_reshardable_state(path):
        if current["zero_stage"] == 3:
            raise ConfigError(
                f"checkpoint {path} was saved at {describe(saved)}; its re-shardable optimizer state "
                f"cannot be loaded into ZeRO-3 (this run, {describe(current)}): ZeRO-3 keeps no whole "
                f"parameter on any rank to set it into. Continue at train.zero_stage=1 or 2, or set "
                f"train.load_optimizer=false to load the weights with fresh optimizer state.")
        reshard.load(trainer, path)
        _say(f"loaded {path} (saved at {describe(saved)}) into {describe(current)} with its "
             f"optimizer state, re-sharded")
    elif want_optimizer:
        raise cross_layout_error(path, saved, current)
    else:
        load_weights(trainer, path, saved)
        _say(f"loaded the weights of {path} (saved at {describe(saved)}) into {describe(current)}; "
             f"optimizer state starts fresh (train.load_optimizer=false)")
    return client


def load_weights_of(trainer, root) -> None:
    """train.finetune: the weights of `root`/latest alone (any layout); the run keeps its own step 0,
    data position, RNG and fresh optimizer state."""
    path, client, saved = _verified_latest(trainer, Path(root))
    load_weights(trainer, path, saved)
    _say(f"loaded the weights of {path} (step {client.step}, saved at {describe(saved)}) into "
         f"{describe(current_layout(trainer))}: train.finetune starts a new run at step 0 with fresh Adam state")


def _local_model_names(trainer) -> list[str]:
    """The single-device model's state-dict names this rank holds (its pipeline stage's)."""
    cfg = trainer.cfg.model
    if not trainer.pipelined:
        return list(trainer.engine.module.state_dict())
    with torch.device("meta"):
        every = {name: name for name in LanguageModel(cfg, seed=None).state_dict()}
    module, last = trainer.engine.module, cfg.n_layers + 2
    names = []
    for piece in range(module._local_start, module._local_stop):
        tied_head = cfg.tie_embeddings and piece == last   # the head's matrix is piece 0's
        names += from_model_names(every, 0 if tied_head else piece, cfg.n_layers, cfg.tie_embeddings).values()
    return list(dict.fromkeys(names))


def load_weights(trainer, folder: Path, saved: dict) -> None:
    """This rank's slices of the weights of `folder` (saved at layout `saved`) into its module,
    one tensor at a time (read from the memory-mapped files, copied in, dropped): the load holds
    one tensor beyond the module, never a second copy of the model. Strict, as load_state_dict:
    every tensor of the module is loaded, with its shape."""
    cfg = trainer.cfg.model
    tp, rank = dist.get_world_size(trainer.tp_group), dist.get_rank(trainer.tp_group)
    names = _local_model_names(trainer)
    module = trainer.engine.module
    if trainer.pipelined:   # model name -> the PipelineModule's keys (a tied matrix may have two)
        keys = {}
        for key, name in pipeline_state_dict({n: n for n in names}, module, cfg.n_layers, cfg.tie_embeddings).items():
            keys.setdefault(name, []).append(key)
    else:
        keys = {name: [name] for name in names}
    import deepspeed  # ZeRO-3: a parameter holds its DP partition only: gather, copy, re-partition
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):   # no-op below ZeRO-3
        targets = module.state_dict(keep_vars=True)
        wanted = {key for group in keys.values() for key in group}
        missing, unexpected = sorted(set(targets) - wanted), sorted(wanted - set(targets))
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in loading the weights of {folder} into {type(module).__name__}: "
                               f"missing key(s): {missing[:5]}; unexpected key(s): {unexpected[:5]}.")
        with torch.no_grad():
            for name, tensor in iter_local_state(folder, cfg, saved, tp, rank, list(keys)):
                for key in keys[name]:
                    if targets[key].shape != tensor.shape:
                        raise RuntimeError(f"size mismatch for {key}: copying a param with shape "
                                           f"{tuple(tensor.shape)} from {folder}, the shape in current model "
                                           f"is {tuple(targets[key].shape)}.")
                    targets[key].copy_(tensor)
                del tensor
    if hasattr(trainer.engine.optimizer, "refresh_fp32_params"):   # ZeRO keeps fp32 master copies
        trainer.engine.optimizer.refresh_fp32_params()


def _mapped_load(path, map_location=None):
    """DeepSpeed's files for a same-layout resume, memory-mapped and with weights_only=True:
    DeepSpeed copies what it keeps into its own tensors, so the files' pages stay file-backed
    (the kernel can drop them) instead of a whole second copy of model and optimizer state in
    private memory. map_location is always the CPU: every tensor is copied to its device."""
    try:
        return safe_load(path)
    except RuntimeError as err:   # a file in torch's legacy (non-zip) format cannot be mapped
        if "mmap" not in str(err):
            raise
        return safe_load(path, mmap=False)


@contextmanager
def _mapped_loads(trainer):
    """DeepSpeed's load_checkpoint with `_mapped_load` in place of its checkpoint engine's load.
    Weights and ZeRO's fp32 master partitions are copied into the engine's own tensors, but
    torch's Optimizer.load_state_dict (ZeRO-0's, and ZeRO-1/2's for their rigid checkpoints)
    keeps the loaded tensors themselves as Adam's state: those are copied out of the mapping
    afterwards, one at a time, so that no live state stays backed by a file (which pruning may
    delete while the run holds its disk space). The resume's private memory is then the Adam
    state it restores, one optimizer partition (benchmarks/checkpoint_memory.py)."""
    checkpoint_engine = trainer.engine.checkpoint_engine
    own = vars(checkpoint_engine).get("load")
    checkpoint_engine.load = _mapped_load
    try:
        yield
    finally:
        if own is None:
            del checkpoint_engine.load
        else:
            checkpoint_engine.load = own
    for adam in trainer.guard.state.values():
        for key, value in adam.items():
            if isinstance(value, torch.Tensor):
                adam[key] = value.clone()
    if hasattr(trainer.engine.optimizer, "_hp_optimizer_states_linked"):   # ZeRO-1/2: views of the
        trainer.engine.optimizer._hp_optimizer_states_linked = False       # state are re-linked lazily
