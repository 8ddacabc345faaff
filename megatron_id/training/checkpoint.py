"""Reading our DeepSpeed checkpoints at any layout: one TP=1 model state dict from the files of
whatever TP x PP layout wrote them, and the check that decides how a checkpoint can be loaded.

A checkpoint folder `iter_XXXXXXX/` holds DeepSpeed's files:
  PP = 1   mp_rank_{tp:02d}_model_states.pt        {"module": state dict of TP rank tp, ...}
  PP > 1   layer_{i:02d}-model_{tp:02d}-model_states.pt   one per pipeline piece i and TP rank
           (piece 0 = embedding, 1..L = blocks, L+1 = final norm, L+2 = LM head, absent when
           tied to the embedding; see parallel/pipeline.py)
           and mp_rank_{r:02d}_model_states.pt per stage x TP rank (DeepSpeed's bookkeeping)
  ZeRO     zero_pp_rank_{dp}_mp_rank_{r:02d}_optim_states.pt (optimizer partitions)
and ours, client_state.pt: step, the layout that wrote the checkpoint, model config, tokenizer,
RNG (DeepSpeed keeps a copy in its mp_rank files; this one is read without loading weights).
and manifest.json, written last: the size and sha256 of every other file. A checkpoint root holds
iter_XXXXXXX folders and `latest`, the name of the newest complete one; `commit` moves a
finished folder into place and only then replaces `latest` (atomically).

Integrity: every checkpoint file this code reads is checked against the manifest first (size,
then sha256), and the trainer checks every file before DeepSpeed loads them, so a damaged shard
is refused with its name instead of training to NaN. `megatron-id check-checkpoint DIR` checks
offline. A folder without manifest.json (written before manifests existed) loads unchecked,
with a warning.

Weights can be re-sharded to any layout (merge_state_dicts -> split_state_dict). The optimizer
state cannot: its ZeRO partitions are flat buffers cut by the writer's DP x TP x PP layout, and
DeepSpeed's universal checkpoint conversion is not wired up. Loading at another layout therefore
needs train.load_optimizer=false (Megatron's --no-load-optim); the error says so.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, ModelConfig
from ..errors import UserError
from ..parallel.pipeline import saved_pieces, to_model_names
from ..parallel.tensor_parallel import merge_state_dicts


def model_config_dict(cfg: ModelConfig) -> dict:
    """The model config as plain values (enums as strings): loads with weights_only=True."""
    import dataclasses
    from enum import Enum
    return {k: (v.value if isinstance(v, Enum) else v) for k, v in dataclasses.asdict(cfg).items()}


def model_config_from_dict(values: dict) -> ModelConfig:
    from omegaconf import OmegaConf
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), values))


def layout_record(layout, zero_stage: int) -> dict:
    return {"tensor": layout.tensor, "pipe": layout.pipe, "data": layout.data, "zero_stage": zero_stage}


def describe(record: dict) -> str:
    return (f"TP={record['tensor']}, PP={record['pipe']}, DP={record['data']}, "
            f"ZeRO-{record['zero_stage']}")


def optimizer_state_loadable(saved: dict, current: dict) -> bool:
    """DeepSpeed can restore its optimizer files only into the layout that wrote them (the DP
    size matters only when ZeRO partitions the state over it)."""
    keys = ["tensor", "pipe", "zero_stage"] + (["data"] if current["zero_stage"] > 0 else [])
    return all(saved[k] == current[k] for k in keys)


def cross_layout_error(path: Path, saved: dict, current: dict) -> ConfigError:
    return ConfigError(
        f"checkpoint {path} was saved at {describe(saved)}; this run is {describe(current)}. "
        f"The weights can be re-sharded to this layout but its optimizer state cannot: DeepSpeed "
        f"partitions it by the saving layout, and the checkpoint has no re-shardable copy "
        f"(optim/, written by runs with train.reshardable_optimizer=true). Set "
        f"train.load_optimizer=false to load the weights with fresh optimizer state (the step, "
        f"data position and LR schedule continue), or run at the saved layout to resume exactly.")


CLIENT_STATE = "client_state.pt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megatron_id.checkpoint_manifest/1"


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or damaged; the message names the file."""


