"""Reading the weights of a checkpoint written at any (TP, PP) layout, and writing a
weights-only checkpoint (what `megatron-id import-hf` produces).

`ModelState` gives the single-device (TP=1, unpadded) weights one tensor at a time, merged over
TP only when asked for (export-hf writes each before reading the next); `read_model_state` the
whole state dict (generate, eval).
`iter_local_state` / `read_local_state` give one rank of another layout only its own slices: the
saved shards are memory-mapped (load_file) and only the rows or columns this rank keeps are
copied out of the ones that hold them, so no rank materialises the whole model
(benchmarks/reshard_memory.py); the iterator yields one tensor at a time (a weights-only load
copies each into the module before reading the next: benchmarks/checkpoint_memory.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import UserError
from ..parallel.pipeline import from_model_names, saved_pieces, to_model_names
from ..parallel.tensor_parallel import VOCAB_PARAMETERS, Split, padded_vocab_size, parameter_role, partition_dim
from .deepspeed_files import safe_load, zero3_model_file, zero_optim_file
from .files import (
    CLIENT_STATE,
    LATEST_TMP,
    LOCK_FILE,
    STAGING,
    ClientState,
    commit,
    finish_staging,
    latest_folder,
    layer_file,
    load_file,
    module_file,
    read_client_state,
    staging_folder,
    tag_for,
    write_client_state,
)
from .integrity import checkpoint_files, manifest_entries, verify_file, write_manifest


class CheckpointNotFoundError(UserError, FileNotFoundError):
    """A --checkpoint that is missing, is not a training checkpoint, or lacks files it names."""


def checkpoint_folder(path, also_export: bool = False) -> Path:
    """A checkpoint root (with `latest`) or one iter_XXXXXXX folder -> the folder.
    also_export: the caller (generate) accepts an exported folder too; the errors say so."""
    path = Path(path)
    accepted = "the train.save folder of a run (it holds `latest`) or one of its iter_XXXXXXX folders" + \
        (", or a folder written by megatron-id export-hf" if also_export else "")
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist: give {accepted}.")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint {path} is a file, not a checkpoint folder: give {accepted}.")
    folder = latest_folder(path)   # its error names a `latest` that points nowhere, and the fix
    if folder is not None:
        return folder
    if (path / CLIENT_STATE).is_file():
        return path
    names = sorted(p.name for p in path.iterdir())
    iters = [n for n in names if n.startswith("iter_") and (path / n / CLIENT_STATE).is_file()]
    below = [p for p in sorted(path.iterdir())
             if p.is_dir() and ((p / "latest").is_file() or (p / CLIENT_STATE).is_file()
                                or (also_export and (p / "config.json").is_file()))]
    if not names:
        why = "it is empty: no checkpoint was saved there"
    elif set(names) <= {LOCK_FILE, STAGING, LATEST_TMP}:
        why = (f"it holds no checkpoint yet (only {', '.join(names)}: a run saves there, train.save, but none "
               f"was committed)")
    elif iters:
        why = f"it has iter_ folders but no `latest`: give one of them, e.g. {path / iters[-1]}"
    elif below:
        why = f"it has neither `latest` nor {CLIENT_STATE}, but its subfolder {below[0]} is one: give that"
    elif (path / "config.json").is_file() and not also_export:
        why = ("it is a Hugging Face folder (it has config.json: an export, or a transformers model): megatron-id "
               "import-hf reads it into a training checkpoint, which this command takes")
    else:
        why = (f"it has neither `latest` (a train.save folder) nor {CLIENT_STATE} (an iter_XXXXXXX folder)"
               + (", nor config.json (an export)" if also_export else ""))
    raise CheckpointNotFoundError(f"{path} is not a training checkpoint: {why}. Give {accepted}.")


def read_checkpoint(path, also_export: bool = False):
    """A training checkpoint -> (its folder, ClientState, ModelConfig, TP=1 weights)."""
    folder = checkpoint_folder(path, also_export)
    client = read_client_state(folder)
    cfg = client.model_config()
    return folder, client, cfg, read_model_state(folder, cfg, client.layout)


class _Zero3Parameter:
    """One parameter of a ZeRO-3 checkpoint: DP rank d holds piece d (ceil(numel / DP) elements,
    the last zero-padded) of every parameter in its fp32 flat groups, parameter after parameter.
    Assembled from the memory-mapped pieces only when indexed (one parameter at a time)."""

    def __init__(self, flats: list, offset: int, shape: torch.Size):
        self.flats, self.offset, self.shape = flats, offset, shape
        self.piece = -(-shape.numel() // len(flats))

    @property
    def dtype(self) -> torch.dtype:
        return self.flats[0].dtype

    def full(self) -> torch.Tensor:
        pieces = [f[self.offset:self.offset + self.piece] for f in self.flats]
        return torch.cat(pieces)[:self.shape.numel()].view(self.shape)

    def __getitem__(self, index):
        return self.full()[index]


class _Concatenated:
    """Memory-mapped flat tensors read as their concatenation, without concatenating them: a
    slice copies only the pieces it spans (DeepSpeed's ZeRO-3 files hold one flat tensor per
    parameter group; torch.cat of them would read the whole partition into memory)."""

    def __init__(self, parts: list):
        self.parts = list(parts)
        self.dtype = self.parts[0].dtype

    def numel(self) -> int:
        return sum(p.numel() for p in self.parts)

    def __getitem__(self, index: slice) -> torch.Tensor:
        pieces, offset = [], 0
        for part in self.parts:
            lo, hi = max(index.start, offset), min(index.stop, offset + part.numel())
            if hi > lo:
                pieces.append(part[lo - offset:hi - offset])
            offset += part.numel()
        if not pieces:
            return self.parts[0][:0]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _zero3_shard(folder: Path, tp: int, dp: int, tied: bool) -> dict:
    """TP rank `tp`'s {model name: _Zero3Parameter} of a ZeRO-3 checkpoint (PP = 1). DeepSpeed's
    model files hold empty placeholders there ("module": every tensor of shape (0,)) and the
    parameter order (param_shapes); the weights are the fp32 partitions of the optimizer files."""
    shapes = [(name, shape) for group in load_file(folder / zero3_model_file(0, tp))["param_shapes"]
              for name, shape in group.items()]
    flats = []
    for d in range(dp):
        path = folder / zero_optim_file(d, tp)
        if not path.is_file():
            raise UserError(f"checkpoint file {path} is missing: the checkpoint is incomplete.")
        verify_file(folder, path.name)
        groups = safe_load(path)["optimizer_state_dict"]["fp32_flat_groups"]
        flats.append(groups[0] if len(groups) == 1 else _Concatenated(groups))
    shard, offset = {}, 0
    for name, shape in shapes:
        shard[name] = _Zero3Parameter(flats, offset, shape)
        offset += shard[name].piece
    if offset != flats[0].numel():
        raise UserError(f"{folder}: the ZeRO-3 partitions of TP rank {tp} hold {flats[0].numel()} "
                        f"elements per DP rank, its parameters need {offset}: not a checkpoint of this model.")
    if tied:   # stored once, as embed.weight (DeepSpeed names the pair in global rank 0's file only)
        shard["lm_head.weight"] = shard["embed.weight"]
    return shard


def saved_shards(folder: Path, cfg: ModelConfig, saved: dict) -> list[dict]:
    """Per saved TP rank, {model name: tensor}, memory-mapped (nothing read yet)."""
    shards = []
    for tp in range(saved["tensor"]):
        if saved["zero_stage"] == 3:
            shards.append(_zero3_shard(folder, tp, saved["data"], cfg.tie_embeddings))
            continue
        if saved["pipe"] == 1:
            shards.append(dict(load_file(folder / module_file(tp))["module"]))
            continue
        shard = {}
        for piece in saved_pieces(cfg):
            shard.update(to_model_names(piece, load_file(folder / layer_file(piece, tp)), cfg.n_layers))
        shards.append(shard)
    return shards


def merged_tensor(name: str, parts: list, cfg: ModelConfig) -> tuple[torch.Tensor, bool]:
    """Parameter `name` at TP=1 (vocabulary padding removed) from `parts`, its tensor on each
    saved TP rank: what tensor_parallel.merge_state_dicts makes of it, without copying where
    nothing needs merging. Returns (tensor, fresh): fresh False when the tensor is a view of a
    part (a memory-mapped file: clone it to keep it)."""
    split = parameter_role(name, cfg).split
    if split.dim is None:   # replicated: every TP rank must hold the same tensor
        for i, part in enumerate(parts[1:], start=1):
            if not torch.equal(part, parts[0]):
                raise ValueError(f"replicated tensor '{name}' differs between TP rank 0 and "
                                 f"rank {i}; the shards do not come from one consistent model.")
        return parts[0], False
    tensor, fresh = (parts[0], False) if len(parts) == 1 else (torch.cat(parts, dim=split.dim), True)
    if split is Split.VOCAB:
        tensor = tensor[:cfg.vocab_size]   # rows: still contiguous
    return tensor, fresh


class ModelState:
    """The TP=1, unpadded LanguageModel weights of checkpoint folder `folder` (saved at layout
    `saved`), one tensor at a time. The saved shards are memory-mapped and a tensor is read and
    merged over TP only when asked for, so a reader that handles one tensor at a time (export-hf)
    never holds more than one merged tensor. `names` is the state dict's order."""

    def __init__(self, folder, cfg: ModelConfig, saved: dict):
        self.folder, self.cfg = Path(folder), cfg
        self.shards = saved_shards(self.folder, cfg, saved)
        self.names = list(self.shards[0])
        for i, shard in enumerate(self.shards[1:], start=1):
            if set(shard) != set(self.names):
                raise ValueError(f"TP rank {i} has different keys from rank 0: "
                                 f"{sorted(set(shard) ^ set(self.names))[:5]}")

    def spec(self, name: str) -> tuple[torch.dtype, tuple]:
        """(dtype, shape) of the merged tensor, from the saved shapes alone (nothing read)."""
        first = self.shards[0][name]
        shape, dim = list(first.shape), parameter_role(name, self.cfg).split.dim
        if dim is not None:
            shape[dim] = sum(shard[name].shape[dim] for shard in self.shards)
            if parameter_role(name, self.cfg).split is Split.VOCAB:
                shape[0] = self.cfg.vocab_size
        return first.dtype, tuple(shape)

    def tensor(self, name: str) -> tuple[torch.Tensor, bool]:
        """(the merged tensor, fresh): see merged_tensor."""
        parts = [shard[name].full() if isinstance(shard[name], _Zero3Parameter) else shard[name]
                 for shard in self.shards]
        tensor, fresh = merged_tensor(name, parts, self.cfg)
        return tensor, fresh or isinstance(self.shards[0][name], _Zero3Parameter)   # full(): assembled, ours

    def __getitem__(self, name: str) -> torch.Tensor:
        """The merged tensor, a copy of its own (safe to keep or modify)."""
        tensor, fresh = self.tensor(name)
        return tensor if fresh else tensor.clone()


