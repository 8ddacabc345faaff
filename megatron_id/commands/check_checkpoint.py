"""`megatron-id check-checkpoint`: verify checkpoint folders against their manifests, offline.

A training checkpoint (a train.save folder or one iter_ folder) and an export (export-hf's
folder) carry the same manifest.json; what to do about a damaged one differs (go back to an
older checkpoint, write the weights-only one again, export again), so the advice is given once,
after the list of problems, for the kind of folder checked."""
from __future__ import annotations

import sys
from pathlib import Path

from ..checkpoint.integrity import MANIFEST, CheckpointError, verify_checkpoint


def add_parser(sub) -> None:
    c = sub.add_parser("check-checkpoint", help="verify checkpoint files against their manifest (sizes, sha256)",
                       allow_abbrev=False)
    c.add_argument("path", help="train.save folder (checks the one `latest` names), an iter_XXXXXXX folder, or a "
                                "folder written by export-hf")
    c.add_argument("--all", action="store_true", help="check every iter_ folder of a train.save folder")
    c.set_defaults(func=run)


def run(args) -> int:
    """Verify checkpoint folders against their manifests offline: the one `latest` names (or
    every iter_ folder with --all, or the iter_ folder given), or an export. Exit 0 only when
    all are whole."""
    from ..checkpoint.files import CLIENT_STATE, STAGING, latest_folder  # torch: not at import (cli.py)
    root = Path(args.path)
    if not root.exists():
        raise CheckpointError(f"{root} does not exist: give a train.save folder, an iter_XXXXXXX folder or an "
                              f"export.")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a folder: give a train.save folder, an iter_XXXXXXX folder or an "
                              f"export.")
    if (root / "config.json").is_file() and not (root / CLIENT_STATE).is_file() and not (root / "latest").is_file():
        return check_hf_folder(root)
    if (root / MANIFEST).is_file() or (root / CLIENT_STATE).is_file():
        folders = [root]
    elif args.all:
        folders = sorted(p for p in root.glob("iter_*") if p.is_dir())
    else:
        folders = [f for f in [latest_folder(root)] if f is not None]
    if not folders:
        raise CheckpointError(f"{root} holds no checkpoint (no `latest`, no iter_ folder): give a train.save "
                              f"folder or an iter_XXXXXXX folder.")
    stale = sorted((root / STAGING).glob("iter_*"))
    for path in stale:
        print(f"note: {path} was left by an interrupted save (the next run into {root} removes it)")
    damaged = []
    for folder in folders:
        problems = verify_checkpoint(folder, advise=False)   # the advice fits the folder: below, once
        if problems:
            damaged.append(folder)
            for problem in problems:
                print(f"DAMAGED {folder}: {problem}", file=sys.stderr)
        else:
            print(f"ok {folder}")
    if damaged:
        raise CheckpointError(f"{len(damaged)} of {len(folders)} checkpoint folders in {root} are damaged "
                              f"(listed above): {_training_advice(root, folders, damaged)}")
    return 0


def _training_advice(root: Path, checked: list[Path], damaged: list[Path]) -> str:
    """What to do about damaged iter_ folders: go back to another one when the train.save folder
    has one; else write the checkpoint again (a weights-only one by the command that wrote it)."""
    save = root if (root / "latest").is_file() or not (root.parent / "latest").is_file() else root.parent
    whole = [p for p in checked if p not in damaged]
    others = [p for p in sorted(save.glob("iter_*")) if p.is_dir() and p not in checked]
    if whole:
        return f"resume from a whole one ({whole[-1].name}) by writing its name into {save}/latest."
    if others:
        return (f"resume from an older one by writing its name into {save}/latest (check it first: megatron-id "
                f"check-checkpoint {others[-1]}), or restore the damaged files from a copy.")
    if damaged[0].name == "iter_0000000":   # step 0: written by import-hf, convert or a run's step-0 save
        return (f"{save} holds no other checkpoint to go back to; a step-0 checkpoint is written by import-hf, "
                f"convert or a run's step-0 save: write it again with that command (import-hf and convert with "
                f"--overwrite), or restore the damaged files from a copy.")
    return f"{save} holds no other checkpoint to go back to: restore the damaged files from a copy."


def check_hf_folder(root: Path) -> int:
    """A folder with config.json: an export (checked against its manifest, every byte), or a
    transformers model's folder (which has no manifest: said so, with what reads it)."""
    from ..checkpoint.integrity import checkpoint_files, read_manifest
    from ..hf.llama import transformers_config  # torch: not at import (cli.py)
    again = "export the checkpoint again with megatron-id export-hf"
    try:
        manifest = read_manifest(root)
    except CheckpointError:
        raise CheckpointError(f"{root / MANIFEST} is damaged: the export {root} cannot be verified. "
                              f"{again.capitalize()} (or restore {MANIFEST} from a copy).") from None
    if manifest is None:
        pretrained = transformers_config(root)
        if pretrained is not None:
            named = ", ".join(map(str, pretrained.get("architectures") or [])) or pretrained.get("model_type") or \
                "no architecture named"
            raise CheckpointError(f"{root} is a transformers model's folder ({named}), not written by megatron-id: it "
                                  f"carries no {MANIFEST} to check its files against. megatron-id import-hf reads it "
                                  f"(and checks its safetensors files); to check a download, compare its files' "
                                  f"sha256 with those on the model's hub page.")
        raise CheckpointError(f"{root} is an export without {MANIFEST} (written before exports carried one): its "
                              f"files cannot be verified. Export the checkpoint again to get one.")
    problems = verify_checkpoint(root, advise=False)   # every byte; the advice for an export: below
    unlisted = set(checkpoint_files(root)) - set(manifest)
    if not problems:
        print(f"ok {root}")
        return 0
    for problem in problems:
        print(f"DAMAGED {root}: {problem}", file=sys.stderr)
    if len(unlisted) == len(problems):
        raise CheckpointError(f"the export {root} holds files export-hf did not write (listed above): move them out "
                              f"of it; its own files are whole.")
    raise CheckpointError(f"the export {root} is damaged (listed above): {again}, or restore the damaged files from "
                          f"a copy.")
