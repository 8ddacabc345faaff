"""The checkpoint format: folder and file names, staging and the atomic commit, `latest`,
pruning, and the client state.

A checkpoint root (train.save) holds `iter_XXXXXXX/` folders (the step, 7 digits, Megatron's
naming) and `latest`, the name of the newest complete one. One folder holds:
  PP = 1   mp_rank_{tp:02d}_model_states.pt        {"module": state dict of TP rank tp, ...}
  PP > 1   layer_{i:02d}-model_{tp:02d}-model_states.pt   one per pipeline piece i and TP rank
           (piece 0 = embedding, 1..L = blocks, L+1 = final norm, L+2 = LM head, absent when
           tied to the embedding; see parallel/pipeline.py)
           and mp_rank_{r:02d}_model_states.pt per stage x TP rank (DeepSpeed's bookkeeping)
  ZeRO     zero_pp_rank_{dp}_mp_rank_{r:02d}_optim_states.pt (DeepSpeed's optimizer partitions)
  optim/   the optimizer state per parameter, loadable at any layout (reshard.py)
  client_state.pt   ours: step, the layout that wrote the checkpoint, model config, tokenizer,
           RNG (`ClientState`; read without loading any weights)
  manifest.json     written last: size and sha256 of every other file (integrity.py)

Writing: a save fills `<root>/.incomplete/<tag>` (`staging_folder`); `commit` renames the
finished folder into place and only then replaces `latest` (atomically), so a kill at any moment
leaves `latest` on a complete checkpoint; `prune` keeps the last K. Every file is read with
`weights_only=True` (`load_file`), after its manifest check.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import struct
import sys
from enum import Enum
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from omegaconf import OmegaConf

from ..atomic import write_atomic_text
from ..config import ModelConfig
from .integrity import CheckpointError, verify_file

CLIENT_STATE = "client_state.pt"
STAGING = ".incomplete"
LOCK_FILE = ".lock"
# `latest` is written under this fixed name first: remove_stale_staging knows it, so a kill's leftover goes
LATEST_TMP = ".latest.tmp"
SAVE_FOLDER_ENTRIES = ("latest", LATEST_TMP, STAGING, LOCK_FILE)   # and iter_XXXXXXX


def tag_for(step: int) -> str:
    return f"iter_{step:07d}"


def step_of(tag: str) -> int:
    return int(tag.removeprefix("iter_"))


def module_file(tp: int) -> str:
    return f"mp_rank_{tp:02d}_model_states.pt"


def layer_file(piece: int, tp: int) -> str:
    return f"layer_{piece:02d}-model_{tp:02d}-model_states.pt"


# ------------------------------------------------------------ folders

def is_checkpoint_root(path: Path) -> bool:
    return (Path(path) / "latest").is_file()


def latest_folder(root) -> Path | None:
    """The folder `root`/latest names (None when there is no `latest`)."""
    root = Path(root)
    if not (root / "latest").is_file():
        return None
    tag = (root / "latest").read_text().strip()
    if not tag:
        present = sorted(p.name for p in root.glob("iter_*") if p.is_dir())
        choice = f" (here: {', '.join(present[-3:])})" if present else " (there is none here)"
        raise CheckpointError(f"{root}/latest is empty: it names no checkpoint. Write the name of an existing "
                              f"iter_XXXXXXX folder of {root}{choice} into {root}/latest, or give that folder itself.")
    if "/" in tag or not (root / tag).is_dir():
        raise CheckpointError(f"{root}/latest names '{tag}' but {root / tag} does not exist: write the "
                              f"name of an existing iter_XXXXXXX folder of {root} into {root}/latest.")
    return root / tag


def staging_folder(root: Path, tag: str) -> Path:
    """An empty `<root>/.incomplete/<tag>` for a save to fill (a leftover of a killed save of the
    same step is removed). Call on one rank."""
    staged = Path(root) / STAGING / tag
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    return staged


def commit(staged: Path, root: Path) -> Path:
    """Rename the complete folder `staged` to `root`/<its name>, then point `latest` at it: a
    kill at any moment leaves `latest` on a complete checkpoint."""
    final = root / staged.name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staged, final)   # a folder: write_atomic is for files
    write_atomic_text(root / "latest", staged.name, temp=root / LATEST_TMP)   # the commit point
    return final


def finish_staging(root: Path) -> None:
    """After a commit: what is left in .incomplete is DeepSpeed's helper scripts (zero_to_fp32.py)."""
    shutil.rmtree(Path(root) / STAGING, ignore_errors=True)