def read_model_state(folder: Path, cfg: ModelConfig, saved: dict) -> dict:
    """The TP=1, unpadded LanguageModel state dict held by checkpoint folder `folder`."""
    state = ModelState(folder, cfg, saved)
    return {name: state[name] for name in state.names}


def local_slice(name: str, cfg: ModelConfig, tp: int, rank: int, parts: list) -> torch.Tensor:
    """TP rank `rank`'s piece (vocabulary padded for `tp`) of parameter `name`, taken from `parts`:
    the stored pieces, in order along the partition dim (one part: a TP=1 tensor; several: the
    shards of the saving TP). Each part is (shape, take), take(index tuple) -> tensor; only the
    rows or columns this rank keeps are taken (memory-mapped or lazy sources read nothing else)."""
    dim = partition_dim(name)
    if dim is None:   # replicated: every saved shard holds it whole
        shape, take = parts[0]
        return take(tuple(slice(None) for _ in shape)).clone()
    sizes = [shape[dim] for shape, _ in parts]
    full = cfg.vocab_size if name in VOCAB_PARAMETERS else sum(sizes)
    per = (padded_vocab_size(cfg, tp) if name in VOCAB_PARAMETERS else full) // tp
    start, stop = rank * per, min((rank + 1) * per, full)
    pieces, offset = [], 0
    for (shape, take), size in zip(parts, sizes):
        lo, hi = max(start, offset), min(stop, offset + size)
        if hi > lo:
            index = tuple(slice(lo - offset, hi - offset) if d == dim else slice(None) for d in range(len(shape)))
            pieces.append(take(index))
        offset += size
    shape = list(parts[0][0])
    shape[dim] = 0
    if len(pieces) == 1:   # a view of its source: copied once, below
        tensor, fresh = pieces[0], False
    else:
        tensor, fresh = (torch.cat(pieces, dim=dim) if pieces else torch.zeros(shape)), True
    if tensor.shape[dim] < per:   # vocabulary padding rows (dim 0), zero as in split_state_dict
        tensor, fresh = torch.nn.functional.pad(tensor, (0, 0, 0, per - tensor.shape[dim])), True
    return tensor if fresh else tensor.clone()


