"""benchmarks/gpu.py on the CPU: its TFLOP/s and MFU are the trainer's own (training/metrics.py)
for the same config and step time, `--device cpu --quick` prints both tables with measured
cells, a worker that dies in a cell costs that cell only, and without CUDA it exits 2."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu.py"
spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)


def cpu_env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)   # tests/conftest.py sets it: the interpreter takes minutes here
    return env


def trainer_mfu(monkeypatch, cfg, tokens_per_step: int, seconds: float) -> dict:
    """What Metrics.step logs for one step of `seconds` on one device."""
    from megatron_id.training import metrics
    from megatron_id.training.layout import Layout
    one_device = Layout(tensor=1, pipe=1, data=1, micro_batch_size=1, gradient_accumulation=1,
                        global_batch_size=1, tokens_per_step=tokens_per_step, train_iters=10)
    m = metrics.Metrics(cfg, one_device, is_logger=False)
    now = 1000.0
    monkeypatch.setattr(metrics, "time", SimpleNamespace(time=lambda: now))
    m.last = now - seconds
    return m.step(1, loss=1.0, lr=0.0, grad_norm=None, start_step=0)


@pytest.mark.parametrize("model", ["125m", "1p3b"])
def test_tflops_and_mfu_are_the_trainers(monkeypatch, model):
    cfg = gpu.train_config(model, "autograd", 4096, quick=False)
    tokens_per_step, seconds = 8 * 4096, 0.731
    logged = trainer_mfu(monkeypatch, cfg, tokens_per_step, seconds)
    ours = gpu.throughput(cfg.model, tokens_per_step / seconds, cfg.train.peak_tflops)
    assert ours["tflops"] == pytest.approx(logged["tflops_per_device"], rel=1e-12)
    assert ours["mfu"] == pytest.approx(logged["mfu"], rel=1e-12)
    assert cfg.train.peak_tflops == 989.0   # H100 SXM / H200 dense bf16, what the script prints
    # and not a 6 x parameters shortcut: the interdomain core's own FLOPs are in it
    from megatron_id.model.accounting import report
    assert ours["flops_per_token"] == report(cfg.model).training_flops_per_token
    assert ours["flops_per_token"] != 6 * report(cfg.model).parameters


@pytest.mark.slow
def test_quick_cpu_run_prints_both_tables_with_measured_cells(gpu_check_dry_run, monkeypatch):
    """`benchmarks/gpu.py --device cpu --quick --json`, as launch/gpu_check.sh's dry run ran it."""
    check, folder = gpu_check_dry_run
    assert "PASS  benchmark (" in check.stdout, check.stdout[-3000:] + check.stderr[-2000:]
    out = folder / "gpu.json"
    text = (folder / "benchmark.log").read_text()
    assert "## (a) interdomain core" in text and "## (b) training throughput" in text
    assert "peak of 989 TFLOP/s" in text
    number = re.compile(r"^\d[\d,]*(\.\d+)? (ms|s)$")
    core_rows = [ln for ln in text.splitlines() if re.match(r"\| (128|256) \|", ln)]
    assert len(core_rows) == 2, text
    for line in core_rows:   # N | triton | autograd | recompute | sdpa | ratios
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert all(number.match(c) for c in cells[2:5]), line
        assert number.match(cells[1]) or cells[1].startswith("unavailable"), line

    res = json.loads(out.read_text())
    assert [r["N"] for r in res["core"]] == [128, 256]
    for row in res["core"]:
        for col in ("autograd", "recompute", "sdpa"):
            assert row[col]["ok"] and row[col]["time"] > 0, (col, row)
    measured = [r for r in res["train"] if r["core_impl"] in ("autograd", "recompute")]
    assert {(r["model"], r["core_impl"]) for r in measured} == \
        {(m, i) for m in ("125m", "1p3b") for i in ("autograd", "recompute")}
    for r in measured:
        assert r["ok"] and r["tokens_per_s"] > 0, r
        assert r["tokens_per_step"] == r["micro_batch"] * r["context"]
        cfg = gpu.train_config(r["model"], r["core_impl"], r["context"], quick=True)
        logged = trainer_mfu(monkeypatch, cfg, r["tokens_per_step"], r["time"])
        assert r["mfu"] == pytest.approx(logged["mfu"], rel=1e-9), r
        assert r["tokens_per_s"] == pytest.approx(logged["tokens_per_s"], rel=1e-9)
    for r in res["train"]:
        assert r["ok"] or r["reason"].startswith("unavailable"), r
    seconds = int(re.search(r"PASS  benchmark \((\d+) s\)", check.stdout).group(1))
    assert seconds < 120, seconds   # a dry run, not a benchmark


@pytest.mark.slow
def test_a_worker_dying_in_a_cell_loses_that_cell_only(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cells = [{"key": "dies", "part": "exit", "status": 7},
             {"key": "core/sdpa/64", "part": "core", "column": "sdpa", "N": 64, "batch": 1, "reps": 1}]
    res = gpu.run_cells(cells, "cpu", time.time() + 120)
    assert res["dies"] == {"ok": False, "reason": res["dies"]["reason"]}
    assert res["dies"]["reason"].startswith("worker died (exit 7)")
    assert res["core/sdpa/64"]["ok"] and res["core/sdpa/64"]["time"] > 0
    late = gpu.run_cells(cells[1:], "cpu", time.time() - 1)
    assert late["core/sdpa/64"] == {"ok": False, "reason": "skipped (time budget)"}


def test_without_cuda_it_exits_2():
    env = {**cpu_env(), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device is visible" in done.stderr and "--device cpu --quick" in done.stderr
    assert "## (a)" not in done.stdout
