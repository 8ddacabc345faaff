"""The one assertion of the bad-input battery (issue 10): a careless command is refused loudly
and harmlessly.

    refused(["megatron_id.cli", "export-hf", "--checkpoint", ck, "--output", out],
            mention=r"already exists", unchanged=[tmp_path])

runs `python -m <module> <args>` as a user would (a subprocess, no stdin) and asserts:
  - a non-zero exit status;
  - the last line of stderr matches `mention` and no traceback was printed;
  - every file under each `unchanged` folder has the same bytes afterwards, and no file or
    folder was added or removed there (nothing partial left behind, no good output replaced).
Returns the CompletedProcess for further checks.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# A training run's lock on its train.save folder: bookkeeping (holder, pid), not output. A run
# that is refused after taking it rewrites its content; it never appears where it was not.
BOOKKEEPING = {".lock"}


def snapshot(folder) -> dict[str, bytes | None]:
    """Every path under `folder` (relative) -> its bytes (None for folders)."""
    folder = Path(folder)
    if not folder.exists():
        return {}
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.name in BOOKKEEPING and path.parent.exists() and (path.parent / "latest").exists():
            continue
        out[key] = path.read_bytes() if path.is_file() and not path.is_symlink() else None
    return out


def _differences(before: dict, after: dict) -> list[str]:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return [f"added {k}" for k in added] + [f"removed {k}" for k in removed] + \
        [f"changed {k}" for k in changed]


def run_module(module: str, args, env=None, timeout: float = 300, cwd=None):
    environment = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": str(ROOT), **(env or {})}
    environment.pop("MEGATRON_ID_DEBUG", None)
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], env=environment,
                          capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
                          stdin=subprocess.DEVNULL)


def refused(command, *, mention: str, unchanged=(), env=None, timeout: float = 300, cwd=None):
    module, *args = command
    folders = [Path(f) for f in unchanged]
    before = [snapshot(f) for f in folders]
    done = run_module(module, args, env=env, timeout=timeout, cwd=cwd)
    shown = f"command: {command}\nexit {done.returncode}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode != 0, "exit status 0 for a bad input\n" + shown
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert lines, "nothing on stderr\n" + shown
    assert "Traceback (most recent call last)" not in done.stderr, "a traceback was printed\n" + shown
    assert re.search(mention, lines[-1]), f"last line does not match {mention!r}\n" + shown
    for folder, old in zip(folders, before):
        diff = _differences(old, snapshot(folder))
        assert not diff, f"{folder} changed: {diff[:10]}\n" + shown
    return done
