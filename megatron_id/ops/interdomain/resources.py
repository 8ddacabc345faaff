"""What the core's Triton kernels need on a GPU, found on any machine: no GPU is needed.

Triton's NVIDIA backend and its bundled ptxas run on a CPU, so every kernel variant a model
config reaches is compiled here for sm_80 (A100) and sm_90 (H100/H200) exactly as the GPU's
first launch would compile it (the same host code records its launches: triton_chunked.
planned_launches; the same specialisation of the arguments: Triton's own), and the compiled
kernel says what it needs:

    python -m megatron_id.ops.interdomain.resources --config configs/model/1p3b.yaml
    megatron-id kernel-resources --config configs/model/760m.yaml --arch sm_90 --precision bf16
    megatron-id kernel-resources --config configs/model/125m.yaml model.chunk_size=128   (what if)

One row per (kernel, shape, arch, dtypes, num_warps): shared memory against the arch's limit
per block, registers, spill stores/loads (bytes per thread, ptxas), whether the dots run on
tensor cores (wgmma: Hopper warp-group MMA; mma: Ampere MMA; fma: none) and the compile
seconds. A row fails on shared memory over the limit, on dots off the tensor cores, on spills
over SPILL_BOUND, or on a 32-bit offset (program ids and chunk counters must be int64 before
they meet a stride, and no kernel may use atomics: `offsets_ok`). The exit status is 1 when any
row fails. Compiled kernels are cached (Triton's cache, TRITON_CACHE_DIR; ptxas's figures in a
file beside it), so a second run costs seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...atomic import write_atomic_text
from ...config import load_config
from ...errors import OutputExistsError, UserError, run_guarded

# capability and the most dynamic shared memory one block may opt in to (CUDA's
# sharedMemPerBlockOptin: what Triton compares against at launch)
ARCHS = {"sm_80": (80, 166_912), "sm_90": (90, 232_448)}
# the training precisions a config reaches: input dtypes (q, k, v) as the mixer hands them to
# the core (bf16 autocast: q bf16 after the feature map, k and v float32 after their norms)
TRAININGS = {"bf16": dict(dtypes=(torch.bfloat16, torch.float32, torch.float32), autocast=True),
             "fp32": dict(dtypes=(torch.float32, torch.float32, torch.float32), autocast=False)}
# [our choice, from this module's table of every shipped config, triton 3.9: docs/gpu.md] bytes
# of spill stores per thread a kernel may have. The largest measured: 2,204 with tf32 dots (bf16
# training; _query_backward_dv, sm_80, 4 warps) and 8,000 with tf32x3 (fp32 training, the same
# kernel): the bounds leave room for a compiler update and fail a change that spills much more.
SPILL_BOUND = {"tf32": 3072, "tf32x3": 10240, "bf16": 3072, "ieee": 1 << 20}
SIDE_CACHE = "megatron_id_ptxas"   # ptxas's figures per compiled kernel (Triton keeps only the binary)


@dataclass
class Row:
    kernel: str
    shape: str
    arch: str
    training: str
    num_warps: int
    num_stages: int
    shared: int
    limit: int
    registers: int
    spill_stores: int
    spill_loads: int
    dots: str           # wgmma, mma, fma or none
    seconds: float
    offsets_ok: bool
    problems: str       # empty when the row passes

    @property
    def ok(self) -> bool:
        return not self.problems


def config_shape(model) -> tuple[int, int, int, int]:
    """(T, M, R, Dv) of the core a model config runs: head width from d_model / n_heads."""
    head = model.d_model // model.n_heads
    return model.chunk_size, model.state_size, head, head


def launches(T: int, M: int, R: int, Dv: int, training: str, H: int = 4) -> list[tuple]:
    """Every distinct kernel launch of one forward + backward at these sizes, for both readouts,
    as (name, Shape, args, constexprs)."""
    # triton_chunked imports triton, an optional extra: imported where a kernel is compiled, here and
    # below, so that this module (and `megatron-id kernel-resources --help`) loads without it
    from . import triton_chunked as K
    spec = TRAININGS[training]
    found = []
    for query in (True, False):
        dtypes = spec["dtypes"] if query else (None,) + spec["dtypes"][1:]
        prec = K.dot_precision([d for d in dtypes if d is not None], spec["autocast"])
        sh = K.kernel_shape(T, M, R, Dv, query, prec)
        for name, _grid, args, constexprs in K.planned_launches(sh, H, dtypes, "cpu"):
            found.append((name, sh, args, constexprs))
    return found


def compile_spec(name: str, args, constexprs) -> dict:
    """Triton's own specialisation of these launch arguments (what the JIT would compile):
    {"signature", "constexprs", "attrs"} for triton.compiler.ASTSource."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from . import triton_chunked as K
    fn = K.KERNELS[name][0]
    names = fn.arg_names
    signature, consts, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(names, args)):
        kind, spec = native_specialize_impl(BaseBackend, value, False, param not in fn.do_not_specialize, True)
        if kind == "constexpr":
            consts[param] = spec
            signature[param] = "constexpr"
            continue
        signature[param] = kind
        if isinstance(spec, str) and spec:
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    for param in names[len(args):]:
        signature[param] = "constexpr"
        consts[param] = constexprs[param]
    return dict(signature=signature, constexprs=consts, attrs=attrs)


