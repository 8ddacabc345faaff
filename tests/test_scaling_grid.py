"""launch/scaling/grid.py: the paper's grid expands to every cell of paper-results.md, each cell's
numbers are the recipe's (section 6 of the spec) as the engine computes them, every emitted
override loads through load_config, every layout fits, and submission chains jobs with
afterany dependencies. Submission runs against a fake sbatch that records its arguments."""
import contextlib
import importlib.util
import io
import json
import math
import os
import shlex
import subprocess
import sys

import pytest
from conftest import ROOT

from megatron_id.cli import build_parser
from megatron_id.config import load_config
from megatron_id.training.layout import training_layout
from megatron_id.training.optim import learning_rate

GRID = ROOT / "launch" / "scaling" / "grid.py"
TOKENS_PER_STEP = 128 * 4096          # the recipe's global batch: 128 sequences of 4,096
WARMUP_TOKENS = 375_000_000

# paper-results.md: 4 scales x 3 mixers, and the 125M mechanism cube (its label -> our cell)
MAIN_CELLS = [f"{scale}-{mixer}" for scale in ("125m", "350m", "760m", "1p3b")
              for mixer in ("interdomain", "softmax", "s4d")]
CUBE = {"full interdomain": "125m-interdomain", "without RoPE": "125m-cube-no-rope",
        "softmax": "125m-softmax", "single input + query readout": "125m-cube-single-input",
        "S4D-only": "125m-s4d", "S4D-only + RoPE": "125m-cube-s4d-rope",
        "dual input + linear readout": "125m-cube-linear-readout"}
# the switches each cube cell must resolve to (interdomain-attention.md section 4), and the
# parameter counts of section 5 (RoPE has no parameters)
SWITCHES = {"125m-interdomain": (True, True, True), "125m-cube-no-rope": (True, True, False),
            "125m-cube-single-input": (True, False, True), "125m-s4d": (False, False, False),
            "125m-cube-s4d-rope": (False, False, True), "125m-cube-linear-readout": (False, True, True)}
PARAMETERS = {"125m-interdomain": 135_416_208, "125m-softmax": 134_105_856, "125m-s4d": 135_425_424,
              "125m-cube-no-rope": 135_416_208, "125m-cube-single-input": 135_462_288,
              "125m-cube-s4d-rope": 135_425_424, "125m-cube-linear-readout": 135_379_344,
              "1p3b-interdomain": 1_352_406_784, "1p3b-softmax": 1_345_423_360, "1p3b-s4d": 1_352_455_936}


