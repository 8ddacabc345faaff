"""The data path's compiled helper (csrc/blend_index.c), built on first use with the system's C
compiler and loaded with ctypes; numpy passes its buffers, nothing else is needed (no Python
headers, no torch, no ninja: a C file of 40 lines compiles in well under a second).

Built once per machine architecture and source text into MEGATRON_ID_BUILD_DIR (default:
TORCH_EXTENSIONS_DIR where set, as the decode kernel uses, else ~/.cache/megatron_id/build),
under a name that carries the source's hash, compiled to a temporary name and renamed into
place, so ranks or jobs that build at the same moment never load a half-written library.
Where it cannot be built (no compiler, a read-only folder) a warning says why and the caller
takes the pure-Python reference, which gives the same bytes, only slower
(sample_index.build_blending_index_reference). MEGATRON_ID_NO_NATIVE_DATA=1 forces that.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

from ..atomic import write_atomic

SOURCE = Path(__file__).resolve().parent / "csrc" / "blend_index.c"
# -ffp-contract=off: the blend's arithmetic must round as Python's does (no fused multiply-add)
FLAGS = ["-O3", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off"]


def build_dir() -> Path:
    root = os.environ.get("MEGATRON_ID_BUILD_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "megatron_id" / "build"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
    return build_dir() / f"megatron_id_data_{platform.machine()}_{digest}.so"


def _build(target: Path) -> None:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (looked for $CC, cc, gcc, clang)")
    target.parent.mkdir(parents=True, exist_ok=True)

    def compile_into(temporary: Path) -> None:
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(temporary)], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {(done.stderr or done.stdout).strip()[-500:]}")
    # 0o777: the permissions the compiler gives the library it links
    write_atomic(target, compile_into, mode=0o777)


@functools.lru_cache(maxsize=None)
def data_helpers() -> ctypes.CDLL | None:
    """The loaded helper library, built first if needed; None (with a warning saying why) where
    it cannot be built or MEGATRON_ID_NO_NATIVE_DATA is set."""
    if os.environ.get("MEGATRON_ID_NO_NATIVE_DATA"):
        return None
    try:
        path = library_path()
        if not path.is_file():
            _build(path)
        library = ctypes.CDLL(str(path))
        function = library.megatron_id_blend_index
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int32, ctypes.c_void_p]
        return library
    except Exception as e:   # no compiler, a read-only folder: the reference gives the same bytes
        warnings.warn(f"the data path's C helper could not be built ({type(e).__name__}: {e}); building "
                      f"blend indices in pure Python instead (same result, ~100x slower: minutes for a large "
                      f"blend). Needs a C compiler (cc/gcc, or set CC) and a writable {build_dir()} "
                      f"(or set MEGATRON_ID_BUILD_DIR).", stacklevel=2)
        return None