# ------------------------------------------------------------ the manifest

def file_digest(path: Path, block: int = 1 << 24) -> str:
    """sha256 of a file, read in 16 MiB blocks (bounded memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def manifest_entries(folder: Path, names) -> dict:
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": file_digest(folder / name)}
            for name in names}


def checkpoint_files(folder: Path) -> list[str]:
    """The files a manifest covers: everything in the folder but the manifest, sorted."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.startswith(".manifest"))


def write_manifest(folder: Path, entries: dict) -> None:
    folder = Path(folder)
    tmp = folder / ".manifest.tmp"
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": entries},
                              indent=1, sort_keys=True) + "\n")
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: Path) -> dict | None:
    """{file name: {"bytes", "sha256"}}, or None for a folder written before manifests."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        assert data["format"] == MANIFEST_FORMAT and isinstance(data["files"], dict)
        return data["files"]
    except (ValueError, KeyError, AssertionError, TypeError):
        raise CheckpointError(f"{path} is damaged (not a {MANIFEST_FORMAT} file): the checkpoint "
                              f"cannot be verified. Use an older checkpoint (edit `latest`) or "
                              f"re-save.") from None


# Folders this process need not check again: every file was verified (Trainer._verify, all ranks
# together, just before loading), or the folder has no manifest and that was said once. Keyed
# with the manifest's mtime, so a folder written anew under the same name is checked again.
_settled: set = set()


def _settled_key(folder: Path):
    manifest = folder / MANIFEST
    return folder.resolve(), manifest.stat().st_mtime_ns if manifest.exists() else None


def mark_settled(folder: Path) -> None:
    _settled.add(_settled_key(Path(folder)))


def warn_unverified(folder: Path) -> None:
    print(f"warning: {folder} has no {MANIFEST} (saved before checkpoints carried one): "
          f"its files are not verified", file=sys.stderr, flush=True)


def verify_file(folder: Path, name: str, manifest: dict | None = "read") -> None:
    """Check one file of a checkpoint folder against its manifest (size, then sha256)."""
    folder = Path(folder)
    if _settled_key(folder) in _settled:
        return
    manifest = read_manifest(folder) if manifest == "read" else manifest
    path = folder / name
    if manifest is None:
        warn_unverified(folder)
        mark_settled(folder)
        return
    entry = manifest.get(name)
    if entry is None:
        raise CheckpointError(f"{path} is not listed in {folder / MANIFEST}: the file does not belong "
                              f"to this checkpoint. Remove it, or use another checkpoint.")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (listed in {folder / MANIFEST}): the checkpoint is "
                              f"incomplete. Use an older checkpoint (edit {folder.parent / 'latest'}).")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path} has {size} bytes, the manifest says {entry['bytes']}: the file "
                              f"is truncated or damaged. Use an older checkpoint (edit "
                              f"{folder.parent / 'latest'}) or restore this file.")
    if file_digest(path) != entry["sha256"]:
        raise CheckpointError(f"{path} does not match its sha256 in {folder / MANIFEST}: the file is "
                              f"damaged. Use an older checkpoint (edit {folder.parent / 'latest'}) or "
                              f"restore this file.")


def verify_checkpoint(folder: Path, names=None) -> list[str]:
    """Problems of a checkpoint folder (every file, or `names`): [] when healthy."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except CheckpointError as err:
        return [str(err)]
    if manifest is None:
        return [f"{folder} has no {MANIFEST}: it cannot be verified"]
    problems = []
    for name in sorted(manifest) if names is None else names:
        try:
            verify_file(folder, name, manifest)
        except CheckpointError as err:
            problems.append(str(err))
    if names is None:   # the whole folder: files that no manifest vouches for are a problem too
        extra = sorted(set(checkpoint_files(folder)) - set(manifest))
        problems += [f"{folder / n} is not listed in {folder / MANIFEST}" for n in extra]
    return problems


