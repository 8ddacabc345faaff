"""Checkpoint integrity: `manifest.json` in every checkpoint folder, written last before the
commit, holds the size and sha256 of every other file. Every file this package reads is checked
against it first (size, then sha256), and the trainer checks every file (hashed by all ranks in
parallel) before DeepSpeed loads them, so a damaged shard is refused with its name instead of
training to NaN. `megatron-id check-checkpoint DIR` checks offline. A folder without
manifest.json (written before manifests existed) loads unchecked, with a warning.

Hugging Face exports (hf/export.py) carry the same manifest, with the sha256 of every CHUNK_BYTES
of each file besides (`chunk_sha256`), so that a reader can check a sample of a large file's
chunks instead of every byte (`verify_folder_files`).
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

from ..atomic import write_atomic_text
from ..errors import UserError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megatron_id.checkpoint_manifest/1"
CHUNK_BYTES = 1 << 22   # the chunks of `chunk_sha256` (exports): 4 MiB
# files up to this size are hashed whole even when only a sample is asked for
WHOLE_BELOW = 16 * CHUNK_BYTES


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


def file_digests(path: Path, chunk_bytes: int) -> tuple[str, list[str]]:
    """sha256 of a file and of each of its `chunk_bytes` chunks, in one read."""
    whole, chunks = hashlib.sha256(), []
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            whole.update(chunk)
            chunks.append(hashlib.sha256(chunk).hexdigest())
    return whole.hexdigest(), chunks


def manifest_entries(folder: Path, names, chunk_bytes: int | None = None) -> dict:
    """{name: {"bytes", "sha256"}}; with `chunk_bytes`, also the sha256 of every chunk of that
    many bytes ("chunk_bytes", "chunk_sha256"), for sampled checks."""
    if chunk_bytes is None:
        return {name: {"bytes": (folder / name).stat().st_size, "sha256": file_digest(folder / name)}
                for name in names}
    entries = {}
    for name in names:
        whole, chunks = file_digests(folder / name, chunk_bytes)
        entries[name] = {"bytes": (folder / name).stat().st_size, "sha256": whole, "chunk_bytes": chunk_bytes,
                         "chunk_sha256": chunks}
    return entries


def checkpoint_files(folder: Path) -> list[str]:
    """The files a manifest covers: everything in the folder but the manifest, sorted."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.startswith(".manifest"))


def write_manifest(folder: Path, entries: dict) -> None:
    folder = Path(folder)
    # a fixed name that checkpoint_files leaves out (".manifest..."): a kill's leftover is never covered
    text = json.dumps({"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": entries}, indent=1, sort_keys=True)
    write_atomic_text(folder / MANIFEST, text + "\n", temp=folder / ".manifest.tmp")


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


def warn_unverified(folder: Path, why: str = "saved before checkpoints carried one") -> None:
    print(f"warning: {folder} has no {MANIFEST} ({why}): "
          f"its files are not verified", file=sys.stderr, flush=True)


def verify_file(folder: Path, name: str, manifest: dict | None = "read", advise: bool = True) -> None:
    """Check one file of a checkpoint folder against its manifest (size, then sha256).
    advise=False: the message says what is wrong and not what to do (check-checkpoint gives the
    advice that fits the folder once, after its list)."""
    folder = Path(folder)
    if _settled_key(folder) in _settled:
        return
    manifest = read_manifest(folder) if manifest == "read" else manifest
    path = folder / name
    if manifest is None:
        warn_unverified(folder)
        mark_settled(folder)
        return

    def fix(text: str) -> str:
        return f" {text}" if advise else ""
    older = f"Use an older checkpoint (edit {folder.parent / 'latest'})"
    entry = manifest.get(name)
    if entry is None:
        raise CheckpointError(f"{path} is not listed in {folder / MANIFEST}: the file does not belong "
                              f"to this checkpoint.{fix('Remove it, or use another checkpoint.')}")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (listed in {folder / MANIFEST}): the checkpoint is "
                              f"incomplete.{fix(older + '.')}")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path} has {size} bytes, the manifest says {entry['bytes']}: the file "
                              f"is truncated or damaged.{fix(older + ' or restore this file.')}")
    if file_digest(path) != entry["sha256"]:
        raise CheckpointError(f"{path} does not match its sha256 in {folder / MANIFEST}: the file is "
                              f"damaged.{fix(older + ' or restore this file.')}")


def verify_checkpoint(folder: Path, names=None, advise: bool = True) -> list[str]:
    """Problems of a checkpoint folder (every file, or `names`): [] when healthy. advise: as
    verify_file's."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except CheckpointError as err:
        return [str(err) if advise else f"{folder / MANIFEST} is damaged (not a {MANIFEST_FORMAT} file): the "
                f"checkpoint cannot be verified"]
    if manifest is None:
        return [f"{folder} has no {MANIFEST}: it cannot be verified"]
    problems = []
    for name in sorted(manifest) if names is None else names:
        try:
            verify_file(folder, name, manifest, advise)
        except CheckpointError as err:
            problems.append(str(err))
    if names is None:   # the whole folder: files that no manifest vouches for are a problem too
        extra = sorted(set(checkpoint_files(folder)) - set(manifest))
        problems += [f"{folder / n} is not listed in {folder / MANIFEST}" for n in extra]
    return problems


def verify_folder_files(folder: Path, manifest: dict, sampled_chunks: int | None = None,
                        rng: random.Random | None = None) -> list[str]:
    """Problems of the files `manifest` lists in `folder`: [] when they match. Every file's size
    is checked; then its sha256: of every byte (`sampled_chunks` None, or a file of at most
    WHOLE_BELOW bytes or without chunk digests), else of `sampled_chunks` of its recorded chunks
    (the first, the last and random others: a truncation, a swapped file or a damaged region
    that the sample meets is found; a full check finds any)."""
    folder, rng = Path(folder), rng or random.Random()
    problems = []
    for name in sorted(manifest):
        entry, path = manifest[name], folder / name
        if not path.is_file():
            problems.append(f"{path} is missing (listed in {folder / MANIFEST})")
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"{path} is damaged (it has {size:,} bytes, {MANIFEST} says {entry['bytes']:,})")
            continue
        chunks, chunk_bytes = entry.get("chunk_sha256"), entry.get("chunk_bytes")
        if sampled_chunks is None or not chunks or not chunk_bytes or size <= WHOLE_BELOW:
            if file_digest(path) != entry["sha256"]:
                problems.append(f"{path} is damaged (its sha256 differs from {MANIFEST}'s)")
            continue
        # the first and the last chunk always, then others drawn from between them (drawing from
        # every chunk could pick the ends again and read fewer than `sampled_chunks`)
        middle = range(1, len(chunks) - 1)
        picks = sorted({0, len(chunks) - 1, *rng.sample(middle, max(0, min(sampled_chunks - 2, len(middle))))})
        with open(path, "rb") as f:
            for index in picks:
                f.seek(index * chunk_bytes)
                if hashlib.sha256(f.read(chunk_bytes)).hexdigest() != chunks[index]:
                    start = index * chunk_bytes
                    problems.append(f"{path} is damaged (bytes {start:,}-{min(start + chunk_bytes, size) - 1:,} "
                                    f"differ from {MANIFEST}'s sha256 of them)")
                    break
    return problems
