"""The fused decode step's fixed-state core as one C++ call on a CPU (csrc/fixed_state_step.cpp),
built on first use with torch.utils.cpp_extension (a C++ compiler and ninja; ~10 s once, then
cached in TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default).

Why a kernel: at a short prefix a CPU decode step is bound by op overhead, not arithmetic: the
~40 small torch ops between a layer's two matrix products cost more than the products at 125M
width (benchmarks/decode_step.py). fused_decode.fixed_state_mixer's torch code is the reference
the kernel is tested against (tests/test_fused_decode.py, float64 to 1e-10), and the path taken
where the kernel cannot be built (a warning says why) or the tensors are not on a CPU.

Why a lock of our own: torch guards a build with a `lock` file in the build folder that it
creates and removes itself. A process killed inside the build (Ctrl-C of a long start, the OOM
killer, a job's time limit) leaves that file, and every later process waits on it forever,
printing nothing. So every process takes an flock on `<build folder>.lock` (beside it) before
torch's build: the kernel drops an flock when its holder dies, so a `lock` file found while we
hold ours was left by a dead process and is removed (said in one line). Another live builder is
waited for up to MEGATRON_ID_KERNEL_LOCK_TIMEOUT seconds (default 300), then this process
decodes with the torch ops and a warning says why.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from ..errors import BadOptionError

SOURCE = Path(__file__).resolve().parent / "csrc" / "fixed_state_step.cpp"
LOCK_TIMEOUT_ENV = "MEGATRON_ID_KERNEL_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 300.0   # seconds; a build takes ~10-30 s on a loaded 2-core machine
_IN_PROCESS = threading.Lock()   # two threads of one process build it once, one after the other


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]
    # AVX2 + FMA only where this CPU has them (ATen reports what it dispatches to); the
    # extension's name carries the choice, so a cache shared by different nodes never mixes them
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def module_name(flags: list[str]) -> str:
    return "megatron_id_fixed_state_step" + ("_avx2" if "-mavx2" in flags else "")


def build_folder(name: str) -> Path:
    """The folder torch.utils.cpp_extension builds `name` in (its own rule: TORCH_EXTENSIONS_DIR/name,
    else <its default root>/py<version>_<cpu|cuXY|rocmXY>/name). We name it to load() ourselves, so
    that the lock and the stale-file check look at the folder the build uses."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / name
    from torch.utils import cpp_extension
    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                   f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(cpp_extension.get_default_build_root()) / f"{python}_{accelerator}" / name


def lock_timeout() -> float:
    """MEGATRON_ID_KERNEL_LOCK_TIMEOUT: the seconds to wait for another process's build."""
    value = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_LOCK_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0 or seconds == float("inf"):
        raise BadOptionError(f"{LOCK_TIMEOUT_ENV}={value!r}: give the seconds to wait for another process building "
                             f"the CPU decode kernel, a number of at least 0 (default {DEFAULT_LOCK_TIMEOUT:g}), or "
                             f"unset it.")
    return seconds


@contextlib.contextmanager
def build_lock(folder: Path, timeout: float):
    """Hold an flock on `<folder>.lock` (yields True), waiting up to `timeout` seconds for another
    process holding it; yields False (with a warning) when it is still held then, and None where
    the file system has no flock (some network mounts): the stale-file check then waits instead."""
    import fcntl
    path = folder.with_name(folder.name + ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            holder = _read_holder(path)
            print(f"megatron-id: waiting for another process building the fused decode step's CPU kernel ({holder}; "
                  f"lock {path}), up to {timeout:g} s ({LOCK_TIMEOUT_ENV})", file=sys.stderr, flush=True)
            locked = _wait_for_flock(fd, timeout)
            if not locked:
                warnings.warn(f"waited {timeout:g} s for {path}, held by another process building the fused decode "
                              f"step's CPU kernel ({_read_holder(path)}): decoding with the torch ops instead "
                              f"(slower on a CPU at short prefixes). If that process is stuck, stop it; "
                              f"{LOCK_TIMEOUT_ENV} sets the wait.", stacklevel=4)
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            locked = None   # no flock on this file system
        if locked:   # who holds it, for the message of a process that waits
            os.ftruncate(fd, 0)
            os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%H:%M:%S')}\n"
                     .encode())
        yield locked
    finally:
        os.close(fd)   # (drops the flock; the file stays, to be reused)


def _read_holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "pid unknown"
    except OSError:
        return "pid unknown"


def _wait_for_flock(fd: int, timeout: float) -> bool:
    import fcntl
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def clear_stale_baton(folder: Path, flocked: bool, timeout: float) -> bool:
    """torch's own `lock` file in the build folder, which it waits on forever: removed when we
    hold the flock (every builder holds it first, so its holder is dead); without an flock,
    waited for up to `timeout` seconds. False (with a warning) when it is still there."""
    baton = folder / "lock"
    if not baton.exists():
        return True
    if flocked:
        baton.unlink(missing_ok=True)
        print(f"megatron-id: removed {baton}, left by a build of the CPU decode kernel that was killed (no process "
              f"holds the build lock)", file=sys.stderr, flush=True)
        return True
    deadline = time.monotonic() + timeout
    while baton.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if baton.exists():
        warnings.warn(f"{baton} is still there after {timeout:g} s (this file system has no flock to tell a live build "
                      f"from a killed one): decoding with the torch ops instead (slower on a CPU at short prefixes). "
                      f"If no process is building the kernel, remove that file.", stacklevel=3)
        return False
    return True


@functools.lru_cache(maxsize=None)
def fixed_state_step_kernel():
    """torch.ops.megatron_id.fixed_state_step, built (or loaded from the cache) once per process;
    None, with a warning saying why, where it cannot be built."""
    if os.environ.get("MEGATRON_ID_NO_CPU_KERNEL"):
        return None
    timeout = lock_timeout()
    folder = None
    try:
        from torch.utils import cpp_extension

        flags = _flags()
        name = module_name(flags)
        folder = build_folder(name)
        folder.mkdir(parents=True, exist_ok=True)
        with _IN_PROCESS, build_lock(folder, timeout) as held:
            if held is False or not clear_stale_baton(folder, held is True, timeout):
                return None
            library = folder / f"{name}.so"
            building = not library.is_file()
            if building:   # torch's build is silent for ~10 s
                print(f"megatron-id: building the fused decode step's CPU kernel (once, ~10 s; cached under "
                      f"{folder.parent})", file=sys.stderr, flush=True)
            start = time.monotonic()
            cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                               build_directory=str(folder), is_python_module=False, verbose=False)
            if building:
                print(f"megatron-id: built the CPU kernel in {time.monotonic() - start:.1f} s ({library})",
                      file=sys.stderr, flush=True)
        return torch.ops.megatron_id.fixed_state_step
    except Exception as e:   # no compiler, no ninja, a read-only cache: the torch path still works
        where = getattr(e, "filename", None)
        if folder is not None and where is not None and Path(where).is_relative_to(folder.parent):
            # (TORCH_EXTENSIONS_DIR a file, a read-only or full cache: not a missing compiler)
            fix = (f"Its cache folder {folder.parent} cannot be used: set TORCH_EXTENSIONS_DIR to a folder you can "
                   f"write.")
        else:
            fix = "Needs a C++ compiler and ninja (pip install ninja)."
        warnings.warn(f"the fused decode step's C++ kernel could not be built ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}); decoding with the "
                      f"torch ops instead (slower on a CPU at short prefixes). {fix}", stacklevel=2)
        return None