# ------------------------------------------------------------ what a run may do with its folders

LOCK_FILE = ".lock"
SAVE_FOLDER_ENTRIES = ("latest", ".latest.tmp", ".incomplete", LOCK_FILE)   # and iter_XXXXXXX


def is_checkpoint_root(path: Path) -> bool:
    return (Path(path) / "latest").is_file()


def check_save_and_load(save: str | None, load: str | None) -> tuple[Path | None, str | None]:
    """Decide where a run resumes from, before any work, by Megatron's habits made safe:

    - train.load names a folder with `latest`: resume from it;
    - train.load equal to train.save and no checkpoint yet: a fresh start (said in the log);
    - train.load that names nothing else: an error (a typo must not silently start from step 1);
    - train.save holding a checkpoint history is written only by a run that resumes from it
      (train.load = train.save): a run never repoints `latest` of a history it did not load;
    - train.save holding anything but our own files is refused (it is somebody else's folder).
    Returns (the root to resume from or None, a note for the log or None)."""
    save_path = Path(save).resolve() if save else None
    load_path = Path(load).resolve() if load else None
    resume, note = None, None
    if load_path is not None:
        if is_checkpoint_root(load_path):
            latest_folder(load_path)   # `latest` must name an existing folder
            resume = load_path
        elif load_path == save_path:
            note = f"no checkpoint found in {load_path}: starting from scratch"
        elif (load_path / CLIENT_STATE).is_file():
            raise ConfigError(f"train.load={load} is one checkpoint folder; train.load takes the folder "
                              f"that holds `latest` and the iter_ folders: train.load={load_path.parent}.")
        else:
            what = "does not exist" if not load_path.exists() else "holds no checkpoint (no `latest` file)"
            raise ConfigError(f"train.load={load} {what}. Give the train.save folder of an earlier run "
                              f"(it holds `latest`), or leave train.load unset to start from scratch.")
    if save_path is not None:
        if save_path.exists() and not save_path.is_dir():
            raise ConfigError(f"train.save={save} is a file, not a folder: choose a folder for checkpoints.")
        if save_path.is_dir() and resume != save_path:   # resuming into its own history is fine
            if is_checkpoint_root(save_path):
                tag = (save_path / "latest").read_text().strip()
                raise ConfigError(
                    f"train.save={save} already holds a checkpoint history (latest: {tag}) that this "
                    f"run does not resume from; writing there would replace its `latest`. To continue "
                    f"it set train.load={save}; to start a new run choose an empty train.save folder.")
            foreign = sorted(p.name for p in save_path.iterdir()
                             if p.name not in SAVE_FOLDER_ENTRIES and not p.name.startswith("iter_"))
            if foreign:
                raise ConfigError(f"train.save={save} holds files that are not checkpoints ({', '.join(foreign[:5])}"
                                  f"{', ...' if len(foreign) > 5 else ''}): a run writes checkpoints only into "
                                  f"an empty folder or its own. Choose another folder (e.g. {save_path / 'checkpoints'}).")
            if not is_checkpoint_root(save_path) and any(save_path.glob("iter_*")):
                raise ConfigError(f"train.save={save} holds iter_ folders but no `latest`: they are not "
                                  f"a history this run can continue, and pruning could delete them. Move "
                                  f"them away, or restore {save_path / 'latest'} and set train.load={save}.")
    return resume, note


