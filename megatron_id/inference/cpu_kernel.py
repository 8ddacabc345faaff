"""The fused decode step's fixed-state core as one C++ call on a CPU (csrc/fixed_state_step.cpp),
built on first use with torch.utils.cpp_extension (a C++ compiler and ninja; ~10 s once, then
cached in TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default).

Why a kernel: at a short prefix a CPU decode step is bound by op overhead, not arithmetic: the
~40 small torch ops between a layer's two matrix products cost more than the products at 125M
width (benchmarks/decode_step.py). fused_decode.fixed_state_mixer's torch code is the reference
the kernel is tested against (tests/test_fused_decode.py, float64 to 1e-10), and the path taken
where the kernel cannot be built (a warning says why) or the tensors are not on a CPU.
"""
from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "fixed_state_step.cpp"


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]
    # AVX2 + FMA only where this CPU has them (ATen reports what it dispatches to); the
    # extension's name carries the choice, so a cache shared by different nodes never mixes them
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def module_name(flags: list[str]) -> str:
    return "megatron_id_fixed_state_step" + ("_avx2" if "-mavx2" in flags else "")


@functools.lru_cache(maxsize=None)
def fixed_state_step_kernel():
    """torch.ops.megatron_id.fixed_state_step, built (or loaded from the cache) once per process;
    None, with a warning saying why, where it cannot be built."""
    if os.environ.get("MEGATRON_ID_NO_CPU_KERNEL"):
        return None
    try:
        from torch.utils import cpp_extension

        flags = _flags()
        name = module_name(flags)
        # say so before the first build's silent ~10 s pause (torch keeps its builds in root/name,
        # or root/<python and CUDA version>/name under the default root)
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
        if not any(root.glob(f"{name}/{name}.so")) and not any(root.glob(f"*/{name}/{name}.so")):
            print(f"megatron-id: building the fused decode step's CPU kernel (once, ~10 s; cached under {root})",
                  file=sys.stderr, flush=True)
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
        return torch.ops.megatron_id.fixed_state_step
    except Exception as e:   # no compiler, no ninja, a read-only cache: the torch path still works
        warnings.warn(f"the fused decode step's C++ kernel could not be built ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}); decoding with the "
                      f"torch ops instead (slower on a CPU at short prefixes). Needs a C++ compiler and "
                      f"ninja (pip install ninja).", stacklevel=2)
        return None