def iter_local_state(folder: Path, cfg: ModelConfig, saved: dict, tp: int, rank: int, names):
    """(name, TP rank `rank`'s piece at TP=`tp`) for the model names `names`, one at a time (each
    a tensor of its own), from a checkpoint saved at layout `saved`: the weights a rank of
    another layout loads. Every name is checked to be present before the first is read."""
    shards = saved_shards(Path(folder), cfg, saved)
    names = list(names)
    for name in names:
        if any(name not in shard for shard in shards):
            raise UserError(f"{folder} has no tensor {name}: the checkpoint is of another model "
                            f"than this run's config.")
    for name in names:
        parts = [(tuple(shard[name].shape), shard[name].__getitem__) for shard in shards]
        yield name, local_slice(name, cfg, tp, rank, parts)


def read_local_state(folder: Path, cfg: ModelConfig, saved: dict, tp: int, rank: int, names) -> dict:
    """{name: TP rank `rank`'s piece at TP=`tp`}: iter_local_state, collected."""
    return dict(iter_local_state(folder, cfg, saved, tp, rank, names))


def write_weights_only(staging: Path, shards: list[dict], cfg: ModelConfig, pipeline_parallel: int,
                       client: ClientState) -> Path:
    """A complete checkpoint root in `staging` (an empty folder) holding one folder of weights:
    one state dict per TP rank (`shards`), in the file layout of a PP=`pipeline_parallel` run,
    written as the trainer writes (staging folder, manifest last, commit)."""
    incomplete = staging_folder(staging, tag_for(client.step))
    for tp, shard in enumerate(shards):
        if pipeline_parallel == 1:
            torch.save({"module": shard}, incomplete / module_file(tp))
            continue
        for piece in saved_pieces(cfg):
            torch.save(from_model_names(shard, piece, cfg.n_layers, cfg.tie_embeddings),
                       incomplete / layer_file(piece, tp))
    write_client_state(incomplete, client)
    write_manifest(incomplete, manifest_entries(incomplete, checkpoint_files(incomplete)))   # last
    final = commit(incomplete, staging)
    finish_staging(staging)
    return final