class SaveLock:
    """An exclusive lock on a train.save folder for the life of a run (rank 0 holds it): a
    second live run writing the same folder (a restarted job while an orphan still trains) is
    refused with the holder named. flock is released by the kernel when the process dies, so a
    killed run leaves no stale lock."""

    def __init__(self, folder):
        import fcntl
        import socket
        import time
        self.path = Path(folder) / LOCK_FILE
        self.created_folder = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.path.read_text().strip() or "unknown"
            os.close(self._fd)
            raise ConfigError(f"train.save={folder} is in use by another live run ({holder}): two runs "
                              f"writing one folder corrupt its history. Stop that run (or wait for it), "
                              f"or choose another train.save.") from None
        who = (f"host {socket.gethostname()}, pid {os.getpid()}"
               + (f", SLURM job {os.environ['SLURM_JOB_ID']}" if "SLURM_JOB_ID" in os.environ else "")
               + f", since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        os.ftruncate(self._fd, 0)
        os.write(self._fd, (who + "\n").encode())

    def release(self) -> None:
        """Drop the lock. A folder this run created and never wrote a checkpoint into (a run
        that failed early) is removed again: nothing is left behind."""
        if self._fd is None:
            return
        folder = self.path.parent
        if self.created_folder and [p.name for p in folder.iterdir()] == [LOCK_FILE]:
            self.path.unlink()
            folder.rmdir()
        os.close(self._fd)   # closing drops the flock; a kept lock file is harmless (reused)
        self._fd = None


def remove_stale_staging(folder) -> list[str]:
    """Staging folders and temp files that killed saves left in train.save (only called while
    holding the SaveLock, so no live run is writing them). Returns what was removed."""
    folder = Path(folder)
    removed = [str(p) for p in sorted((folder / ".incomplete").glob("iter_*"))]
    if (folder / ".latest.tmp").exists():
        removed.append(str(folder / ".latest.tmp"))
        (folder / ".latest.tmp").unlink()
    # the rest of .incomplete is DeepSpeed's helper scripts (zero_to_fp32.py ...), not news
    shutil.rmtree(folder / ".incomplete", ignore_errors=True)
    return removed


def module_file(tp: int) -> str:
    return f"mp_rank_{tp:02d}_model_states.pt"


def layer_file(piece: int, tp: int) -> str:
    return f"layer_{piece:02d}-model_{tp:02d}-model_states.pt"


def latest_folder(root) -> Path | None:
    """The folder `root`/latest names (None when there is no `latest`)."""
    root = Path(root)
    if not (root / "latest").is_file():
        return None
    tag = (root / "latest").read_text().strip()
    if not tag or "/" in tag or not (root / tag).is_dir():
        raise CheckpointError(f"{root}/latest names '{tag}' but {root / tag} does not exist: write the "
                              f"name of an existing iter_XXXXXXX folder of {root} into {root}/latest.")
    return root / tag


def commit(staged: Path, root: Path) -> Path:
    """Rename the complete folder `staged` to `root`/<its name>, then point `latest` at it: a
    kill at any moment leaves `latest` on a complete checkpoint."""
    final = root / staged.name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staged, final)
    tmp = root / ".latest.tmp"
    tmp.write_text(staged.name)
    os.replace(tmp, root / "latest")   # the commit point
    return final


def _load(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete "
                              f"or was written by another layout than its record says.")
    verify_file(path.parent, path.name)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:   # a file the manifest cannot vouch for (no manifest) and torch cannot read
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}): the file is "
                              f"damaged. Use an older checkpoint.") from None


def write_client_state(ckpt: Path, client: dict) -> None:
    torch.save(client, Path(ckpt) / CLIENT_STATE)


def read_client_state(ckpt: Path) -> dict:
    """Our client state (step, layout, model config, RNG...)."""
    return _load(Path(ckpt) / CLIENT_STATE)


def read_model_state(ckpt: Path, cfg: ModelConfig, saved: dict) -> dict:
    """The TP=1, unpadded LanguageModel state dict held by checkpoint folder `ckpt`."""
    ckpt = Path(ckpt)
    shards = []
    for tp in range(saved["tensor"]):
        if saved["pipe"] == 1:
            shards.append(dict(_load(ckpt / module_file(tp))["module"]))
            continue
        shard = {}
        for piece in saved_pieces(cfg):
            shard.update(to_model_names(piece, _load(ckpt / layer_file(piece, tp)), cfg.n_layers))
        shards.append(shard)
    return merge_state_dicts(shards, cfg)


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
