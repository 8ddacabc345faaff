"""Small real file systems for the tests of full disks and read-only folders (issue 41).

    with small_file_system(tmp_path / "disk", "2m") as real:   # a 2 MiB tmpfs where root may mount
        ...                                                      # real False: a plain folder (fake it)
    with read_only_folder(tmp_path / "ro") as real:             # writes there fail (EROFS / EACCES)

As root, permission bits do not stop writes and only a read-only mount does; mounting needs
CAP_SYS_ADMIN (a root shell, a privileged container). Where neither a mount nor permission bits
can make a folder refuse writes, `real` is False and the caller fakes the failure in-process
(or skips). Every mount is unmounted on exit.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path


def _mount(folder: Path, options: str) -> bool:
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    return done.returncode == 0


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@contextlib.contextmanager
def small_file_system(folder, size: str = "2m"):
    """`folder` on a tmpfs of `size` (True), or a plain folder where mounting is not allowed (False)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mounted = _mount(folder, f"size={size},mode=0755")
    try:
        yield mounted
    finally:
        if mounted:
            _unmount(folder)


@contextlib.contextmanager
def read_only_folder(folder):
    """`folder`, existing and refusing writes (True): a read-only tmpfs as root, else mode 0555;
    False where neither works (root without the right to mount)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield True
        finally:
            folder.chmod(0o755)
        return
    mounted = _mount(folder, "ro,size=64k")
    try:
        yield mounted
    finally:
        if mounted:
            _unmount(folder)