def prune(root: Path, keep: int, current: str) -> None:
    """Keep the newest `keep` iter_ folders (0: all); never the one just written."""
    tags = sorted(p.name for p in Path(root).glob("iter_*") if p.is_dir())
    for old in tags[:-keep] if keep > 0 else []:
        if old != current:
            shutil.rmtree(Path(root) / old, ignore_errors=True)


def remove_stale_staging(folder) -> list[str]:
    """Staging folders and temp files that killed saves left in train.save (only called while
    holding the SaveLock, so no live run is writing them). Returns what was removed."""
    folder = Path(folder)
    removed = [str(p) for p in sorted((folder / STAGING).glob("iter_*"))]
    if (folder / LATEST_TMP).exists():
        removed.append(str(folder / LATEST_TMP))
        (folder / LATEST_TMP).unlink()
    finish_staging(folder)   # the rest is DeepSpeed's helper scripts, not news
    return removed


# ------------------------------------------------------------ reading one file

def load_file(path: Path) -> dict:
    """A checkpoint file, checked against its folder's manifest, loaded with weights_only=True.
    mmap: tensors stay on disk until touched (a rank that keeps a slice reads only that)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete "
                              f"or was written by another layout than its record says.")
    verify_file(path.parent, path.name)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:   # a file the manifest cannot vouch for (no manifest) and torch cannot read
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}): the file is "
                              f"damaged. Use an older checkpoint.") from None


# ------------------------------------------------------------ writing safetensors one tensor at a time

def _safetensors_header(order: list, specs: dict, dtype_names: dict, metadata) -> bytes:
    """The header safetensors writes for `specs` ({name: (dtype, shape)}) in `order`: its length
    (8 bytes, little endian), then compact JSON (__metadata__ first, then the tensors in the
    order of their data), padded with spaces to a multiple of 8 bytes."""
    entries, offset = ({"__metadata__": metadata} if metadata is not None else {}), 0
    for name in order:
        dtype, shape = specs[name]
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        entries[name] = {"dtype": dtype_names[name], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def save_safetensors(path, specs: dict, tensor_of, metadata: dict | None = None) -> None:
    """The file safetensors.torch.save_file writes for {name: tensor_of(name)}, byte for byte,
    written one tensor at a time: `specs` ({name: (dtype, shape)}) gives the header before any
    tensor exists, and each tensor is asked for, written and dropped in turn, so at most one
    is in memory (export-hf of a model larger than the host's memory).

    safetensors orders the data by dtype, then name; that order, its dtype names and its header
    format are learned from safetensors itself on a stand-in of one element per tensor, and the
    header built here must equal the stand-in's byte for byte. Should a safetensors version
    write differently, every tensor is gathered and save_file writes the file instead (same
    bytes, more memory)."""
    probe = safetensors.torch.save({name: torch.zeros(1, dtype=dtype) for name, (dtype, _) in specs.items()},
                                   metadata=metadata)
    size = struct.unpack("<Q", probe[:8])[0]
    layout = json.loads(probe[8:8 + size])
    order = sorted((k for k in layout if k != "__metadata__"), key=lambda k: layout[k]["data_offsets"][0])
    names = {k: layout[k]["dtype"] for k in order}
    same = _safetensors_header(order, {k: (specs[k][0], (1,)) for k in order}, names, metadata) == probe[:8 + size]
    if not same or sys.byteorder != "little":
        safetensors.torch.save_file({name: tensor_of(name).contiguous() for name in specs}, str(path),
                                    metadata=metadata)
        return
    with open(path, "wb") as f:
        f.write(_safetensors_header(order, specs, names, metadata))
        for name in order:
            tensor = tensor_of(name)
            dtype, shape = specs[name]
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{name}: a {tensor.dtype} tensor of shape {tuple(tensor.shape)} where the "
                                 f"header says {dtype} {tuple(shape)}")
            f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
            del tensor


# ------------------------------------------------------------ the client state

@dataclasses.dataclass
class ClientState:
    """Ours, beside DeepSpeed's files: what a resume, an export or a re-shard needs to know
    without loading weights. Stored as a plain dict (loads with weights_only=True)."""
    step: int
    model: dict                       # the ModelConfig as plain values (model_config_dict)
    layout: dict | None = None        # layout_record of the writer; None: written before records
    consumed_samples: int | None = None   # the data position (step x global batch); None: older
    tokenizer: str | None = None      # absolute path of data.tokenizer
    # the identity of the tokenizer whose ids it was trained on (data/tokenizer.py); None:
    # unknown, mixed on purpose, or written before identities were recorded
    tokenizer_id: str | None = None
    evaluations: int = 0              # validation rounds done (each reads new batches)
    skipped_steps: int = 0            # non-finite steps skipped so far
    rng: dict | None = None           # rng_state() of rank 0
    weights_only: bool = False        # written by import-hf: no optimizer state
    # what the data and its validation were (megatron-id eval rebuilds the same validation
    # samples from it): data_path, split, seed, seq_length, eval_iters, global_batch_size,
    # train_iters, eval_interval; None: written before it was recorded, or by import-hf
    data: dict | None = None
    wandb_run_id: str | None = None   # train.wandb's run: a resumed or requeued job continues it
    # train.metrics_file when this checkpoint was saved, {"path": absolute, "bytes": its size}:
    # a resume from it drops only the lines its own run wrote after those bytes (training/metrics.py)
    metrics_file: dict | None = None
    # what `megatron-id convert` made these weights from (checkpoint/conversion.py): the source
    # checkpoint, the pattern, per converted layer the tensors carried, fresh and dropped, and
    # --select's scores; None for any other checkpoint
    conversion: dict | None = None
    # the optimizer settings a resume continues ({"optimizer.lr": ..., "train.train_tokens": ...}:
    # the schedule's keys and AdamW's; training/engine.py optimizer_record); None: written before
    # they were recorded, or by import-hf
    optimizer: dict | None = None
    # loss spikes (training/spikes.py SpikeMonitor.state): the sample ranges the data order skips
    # after a rollback, the running window of losses, the recent spikes; None: none recorded
    spikes: dict | None = None

    def model_config(self) -> ModelConfig:
        """The model as saved, for readers (eval, generate, export, conversion). core_impl is
        how the run computed its core, not part of the model: readers get `auto`, so that a
        checkpoint trained with core_impl=triton on GPUs evaluates and exports on a CPU."""
        return model_config_from_dict({**self.model, "core_impl": "auto"})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, path: Path) -> "ClientState":
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(values, dict) or "step" not in values or "model" not in values:
            raise CheckpointError(f"{path} is not a megatron_id client state (no step or model config).")
        return cls(**{k: v for k, v in values.items() if k in known})


def write_client_state(folder: Path, client: ClientState) -> None:
    torch.save(client.to_dict(), Path(folder) / CLIENT_STATE)


def read_client_state(folder: Path) -> ClientState:
    path = Path(folder) / CLIENT_STATE
    return ClientState.from_dict(load_file(path), path)


def model_config_dict(cfg: ModelConfig) -> dict:
    """The model config as plain values (enums as strings): loads with weights_only=True."""
    return {k: (v.value if isinstance(v, Enum) else v) for k, v in dataclasses.asdict(cfg).items()}


def model_config_from_dict(values: dict) -> ModelConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), values))


def layout_record(layout, zero_stage: int) -> dict:
    """"data" is DeepSpeed's data-parallel size, over which ZeRO partitions: DP x CP under context
    parallelism (its CP ranks hold the same weights, like DP replicas); "context" is CP."""
    return {"tensor": layout.tensor, "pipe": layout.pipe, "data": getattr(layout, "gradient_replicas", layout.data),
            "zero_stage": zero_stage, "context": getattr(layout, "context", 1)}


def describe(record: dict) -> str:
    context = record.get("context", 1)
    data = (f"DP={record['data'] // context} x CP={context}" if context > 1 else f"DP={record['data']}")
    return f"TP={record['tensor']}, PP={record['pipe']}, {data}, ZeRO-{record['zero_stage']}"


# RNG states as tensors and ints, so the files load with weights_only=True.
def rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