def _key(name, spec) -> str:
    return json.dumps([name, spec["signature"], {k: str(v) for k, v in spec["constexprs"].items()},
                       {str(k): v for k, v in spec["attrs"].items()}], sort_keys=True)


def _figures_file(kernel_hash: str) -> Path:
    """ptxas's figures of one compiled kernel, a file each beside Triton's cache (the compiler
    processes write side by side: no shared file to lose an entry of)."""
    import triton
    folder = Path(triton.knobs.cache.dir) / SIDE_CACHE
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{kernel_hash}.json"


def _ptxas_figures(log: str) -> dict:
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(registers=int(regs[-1]) if regs else 0, spill_stores=int(spills[-1][0]) if spills else 0,
                spill_loads=int(spills[-1][1]) if spills else 0)


def offsets_problems(ttir: str) -> list[str]:
    """32-bit offsets in a kernel's TTIR: a program id used other than widened to int64, a loop
    with a runtime bound counting in int32 (its counter meets the chunk strides), an atomic."""
    problems = []
    for pid in re.findall(r"(%[\w.]+) = tt\.get_program_id \w+ : i32", ttir):
        uses = re.findall(rf"[^\n]*{re.escape(pid)}\b(?![\w.])[^\n]*", ttir.split(f"{pid} = tt.get_program_id", 1)[1])
        bad = [u.strip() for u in uses if not re.search(rf"arith\.extsi {re.escape(pid)} : i32 to i64", u)]
        if bad:
            problems.append(f"program id used as int32: {bad[0][:80]}")
    for line in re.findall(r"[^\n]*scf\.for [^\n]*", ttir):
        bounds = re.search(r"scf\.for %\S+ = (%\S+) to (%\S+) step (%\S+).*:\s*(i\d+)\s*\{", line)
        if bounds and bounds.group(4) == "i32":
            upper = bounds.group(2)
            constant = re.search(rf"{re.escape(upper)} = arith\.constant", ttir)
            if not constant:
                problems.append(f"int32 loop over a runtime bound: {line.strip()[:80]}")
    if "tt.atomic" in ttir:
        problems.append("atomics (nondeterministic sums)")
    return problems


def compile_one(name: str, spec: dict, arch: str, config: dict) -> dict:
    """Compile one kernel for `arch` with `config` (num_warps, num_stages): its figures."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import triton_chunked as K
    capability, limit = ARCHS[arch]
    src = ASTSource(fn=K.KERNELS[name][0], signature=spec["signature"], constexprs=spec["constexprs"],
                    attrs=spec["attrs"])
    triton.knobs.nvidia.dump_ptxas_log = True

    def build(always: bool):
        log = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(log), triton.knobs.compilation.scope():
            triton.knobs.compilation.always_compile = always
            # fp fusion (FMA) said explicitly, as Triton 3.9 enables it by default: without it every
            # compile warns that the default changes in 3.10 (two lines a kernel in kernel-resources)
            kernel = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                                    options=dict(config, enable_fp_fusion=True))
        return kernel, time.perf_counter() - start, _ptxas_figures(log.getvalue())

    kernel, seconds, figures = build(always=False)
    saved = _figures_file(kernel.metadata.hash)
    if not figures["registers"]:       # a cache hit: ptxas did not run
        if saved.exists():
            figures = json.loads(saved.read_text())
        else:                          # the binary cached without its figures: compile again
            kernel, seconds, figures = build(always=True)
    if not saved.exists():
        write_atomic_text(saved, json.dumps(figures))
    ttgir = kernel.asm["ttgir"]
    dots = "wgmma" if "warp_group_dot" in ttgir else "mma" if "nvidia_mma" in ttgir else \
        "fma" if "tt.dot" in ttgir else "none"
    return dict(shared=int(kernel.metadata.shared), limit=limit, seconds=round(seconds, 1), dots=dots,
                offsets=offsets_problems(kernel.asm["ttir"]), **figures)


def _compile_task(task):
    name, spec, arch, config = task
    return compile_one(name, spec, arch, config)


def check(shapes, archs=tuple(ARCHS), trainings=tuple(TRAININGS), jobs: int = 2, kernels=None) -> list[Row]:
    """Compile every kernel variant of these (T, M, R, Dv) shapes for every arch, training
    precision and autotuning config; one Row each. kernels: only these names."""
    from . import triton_chunked as K
    tasks, meta, index, listed = [], [], {}, set()
    for T, M, R, Dv in shapes:
        for training in trainings:
            for name, sh, args, constexprs in launches(T, M, R, Dv, training):
                if kernels and name not in kernels:
                    continue
                spec = compile_spec(name, args, constexprs)
                for arch in archs:
                    for config in K.CONFIGS:
                        key = (_key(name, spec), arch, json.dumps(config, sort_keys=True))
                        row_key = (name, K.describe(sh), arch, training, key)
                        if row_key in listed:
                            continue      # the same launch twice in one shape (k and v of equal width)
                        listed.add(row_key)
                        first = key not in index
                        if first:         # widths are runtime values: 760M runs 125M's compiled kernels
                            index[key] = len(tasks)
                            tasks.append((name, spec, arch, config))
                        meta.append((name, K.describe(sh), arch, training, config, sh.prec, index[key], first, row_key))
    if jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_compile_task, tasks))
    else:
        results = [_compile_task(t) for t in tasks]
    rows = []
    for name, shape, arch, training, config, prec, task, first, _ in meta:
        got = dict(results[task], seconds=results[task]["seconds"] if first else 0.0)
        limit = got["limit"]
        problems = []
        if got["shared"] > limit:
            problems.append(f"shared memory {got['shared']:,} B over the limit {limit:,} B")
        if got["dots"] == "fma" and prec != "ieee":   # "none": a kernel without dots (the walk back)
            problems.append(f"{prec} dots compiled to {got['dots']}, not tensor cores")
        if got["spill_stores"] > SPILL_BOUND[prec]:
            problems.append(f"spills {got['spill_stores']:,} B per thread (bound {SPILL_BOUND[prec]:,})")
        problems += got["offsets"]
        rows.append(Row(kernel=name, shape=shape, arch=arch, training=training, num_warps=config["num_warps"],
                        num_stages=config["num_stages"], shared=got["shared"], limit=limit,
                        registers=got["registers"], spill_stores=got["spill_stores"],
                        spill_loads=got["spill_loads"], dots=got["dots"], seconds=got["seconds"],
                        offsets_ok=not got["offsets"], problems="; ".join(problems)))
    return rows


def table(rows: list[Row]) -> str:
    head = ("kernel", "shape", "arch", "training", "warps", "shared / limit (B)", "regs", "spill st/ld (B)",
            "dots", "compile s (0: the same kernel as a row above)", "result")
    body = [(r.kernel, r.shape, r.arch, r.training, str(r.num_warps), f"{r.shared:,} / {r.limit:,}",
             str(r.registers), f"{r.spill_stores:,} / {r.spill_loads:,}", r.dots, f"{r.seconds:.1f}",
             "ok" if r.ok else "FAIL: " + r.problems) for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-id kernel-resources", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--config", action="append", default=[], metavar="YAML",
                   help="model config (repeat for several); default: every configs/model/*.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides for every --config, e.g. model.chunk_size=128 (what if)")
    p.add_argument("--arch", nargs="+", choices=sorted(ARCHS), default=sorted(ARCHS))
    p.add_argument("--precision", nargs="+", choices=sorted(TRAININGS), default=sorted(TRAININGS),
                   help="the training precision (train.precision) whose input dtypes to compile for")
    p.add_argument("--kernel", nargs="+", default=None, metavar="NAME",
                   help="only these kernels (names as in triton_chunked.KERNELS)")
    p.add_argument("--jobs", type=int, default=None, help="compiler processes (default: the cores, at most 4)")
    p.add_argument("--json", metavar="FILE", help="also write every row as JSON (a new file)")
    p.add_argument("--column-block", type=int, default=None, metavar="N",
                   help="what if: key and value columns in blocks of N (a power of two >= 16) instead of "
                        "triton_chunked.COLUMN_BLOCK")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.jobs is None:   # decided here, not in the parser, so that --help and the docs do not depend on the machine
        args.jobs = min(4, os.cpu_count() or 1)
    if args.jobs < 1:   # (0 once compiled in one process without a word)
        raise UserError(f"--jobs {args.jobs}: give at least 1 compiler process (default: the cores, at most 4)")
    from . import triton_chunked
    if triton_chunked.INTERPRET:
        raise UserError("kernel-resources compiles the kernels for a GPU, which Triton's interpreter does not: "
                        "run it without TRITON_INTERPRET=1")
    if args.json and Path(args.json).exists():
        raise OutputExistsError(f"--json {args.json} exists: give a new file name (it is never replaced)")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UserError(f"--json {args.json}: its folder {Path(args.json).resolve().parent} does not exist")
    if args.column_block is not None:
        if args.column_block < 16 or args.column_block & (args.column_block - 1):
            raise UserError(f"--column-block {args.column_block}: give a power of two >= 16 (tl.dot's smallest tile)")
        triton_chunked.COLUMN_BLOCK = args.column_block
    configs = args.config or sorted(
        str(f) for f in (Path(__file__).resolve().parents[3] / "configs" / "model").glob("*.yaml"))
    if not configs:
        raise UserError("no model config given and none found under configs/model: "
                        "pass --config configs/model/125m.yaml")
    shapes = []
    for path in configs:
        if not Path(path).is_file():
            raise UserError(f"--config {path}: no such file")
        shape = config_shape(load_config([path], args.overrides).model)
        if shape not in shapes:
            shapes.append(shape)
    if args.kernel:
        unknown = sorted(set(args.kernel) - set(triton_chunked.KERNELS))
        if unknown:
            raise UserError(f"--kernel {' '.join(unknown)}: no such kernel; the kernels are "
                            f"{', '.join(triton_chunked.KERNELS)}")
    print(f"compiling for {', '.join(args.arch)}: shapes (T, M, R, Dv) {shapes} from {len(configs)} config(s), "
          f"{', '.join(args.precision)} training, {args.jobs} process(es)", file=sys.stderr, flush=True)
    rows = check(shapes, tuple(args.arch), tuple(args.precision), jobs=args.jobs, kernels=args.kernel)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} of {len(rows)} kernel variants pass"
          + (f"; {len(failed)} FAIL" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_guarded("megatron-id kernel-resources", main))
