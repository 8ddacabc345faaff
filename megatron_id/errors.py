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
        status, message, everywhere = 2, str(err), err.same_on_every_rank
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
