"""`megatron-id check-checkpoint`: verify checkpoint folders against their manifests, offline."""
from __future__ import annotations

import sys
from pathlib import Path

from ..checkpoint.integrity import MANIFEST, CheckpointError, verify_checkpoint


def add_parser(sub) -> None:
    c = sub.add_parser("check-checkpoint", help="verify checkpoint files against their manifest (sizes, sha256)",
                       allow_abbrev=False)
    c.add_argument("path", help="train.save folder (checks the one `latest` names) or an iter_XXXXXXX folder")
    c.add_argument("--all", action="store_true", help="check every iter_ folder of a train.save folder")
    c.set_defaults(func=run)


def run(args) -> int:
    """Verify checkpoint folders against their manifests offline: the one `latest` names (or
    every iter_ folder with --all, or the iter_ folder given). Exit 0 only when all are whole."""
    from ..checkpoint.files import CLIENT_STATE, STAGING, latest_folder  # torch: not at import (cli.py)
    root = Path(args.path)
    if not root.exists():
        raise CheckpointError(f"{root} does not exist: give a train.save folder or an iter_XXXXXXX folder.")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a folder: give a train.save folder or an iter_XXXXXXX folder.")
    if (root / MANIFEST).is_file() or (root / CLIENT_STATE).is_file():
        folders = [root]
    elif args.all:
        folders = sorted(p for p in root.glob("iter_*") if p.is_dir())
    else:
        folders = [f for f in [latest_folder(root)] if f is not None]
    if not folders and (root / "config.json").is_file():
        raise CheckpointError(f"{root} is an export without {MANIFEST} (written before exports carried one): its "
                              f"files cannot be verified. Export the checkpoint again to get one.")
    if not folders:
        raise CheckpointError(f"{root} holds no checkpoint (no `latest`, no iter_ folder): give a train.save "
                              f"folder or an iter_XXXXXXX folder.")
    stale = sorted((root / STAGING).glob("iter_*"))
    for path in stale:
        print(f"note: {path} was left by an interrupted save (the next run into {root} removes it)")
    damaged = 0
    for folder in folders:
        problems = verify_checkpoint(folder)
        if problems:
            damaged += 1
            for problem in problems:
                print(f"DAMAGED {folder}: {problem}", file=sys.stderr)
        else:
            print(f"ok {folder}")
    if damaged and (root / "config.json").is_file():   # an export (it carries the same manifest)
        raise CheckpointError(f"the export {root} is damaged (listed above): export the checkpoint again with "
                              f"megatron-id export-hf.")
    if damaged:
        raise CheckpointError(f"{damaged} of {len(folders)} checkpoint folders in {root} are damaged "
                              f"(listed above): resume from a whole one by writing its name into {root}/latest.")
    return 0
