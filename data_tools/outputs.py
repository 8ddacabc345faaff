"""Rules every data tool follows for its outputs (issue 10: no ordinary mistake loses data).

- Before any work: the output's folder must be a folder (or not exist yet), and an existing
  output file is replaced only with --overwrite (OutputExistsError names the files and the fix).
- Outputs are written under temporary names `.<name>.tmp-<pid>` beside their final names and
  renamed when complete, so a failed run leaves the old files as they were.
- Temporary files of runs that were killed (their pid is gone) are removed at the next start
  for the same output, and reported; those of live runs are left alone.
- Folders a failed run created are removed again when they are still empty.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from megatron_id.errors import OutputExistsError, UserError


class OutputError(UserError, ValueError):
    pass


def existing_ancestor(path: Path) -> Path:
    """`path` or its nearest ancestor that exists."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_prefix(given, flag: str, name: str, written: str) -> None:
    """An output prefix is a path and the start of file names (Megatron's --output-prefix), never
    a folder: `dir/` once wrote `dir/_text_document.bin` (preprocess) and a hidden `dir/.bin`
    (merge). Refused before any work, with the prefix the user most likely meant: `dir/<name>`,
    which writes `written` (with `{}` standing for that prefix)."""
    text = str(given)
    last = text.replace(os.sep, "/").rstrip("/").rsplit("/", 1)[-1] if text.rstrip("/") else ""
    if text.endswith(("/", os.sep)) or last in ("", ".", ".."):
        folder = text if text.endswith(("/", os.sep)) else (text + "/" if text else "")
        meant = f"{folder}{name}"
        what = "is empty" if not text else "names a folder, not a prefix"
        raise OutputError(f"{flag} {text!r} {what}: the prefix is a path plus the start of "
                          f"the output files' names (as in Megatron), e.g. {flag} {meant} writes "
                          f"{written.format(meant)}.")
    if text.endswith((".bin", ".idx")):   # (merged.bin once wrote merged.bin.bin)
        meant = text[:-4]
        raise OutputError(f"{flag} {text!r} ends in {text[-4:]}: the prefix has no extension; e.g. {flag} {meant} "
                          f"writes {written.format(meant)}.")


def check_outputs(targets, flag: str, given, overwrite: bool) -> None:
    """Refuse, before any work, outputs that cannot be written or would replace existing files.
    `targets`: the final files that count as existing output; `flag`/`given`: how the user
    named the output, for the message."""
    targets = [Path(t) for t in targets]
    folder = targets[0].parent
    found = existing_ancestor(folder)
    if not found.is_dir():
        raise OutputError(f"{flag} {given}: {found} is a file, not a folder; choose an output "
                          f"inside a folder.")
    if found == folder and not os.access(folder, os.W_OK):
        raise OutputError(f"cannot write to the output folder {folder}: check its permissions or "
                          f"choose another {flag}.")
    folders = [str(t) for t in targets if t.is_dir()]
    if folders:
        raise OutputError(f"{flag} {given}: {folders[0]} is a folder; name a file to write.")
    existing = [str(t) for t in targets if t.exists()]
    if existing and not overwrite:
        one = len(existing) == 1
        raise OutputExistsError(
            f"{', '.join(existing)} already exist{'s' if one else ''}: pass --overwrite to replace "
            f"{'it' if one else 'them'} (the old {'file stays' if one else 'files stay'} until the "
            f"new output is complete), or choose another {flag}.")


def make_folder(folder: Path) -> list[Path]:
    """mkdir -p that returns the folders it created, innermost first (see remove_folders)."""
    missing = []
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    Path(folder).mkdir(parents=True, exist_ok=True)
    return missing


def remove_folders(created) -> None:
    """Undo make_folder after a failure: remove the folders it created while they are empty."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            break


def report_stale(prog: str, removed) -> None:
    if removed:
        names = ", ".join(p.name for p in removed[:3]) + (", ..." if len(removed) > 3 else "")
        print(f"{prog}: removed {len(removed)} stale temporary file{'s' if len(removed) > 1 else ''} "
              f"left by killed runs ({names})", file=sys.stderr, flush=True)
