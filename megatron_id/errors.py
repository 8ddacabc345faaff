"""The one base class of the problems a user can fix.

A `UserError` is an expected failure caused by the input, the config, the files on disk or the
environment (a missing file, a bad value, a damaged checkpoint, a folder that would be
overwritten). `megatron-id` prints its message as one line, `megatron-id: error: ...`, and exits
with status 2 (an OSError such as a full disk: one line, status 1); no traceback (add
`--debug` or MEGATRON_ID_DEBUG=1 to see one). Its message must
name the file or key, the value and the fix. Anything else that escapes is a bug and keeps its
traceback.

Subclasses keep ValueError as a second base where they were ValueErrors before, so existing
`except ValueError` code keeps working.
"""
from __future__ import annotations

import errno
import os
import sys
import traceback


class UserError(Exception):
    """A problem the user can fix; the message says what, where and how."""

    #: True when every rank of a distributed run finds the same problem (config, layout, data
    #: checks): then only rank 0 prints it. A problem of one rank (its disk, its files) is
    #: printed by that rank, with its rank number.
    same_on_every_rank = False


class OutputExistsError(UserError, FileExistsError):
    """An output target exists and is not ours to replace (or --overwrite was not given)."""


class BadOptionError(UserError, ValueError):
    """An option value that cannot work: the option, the value and the valid range."""


def refuse_output_inside(output, folder, what: str, example: str) -> None:
    """An output equal to or inside the folder it is made from would mix into it (and an
    overwrite could delete it)."""
    if output == folder or output.is_relative_to(folder):
        raise OutputExistsError(f"--output {output} is {what} ({folder}) or inside it: nothing was written. "
                                f"Choose a folder outside it, e.g. {folder.parent / example}.")


class DiskFullError(UserError, OSError):
    """A write that did not fit: the message says "no space left on device", the folder, the
    bytes needed and what was removed. An OSError in kind: exit status 1, as other OSErrors."""
    exit_status = 1


def human_bytes(n: float, exact: bool = True) -> str:
    """1234567 -> '1,234,567 bytes (1.2 MiB)'; with exact=False, '1.2 MiB'."""
    units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"]
    value, unit = float(n), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    if not exact:
        return f"{value:.1f} {units[unit]}" if unit else f"{int(n):,} bytes"
    return f"{int(n):,} bytes" + (f" ({value:.1f} {units[unit]})" if unit else "")


def free_bytes(folder) -> int | None:
    """Free bytes for this user on the file system holding `folder` (or its nearest existing
    parent); None when it cannot be asked."""
    import shutil
    from pathlib import Path
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def is_disk_full(err: BaseException) -> bool:
    """A write that failed for want of space: ENOSPC / EDQUOT, or what torch.save
    ("[enforce fail at inline_container.cc] . unexpected pos" / "file write failed") and
    safetensors ("No space left on device (os error 28)") raise instead of an OSError."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err)
        if ("No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text
                or ("inline_container" in text and ("unexpected pos" in text or "file write failed" in text))):
            return True
        err = err.__cause__ or err.__context__
    return False


def disk_full_error(what: str, folder, needed: int | None, removed: str = "", fix: str = "",
                    show_free: bool = True) -> DiskFullError:
    """The one line for a write that did not fit: what, where, the bytes needed and free now
    (`show_free`: not after a failed write, whose open file may still hold the space)."""
    free = free_bytes(folder) if show_free else None
    need = f"it needs about {human_bytes(needed)}" if needed else "its size is unknown"
    have = f", {human_bytes(free)} free there" if free is not None else ""
    removed = f" {removed}" if removed else ""
    fix = fix or "Free space there or write elsewhere."
    return DiskFullError(f"no space left on device writing {what} into {folder}: {need}{have}.{removed} {fix}")


def check_writable(folder, option: str) -> None:
    """Refuse, before any work, an output folder (or, for a folder still to be made, its nearest
    existing parent) that this process cannot create files in: a read-only file system, missing
    permissions. Tried for real (a file created and removed): as root, permission bits say
    nothing, and a read-only mount is only found by writing."""
    import tempfile
    from pathlib import Path
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        if path == Path(folder).absolute():
            return   # the output itself is a file: the caller's own checks name it (exists, not a folder)
        raise BadOptionError(f"{option} {folder}: {path} is a file, not a folder: nothing was done. Choose a path "
                             f"in a folder.")
    try:
        fd, probe = tempfile.mkstemp(prefix=".megatron-id-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        hint = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                errno.EPERM: "permission denied", errno.ENOSPC: "no space left on device",
                errno.EDQUOT: "disk quota exceeded"}.get(err.errno, err.strerror or str(err))
        where = "" if path == Path(folder).absolute() else f" (its folder {path})"
        raise BadOptionError(f"{option} {folder}: cannot write there{where}: {hint}. Nothing was done: choose a "
                             f"folder you can write to.") from None


def _rank() -> tuple[int, int]:
    env = os.environ
    rank = env.get("RANK", env.get("SLURM_PROCID", "0"))
    world = env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))
    return int(rank), int(world)


def describe_os_error(err: OSError) -> str:
    """An OSError as one line with the file: 'No space left on device: /data/x.bin'."""
    where = err.filename if err.filename is not None else ""
    if err.filename2 is not None:
        where = f"{where} -> {err.filename2}"
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT) and err.filename is not None:
        free = free_bytes(os.path.dirname(os.path.abspath(err.filename)))
        if free is not None:
            where = f"{where} ({human_bytes(free, exact=False)} free there)"
    hints = {errno.ENOSPC: " Free space there or write elsewhere.",
             errno.EACCES: " Check the permissions, or choose a folder you can write to.",
             errno.EROFS: " The file system is read-only: choose another folder.",
             errno.EDQUOT: " Disk quota exceeded: free space or write elsewhere."}
    return f"{reason}: {where}.{hints.get(err.errno, '')}" if where else f"{reason}.{hints.get(err.errno, '')}"


def run_guarded(prog: str, body, debug: bool = False) -> int:
    """Run `body()` (returning an exit status) and turn expected failures into one line on
    stderr and a non-zero status: UserError 2, OSError (disk full, permissions) 1. Under a
    distributed launch a problem every rank finds is printed by rank 0 only."""
    debug = debug or os.environ.get("MEGATRON_ID_DEBUG", "") not in ("", "0")
    try:
        return body()
    except BrokenPipeError:
        # the reader of our output went away (`... | head`): what it wanted was printed; no
        # error line, and stdout is pointed at /dev/null so the exit does not fail on a flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except UserError as err:
        status, message, everywhere = getattr(err, "exit_status", 2), str(err), err.same_on_every_rank
    except OSError as err:
        status, message, everywhere = 1, describe_os_error(err), False
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    rank, world = _rank()
    if debug:
        traceback.print_exc()
    if rank == 0 or not everywhere:
        where = f"rank {rank}: " if world > 1 and not everywhere else ""
        # one line: the message itself may span lines; the last line is what users read first
        text = " ".join(part.strip() for part in message.splitlines() if part.strip())
        print(f"{prog}: error: {where}{text}", file=sys.stderr, flush=True)
    return status
