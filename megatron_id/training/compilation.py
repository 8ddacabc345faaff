"""train.compile: the model under torch.compile (inductor), and what is checked before it.

The trainer compiles its module in place through DeepSpeed's `engine.compile()`, which calls
`module.compile()` (a PipelineModule compiles each piece of its stage the same way). Never the
OptimizedModule wrapper that `torch.compile(module)` returns: that one prefixes every parameter
name with `_orig_mod.`, so a checkpoint written with compile on would not load with it off.
In place, names, checkpoints and the DeepSpeed engine around the module stay as they are.
Compilation happens at the first forward: once for training, once more for evaluation's
no-grad forward; the loss (vocab-parallel cross entropy) and the optimizer stay eager.

What cannot compile is refused before any work, naming the key and the fix:
  - `check_compile_config` (from training_layout, so job-prepare and the planner see it too):
    the recomputing backward of the interdomain / S4D core (model.core_impl=recompute, and auto
    from RECOMPUTE_FROM_TOKENS tokens per sequence). Its autograd.Function (ops/segments.py)
    stops dynamo (a graph break: an autograd.Function context method dynamo does not support),
    dynamo then compiles every segment's step by itself, with the segment bounds as dynamic
    sizes after the first recompilations, and inductor (torch 2.13) fails on that graph
    ("ValueRangeError: Invalid ranges [0:-1]").
  - `check_compile_toolchain` (rank 0's preflight, with the data and folder checks): inductor
    builds CPU kernels with a C++ compiler and CUDA kernels with triton.
ZeRO-3 compiles and trains with eager's losses, but its parameter hooks break the graph at every
layer (DeepSpeed's code, not ours): a note says so at start. The rest compiles to one graph
per module with eager's losses (tests/test_compile.py; and measured once each, 3 fp32 steps of
the tiny model, losses and gradient norms equal to 6 digits: TP=2, TP=2 with sequence
parallelism, PP=2, PP=2 with activation checkpointing, DP=2 at ZeRO-2 and 3, activation
checkpointing, each mixer; bf16 autocast within 3e-6 of eager's loss, as inductor keeps bf16
intermediates of a fused kernel in float32). Not measured here: CUDA, and the Triton core.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import torch.distributed as dist

from ..config import Config, ConfigError
from ..errors import UserError
from ..model.pattern import layer_letters
from ..ops.interdomain.chunked import RECOMPUTE_FROM_TOKENS


class CompileToolchainError(UserError):
    """train.compile=true where inductor cannot build kernels (no C++ compiler, no triton)."""


def check_compile_config(cfg: Config) -> None:
    """Raise ConfigError for a train.compile=true run that cannot compile (see module docstring)."""
    if cfg.train.compile and cfg.parallel.context_parallel_size > 1:
        raise ConfigError(
            "train.compile=true with parallel.context_parallel_size > 1 is not supported yet: the "
            "blocks exchange states through collectives inside autograd functions, which have not "
            "been compiled and tested. Set train.compile=false or parallel.context_parallel_size=1.")
    if not cfg.train.compile or not set(layer_letters(cfg.model)) & set("IS"):   # softmax has no SSM core
        return
    impl, n = cfg.model.core_impl.value, cfg.model.seq_length
    if impl == "recompute" or (impl == "auto" and n >= RECOMPUTE_FROM_TOKENS):
        why = ("model.core_impl=recompute" if impl == "recompute" else
               f"model.core_impl=auto at model.seq_length={n} (auto recomputes from {RECOMPUTE_FROM_TOKENS} "
               f"tokens per sequence)")
        raise ConfigError(
            f"train.compile=true cannot be combined with {why}: torch.compile cannot trace the "
            f"recomputing backward of the interdomain / S4D core (ops/segments.py) and inductor "
            f"fails on the graphs it makes of it instead. Set model.core_impl=autograd (every "
            f"intra-chunk tensor kept: more activation memory at long context), or train.compile=false.")


def check_compile_toolchain(device_type: str, environ=None) -> None:
    """What inductor needs to build kernels on `device_type` ('cpu' or 'cuda'), or
    CompileToolchainError naming it and the fix. A failure here would otherwise surface at
    the first training step, after the data and the model were set up."""
    environ = os.environ if environ is None else environ
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise CompileToolchainError(
                "train.compile=true on CUDA needs triton (inductor writes its GPU kernels in it), "
                "and it is not installed. Install the triton that matches your torch build "
                "(pip install triton; torch's CUDA wheels bring it), or set train.compile=false.")
        return
    cxx = environ.get("CXX") or "g++"   # inductor's own choice (torch._inductor.config.cpp.cxx)
    if shutil.which(cxx) is None:
        source = "the CXX environment variable" if environ.get("CXX") else "inductor's default"
        raise CompileToolchainError(
            f"train.compile=true on CPU needs a C++ compiler (inductor builds its CPU kernels with "
            f"it), and '{cxx}' ({source}) is not on PATH. Install one (e.g. apt-get install g++), "
            f"point CXX at one, or set train.compile=false.")


def compile_engine(engine, cfg: Config) -> None:
    """Compile the engine's module in place (the module docstring says why in place)."""
    if cfg.train.zero_stage == 3 and dist.get_rank() == 0:
        print("train.compile=true with train.zero_stage=3: DeepSpeed gathers ZeRO-3's partitioned "
              "parameters in module hooks that torch.compile does not trace, so the graph breaks at "
              "every layer (26 graphs for the tiny model instead of 1) and little is fused. Losses "
              "are those of eager; measure the speed before relying on it.", file=sys.stderr, flush=True)
    engine.compile()