def _grid(*args, env=None, wait=True):
    """grid.py as users run it, in a process of its own."""
    proc = subprocess.Popen([sys.executable, str(GRID), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return _finish(proc) if wait else proc


def _finish(proc):
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


_spec = importlib.util.spec_from_file_location("scaling_grid", GRID)
grid = sys.modules["scaling_grid"] = importlib.util.module_from_spec(_spec)   # dataclasses need it
_spec.loader.exec_module(grid)


def _grid_here(*args):
    """grid.py's main in this process: each new process pays seconds for torch's import and its
    first model build on the meta device, so only the JSON dry run and the quick error paths
    run in a process of their own."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = grid.main(list(args))
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def dry_runs():
    """The whole grid's dry run: as JSON from the command line (in the background), and as text
    from this process meanwhile."""
    proc = _grid("--dry-run", "--json", wait=False)
    try:
        as_text = _grid_here("--dry-run")
    finally:
        as_json = _finish(proc)
    assert as_json.returncode == 0, as_json.stderr
    assert as_text.returncode == 0, as_text.stderr
    return json.loads(as_json.stdout), as_text.stdout


def _cells(dry_runs):
    return {c["name"]: c for c in dry_runs[0]["cells"]}


def _job_arguments(cell):
    """What follows the job script in the sbatch command: megatron-id train's arguments."""
    argv = cell["sbatch"]
    return argv[argv.index("launch/slurm/train.sbatch") + 1:]


def test_dry_run_lists_every_cell_of_the_paper(dry_runs):
    data, text = dry_runs
    cells = _cells(dry_runs)
    expected = set(MAIN_CELLS) | {c for c in CUBE.values()} | {"125m-hybrid"}
    assert set(cells) == expected and len(data["cells"]) == 17
    # the three cube cells that are mixer cells are the same run, listed under both names
    assert data["same_as"] == {"125m-cube-full": "125m-interdomain", "125m-cube-softmax": "125m-softmax",
                               "125m-cube-s4d": "125m-s4d"}
    table = [line.split()[0] for line in text.splitlines() if line.split()]
    commands = [shlex.split(line) for line in text.splitlines() if line.startswith("sbatch ")]
    for name in expected:
        assert table.count(name) == 1, name
        assert [c for c in commands if f"--job-name={name}" in c] == [cells[name]["sbatch"]]
    assert len(commands) == 17
    assert "125m-cube-full = 125m-interdomain" in text
    # the hybrid cell (not the paper's): its own config, the pattern's mixer and parameters
    hybrid = cells["125m-hybrid"]
    assert (hybrid["mixer"], hybrid["config"], hybrid["parameters"]) == \
        ("hybrid", "configs/model/125m-hybrid.yaml", 135_088_620)


@pytest.mark.parametrize("name, tokens, lr", [("125m-interdomain", 2_500_000_000, 3e-3),
                                              ("350m-softmax", 7_000_000_000, 1.5e-3),
                                              ("1p3b-s4d", 26_000_000_000, 1e-3),
                                              ("1p3b-interdomain", 26_000_000_000, 1e-3)])
def test_steps_warmup_and_lr_are_the_recipe_and_the_overrides_load(dry_runs, name, tokens, lr):
    cell = _cells(dry_runs)[name]
    # the engine's rounding: train_iters = ceil(train_tokens / tokens per step), and the steps in
    # the warmup ramp are those whose consumed tokens (step x tokens per step) are below 375M
    steps = math.ceil(tokens / TOKENS_PER_STEP)
    warmup = math.ceil(WARMUP_TOKENS / TOKENS_PER_STEP)
    assert warmup == 716
    assert steps == {2_500_000_000: 4769, 7_000_000_000: 13352, 26_000_000_000: 49592}[tokens]
    assert (cell["steps"], cell["warmup_steps"], cell["lr"], cell["train_tokens"]) == (steps, warmup, lr, tokens)
    assert cell["tokens_per_step"] == TOKENS_PER_STEP

    args = build_parser().parse_args(["train", *_job_arguments(cell)])   # the job script's contract
    assert args.config == [f"configs/model/{cell['scale']}.yaml"]
    cfg = load_config([ROOT / c for c in args.config], args.overrides)
    o, t, p = cfg.optimizer, cfg.train, cfg.parallel
    assert (o.lr, o.min_lr, o.warmup_tokens) == (lr, 1e-5, WARMUP_TOKENS)
    assert (t.train_tokens, t.global_batch_size, cfg.model.seq_length) == (tokens, 128, 4096)
    assert t.precision.value == "bf16" and cfg.model.mixer.value == cell["mixer"]
    layout = cell["layout"]
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, t.zero_stage,
            t.micro_batch_size, t.activation_checkpointing) == \
        (layout["tensor"], layout["pipe"], layout["zero_stage"], layout["micro_batch_size"],
         layout["activation_checkpointing"])
    assert training_layout(cfg, cell["gpus"]).train_iters == steps
    # the schedule really warms up for exactly `warmup` steps: the last one below the peak ramp,
    # the next one at the peak (cosine progress 0)
    assert learning_rate((warmup - 1) * TOKENS_PER_STEP, o, tokens) < lr
    assert learning_rate(warmup * TOKENS_PER_STEP, o, tokens) == pytest.approx(lr, rel=1e-4)


def test_every_cell_loads_fits_and_uses_all_its_gpus(dry_runs):
    data = dry_runs[0]
    assert data["gpu_memory"] == 80 * 1024 ** 3
    for cell in data["cells"]:
        lay = cell["layout"]
        assert lay["tensor"] * lay["pipe"] * lay["data"] == cell["nodes"] * cell["gpus_per_node"] == cell["gpus"]
        assert lay["micro_batch_size"] * lay["gradient_accumulation"] * lay["data"] == 128
        assert 0 < cell["memory_per_gpu"] <= 0.9 * cell["gpu_memory"]
        argv = cell["sbatch"]
        assert argv[:6] == ["sbatch", f"--job-name={cell['name']}", f"--nodes={cell['nodes']}",
                            f"--ntasks-per-node={cell['gpus_per_node']}",
                            f"--gpus-per-node={cell['gpus_per_node']}", "--time=24:00:00"]
        assert f"--export=ALL,MEGATRON_ID_RUN_DIR={ROOT / 'runs' / 'scaling' / cell['name']}" in argv
        assert shlex.split(cell["command"]) == argv
        args = build_parser().parse_args(["train", *_job_arguments(cell)])
        cfg = load_config([ROOT / c for c in args.config], args.overrides)
        m = cfg.model
        if cell["name"] in SWITCHES:
            assert (m.query_readout, m.dual_kv_input, m.rope) == SWITCHES[cell["name"]], cell["name"]
        if cell["name"] in PARAMETERS:
            assert cell["parameters"] == PARAMETERS[cell["name"]], cell["name"]
    assert {c["nodes"] for c in data["cells"] if c["scale"] == "1p3b"} == {4}


def test_unknown_only_is_one_line_and_non_zero():
    r = _grid("--dry-run", "--only", "nosuchcell")
    assert r.returncode != 0 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert "nosuchcell" in r.stderr and "125m-interdomain" in r.stderr


def test_bad_flags_are_one_line_errors():
    r = _grid("--dry-run", "--time", "1h")   # one from the command line: exit status and stderr
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "grid.py: error: --time 1h: not a SLURM time; write HH:MM:SS or D-HH:MM:SS."]
    for args in (["--nodes", "2b=3"], ["--chain", "0"], ["--only", "("], ["--gpu-memory", "80XB"],
                 ["--set", "train.zero_stage=3"], ["--set", "model.nosuchkey=1", "--only", "^125m-s4d$"],
                 ["--only", "^1p3b-s4d$", "--gpu-memory", "2GiB"]):   # the last: no layout fits
        r = _grid_here("--dry-run", *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert r.stderr.startswith("grid.py: error:") and r.stdout == "", (args, r.stderr)
    assert "no layout fits 4 x 8 GPUs of 2 GiB" in r.stderr and "--nodes 1p3b=N" in r.stderr


def test_submitting_without_sbatch_says_to_use_dry_run(tmp_path):
    r = _grid("--only", "125m-softmax", "--set", "data.data_path=/data/x_text_document",
              env={**os.environ, "PATH": str(tmp_path)})   # an empty folder: no sbatch
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "sbatch not found" in r.stderr and "--dry-run" in r.stderr


FAKE_SBATCH = """#!{python}
import json, os, sys
log = os.environ["FAKE_SBATCH_LOG"]
calls = open(log).read().splitlines() if os.path.exists(log) else []
with open(log, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
print(f"{{1000 + len(calls)}};cluster")   # --parsable: "<job id>;<cluster>"
"""


def test_chain_submits_jobs_that_depend_on_the_previous_one(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(FAKE_SBATCH.format(python=sys.executable))
    sbatch.chmod(0o755)
    log = tmp_path / "sbatch.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SBATCH_LOG", str(log))
    r = _grid_here("--only", "^125m-(interdomain|softmax)$", "--chain", "2", "--partition", "gpu",
                   "--account", "proj", "--time", "12:00:00", "--runs-dir", str(tmp_path / "runs"),
                   "--set", "data.data_path=/data/x_text_document")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["125m-interdomain: 1000 -> 1001", "125m-softmax: 1002 -> 1003"]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 4
    for (first, second), name, first_id in ((calls[0:2], "125m-interdomain", 1000),
                                            (calls[2:4], "125m-softmax", 1002)):
        assert first[0] == second[0] == "--parsable"
        assert not any(a.startswith("--dependency") for a in first)
        assert second[1] == f"--dependency=afterany:{first_id}"
        assert first[1:] == second[2:]   # the same job otherwise
        for flag in (f"--job-name={name}", "--partition=gpu", "--account=proj", "--time=12:00:00",
                     f"--export=ALL,MEGATRON_ID_RUN_DIR={tmp_path / 'runs' / name}"):
            assert flag in first, flag
        cfg = load_config([ROOT / "configs/model/125m.yaml"],
                          build_parser().parse_args(
                              ["train", *first[first.index("launch/slurm/train.sbatch") + 1:]]).overrides)
        assert cfg.data.data_path == ["/data/x_text_document"]


def test_a_failing_sbatch_is_one_line_naming_what_was_submitted(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid account' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    r = _grid_here("--only", "^125m-softmax$", "--set", "data.data_path=/data/x_text_document")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "Invalid account" in r.stderr and "Submitted before it: nothing" in r.stderr
