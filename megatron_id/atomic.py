"""Writing a file so that readers see the old content or the new, never half of it.

The bottom floor of the package: standard library only, imports nothing from megatron_id, so
every layer (checkpoints, data, the data tools, the command line) can use it without a cycle.

    write_atomic(path, lambda tmp: tmp.write_text(text))
    write_atomic_text(path, text)
    write_atomic_bytes(path, data)

The writer fills a temporary file in the same folder (same file system, so the final rename is
atomic), which then gets the permissions a plain new file would have and is renamed onto `path`.
Any failure (a writer that raises, a kill by KeyboardInterrupt/SystemExit) removes the temporary
file and leaves `path` as it was.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["write_atomic", "write_atomic_text", "write_atomic_bytes", "umask"]


def write_atomic(path: str | os.PathLike, write: Callable[[Path], object], *,
                 temp: str | os.PathLike | None = None, mode: int = 0o666) -> None:
    """Call `write(tmp)` to fill a temporary file beside `path`, then rename it onto `path`.

    `temp`: the temporary file's name, for the callers whose leftovers other code recognises by
    name (the data tools' `.<name>.tmp-<pid>`, removed by remove_stale_temps when that pid is
    dead); `write` creates it. Without it the name is a fresh mkstemp one, `.<name>.XXXXXXXX`,
    which two writers of the same path never share.
    `mode`: the permissions before the umask; 0o666 is what open() gives a new file (mkstemp's
    own 0o600 would make the result private, unlike the file it replaces). A writer whose output
    is executable (a compiler's) passes 0o777, as the compiler itself would have.
    """
    path = Path(path)
    if temp is None:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)   # the writer opens it by name, in whatever mode it needs
        tmp = Path(name)
    else:
        tmp = Path(temp)
    try:
        write(tmp)
        os.chmod(tmp, mode & ~umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic_text(path: str | os.PathLike, text: str, **options) -> None:
    """`path` holds `text` (Path.write_text's encoding and newlines), atomically."""
    write_atomic(path, lambda tmp: tmp.write_text(text), **options)


def write_atomic_bytes(path: str | os.PathLike, data: bytes, **options) -> None:
    """`path` holds `data`, atomically."""
    write_atomic(path, lambda tmp: tmp.write_bytes(data), **options)


def umask() -> int:
    """The process's umask. Read from /proc where Linux offers it: the portable way (set it to 0
    and back) leaves a window in which a file another thread creates (a training run writes from
    several) gets no umask at all."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask
