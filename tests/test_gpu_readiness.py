"""The GPU path holds before a GPU is lent (issue 25): every Triton kernel variant the shipped
configs reach is compiled here for sm_80 (A100) and sm_90 (H100/H200) by Triton's own NVIDIA
backend and ptxas, and checked (megatron_id/ops/interdomain/resources.py): shared memory under
the block's limit, dots on tensor cores, spills under the stated bound, 64-bit offsets and no
atomics; the check fails a kernel made to exceed the limit; launch/gpu_check.sh (the first GPU
run) passes its CPU dry run.

The compiles run in subprocesses without TRITON_INTERPRET (the rest of the suite runs the
kernels under the interpreter) and share one Triton cache for the session; the whole matrix
starts in the background at collection, at the lowest priority (tests/conftest.py).
"""
import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT

pytest.importorskip("triton")
RESOURCES = [sys.executable, "-m", "megatron_id.ops.interdomain.resources"]
KERNELS = {"walk_forward", "walk_backward", "carry_backward", "query_forward", "query_backward_dv",
           "query_backward_dq", "contraction_forward", "contraction_backward"}


@pytest.fixture(scope="session")
def compile_env(kernel_compile_env):
    return kernel_compile_env


def run(cmd, env, timeout=600, **kw):
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, **kw)


@pytest.fixture(scope="session")
def every_variant(compile_env, tmp_path_factory):
    """The table of every shipped config (configs/model/*.yaml), both archs, both trainings:
    compiled in the background since collection (tests/conftest.py), or here."""
    from conftest import compile_matrix
    started = compile_matrix(timeout=1200)
    if started is not None:
        code, stdout, stderr, rows = started
        return subprocess.CompletedProcess([], code, stdout, stderr), rows
    out = tmp_path_factory.mktemp("resources") / "rows.json"
    done = run([*RESOURCES, "--jobs", "2", "--json", out], compile_env, timeout=900)
    return done, json.loads(out.read_text()) if out.exists() else []


@pytest.mark.slow
def test_every_shipped_config_fits_a100_and_h100_on_tensor_cores(every_variant):
    done, rows = every_variant
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    failing = [r for r in rows if r["problems"]]
    assert not failing, failing
    # what the table covers: every kernel, both archs and trainings, every config's head shape
    # (tiny 16, 125M / 350M / 1.3B 64, 760M 96), both readouts, num_warps 4 and 8; packed
    # documents on and off are one compiled kernel (the starts are always an int8 tensor, zeros
    # without documents: no DOCS constexpr), so every row covers both
    assert {r["kernel"] for r in rows} == KERNELS
    assert {(r["arch"], r["training"], r["num_warps"]) for r in rows} == \
        {(a, t, w) for a in ("sm_80", "sm_90") for t in ("bf16", "fp32") for w in (4, 8)}
    shapes = {r["shape"].split(" (")[0] for r in rows}
    assert shapes == {"T=64 M=16 R=16 Dv=16", "T=64 M=64 R=64 Dv=64", "T=64 M=64 R=96 Dv=96"}, shapes
    assert {r["shape"].split("(")[1].split(",")[0] for r in rows} == {"query readout", "contraction readout"}
    for r in rows:
        assert r["shared"] <= r["limit"] and r["limit"] == {"sm_80": 166_912, "sm_90": 232_448}[r["arch"]]
        assert r["offsets_ok"]
        expected = "none" if r["kernel"] == "walk_backward" else "wgmma" if (
            r["arch"] == "sm_90" and not r["kernel"].startswith("walk")) else "mma"
        assert r["dots"] == expected, r   # Hopper's warp-group MMA for the per-chunk tiles
    assert "kernel variants pass" in done.stderr and "| query_backward_dv |" in done.stdout


def test_a_kernel_forced_over_the_limit_fails_the_check(compile_env):
    """The tile forced up (a 256-token chunk: S4D's [T, T] kernel tile alone is 256 KB)."""
    done = run([*RESOURCES, "--config", "configs/model/tiny.yaml", "model.chunk_size=256", "--arch", "sm_90",
                "--precision", "bf16", "--kernel", "contraction_forward"], compile_env)
    assert done.returncode == 1, done.stdout + done.stderr
    over = re.findall(r"FAIL: shared memory ([\d,]+) B over the limit 232,448 B", done.stdout)
    assert len(over) == 2 and all(int(b.replace(",", "")) > 232_448 for b in over), done.stdout
    assert "0 of 2 kernel variants pass; 2 FAIL" in done.stderr


BAD_KERNELS = '''
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_id.ops.interdomain.resources import offsets_problems

@triton.jit
def program_id_times_stride(x_ptr, stride):
    tl.store(x_ptr + tl.program_id(0) * stride, 1.0)

@triton.jit
def int32_chunk_loop(x_ptr, n, stride):
    for c in range(0, n):
        tl.store(x_ptr + c * stride, 1.0)

@triton.jit
def atomic_sum(x_ptr, stride):
    tl.atomic_add(x_ptr + tl.program_id(0).to(tl.int64) * stride, 1.0)

@triton.jit
def widened(x_ptr, n, stride):
    pid = tl.program_id(0).to(tl.int64)
    for c in range(0, n.to(tl.int64)):
        tl.store(x_ptr + (pid + c) * stride, 1.0)

for fn, sig in ((program_id_times_stride, {"x_ptr": "*fp32", "stride": "i32"}),
                (int32_chunk_loop, {"x_ptr": "*fp32", "n": "i32", "stride": "i32"}),
                (atomic_sum, {"x_ptr": "*fp32", "stride": "i32"}),
                (widened, {"x_ptr": "*fp32", "n": "i32", "stride": "i32"})):
    kernel = triton.compile(ASTSource(fn=fn, signature=sig), target=GPUTarget("cuda", 90, 32))
    print(fn.__name__, "|", "; ".join(offsets_problems(kernel.asm["ttir"])) or "ok")
'''


def test_the_offset_check_finds_int32_products_and_atomics(compile_env, tmp_path):
    """resources.offsets_problems reads the compiled TTIR: it flags a program id multiplied by a
    stride in int32, an int32 loop over a runtime bound and an atomic, and passes the widened form
    (every shipped kernel passes it: test_every_shipped_config_fits_a100_and_h100_on_tensor_cores)."""
    script = tmp_path / "bad_kernels.py"   # triton.jit reads a kernel's source from its file
    script.write_text(BAD_KERNELS)
    done = run([sys.executable, script], compile_env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = dict(line.split(" | ") for line in done.stdout.strip().splitlines())
    assert found["program_id_times_stride"].startswith("program id used as int32"), found
    assert found["int32_chunk_loop"].startswith("int32 loop over a runtime bound"), found
    assert found["atomic_sum"] == "atomics (nondeterministic sums)", found
    assert found["widened"] == "ok", found


def test_resources_refuses_careless_input(compile_env, tmp_path):
    mine = tmp_path / "rows.json"
    mine.write_text("my notes")
    cases = [(["--json", mine], f"--json {mine} exists: give a new file name"),
             (["--json", tmp_path / "no" / "rows.json"], "does not exist"),
             (["--config", "configs/model/nope.yaml"], "--config configs/model/nope.yaml: no such file"),
             (["--column-block", "48"], "--column-block 48: give a power of two >= 16"),
             (["--kernel", "query_fwd"], "--kernel query_fwd: no such kernel; the kernels are walk_forward")]
    for args, message in cases:
        done = run([*RESOURCES, *args], compile_env)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
    done = run([*RESOURCES, "--config", "configs/model/tiny.yaml"], {**compile_env, "TRITON_INTERPRET": "1"})
    assert done.returncode == 2 and "run it without TRITON_INTERPRET=1" in done.stderr, done.stderr[-2000:]
    assert mine.read_text() == "my notes"
    done = run(["bash", "launch/gpu_check.sh", "--dryrun", tmp_path / "check"], compile_env)   # a typo
    assert done.returncode == 2 and "unknown option --dryrun" in done.stderr, done.stderr
    assert not (tmp_path / "check").exists() and not (ROOT / "--dryrun").exists()


SMOKE_STEPS = ["preprocess", "train", "train-checkpoint", "resume", "resume-continues-at-step-5",
               "check-checkpoint", "export-hf", "generate", "hf-bf16-keeps-ssm-fp32"]


@pytest.mark.slow
def test_gpu_check_dry_run_passes_every_step(compile_env, gpu_check_dry_run):
    """launch/gpu_check.sh --dry-run: every step on the CPU (the kernel against the float64 form
    under the interpreter, gpu_smoke.sh in CPU mode with all its own steps and the check's
    model items (SMOKE_OVERRIDES), TP=2 + SP and CP=2 on two gloo processes against TP=1, the
    attention forms against the dense mask, the static decode step against
    the eager one, benchmarks/gpu.py --quick: its tables are tests/test_gpu_benchmark.py's);
    then it refuses to write into a used folder."""
    done, out = gpu_check_dry_run
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    for name in ("resources", "kernel", "smoke", "layouts", "attention", "decode", "benchmark"):
        assert f"PASS  {name} (" in done.stdout, (name, done.stdout[-4000:])
    assert done.stdout.strip().splitlines()[-1] == "gpu_check: PASS"
    assert "worst relative difference" in done.stdout and "bitwise" in done.stdout and "tokens equal" in done.stdout
    assert "documents + window" in done.stdout   # the attention step's figures
    smoke = (out / "smoke.log").read_text()
    for name in SMOKE_STEPS:   # gpu_smoke.sh's own steps (tests/test_gpu_smoke_script.py checks its refusals)
        assert f"PASS  {name} (" in smoke, (name, smoke[-3000:])
    assert (out / "smoke" / "checkpoints" / "latest").read_text() == "iter_0000006"
    # the items reached it
    assert json.loads((out / "smoke" / "hf" / "config.json").read_text())["model"]["state_size"] == 32
    again = run(["bash", "launch/gpu_check.sh", "--dry-run", out], compile_env, timeout=60)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
