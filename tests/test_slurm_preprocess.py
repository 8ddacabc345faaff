"""Preprocessing on SLURM (issue 11): launch/slurm/preprocess_submit.py submits a job array
(launch/slurm/preprocess.sbatch, one contiguous slice of the inputs per task) and a merge job
(launch/slurm/merge.sbatch) that depends on it, on a real 2-node SLURM cluster started on this
machine (tests/slurm_cluster.py).

- The merged .bin/.idx/.meta.json are byte-identical to one preprocess run over the same files
  in the same order.
- A missing input fails its array task, naming the file; SLURM then cancels the merge
  (JobState CANCELLED, Reason DependencyNeverSatisfied: --kill-on-invalid-dep=yes; without it
  Slurm 22.05 leaves the merge PENDING forever) and no output is written.
- The helper refuses an existing output (and other mistakes) before it submits anything.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from slurm_cluster import cluster_for_tests

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SUBMIT = ROOT / "launch" / "slurm" / "preprocess_submit.py"
FINEWEB = ROOT / "tests" / "data" / "fineweb-edu-sample-150.jsonl"
GPT2 = ROOT / "tests" / "data" / "gpt2-tokenizer.json"
FLAGS = ["--tokenizer", str(GPT2), "--append-eod"]
CUTS = [0, 20, 70, 150]   # three shards of 20, 50 and 80 documents


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One 2-node cluster for the module; skipped where SLURM cannot run (a failure under CI)."""
    yield from cluster_for_tests(tmp_path_factory.mktemp("slurm"))


def shards(folder: Path) -> list[Path]:
    lines = FINEWEB.read_text(encoding="utf-8").splitlines(keepends=True)
    paths = []
    for i, (a, b) in enumerate(zip(CUTS, CUTS[1:])):
        paths.append(folder / f"shard{i}.jsonl")
        paths[-1].write_text("".join(lines[a:b]), encoding="utf-8")
    return paths


def submit(args, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    env = {**env, "PYTHONPATH": str(ROOT), "MEGATRON_ID_PYTHON": sys.executable}
    return subprocess.run([sys.executable, str(SUBMIT), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def job_ids(out: str) -> tuple[str, str]:
    return (re.search(r"preprocess array job (\d+)", out).group(1),
            re.search(r"merge job (\d+)", out).group(1))


def logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(folder.glob("*.out")))


def test_array_and_merge_write_the_bytes_of_one_run(cluster, tmp_path):
    inputs = shards(tmp_path)
    done = submit(["--array-size", 3, "--output-prefix", tmp_path / "out" / "fw", "--time", 2,
                   "--cpus-per-task", 1, "--", *FLAGS, "--", *inputs], tmp_path, cluster.env)
    assert done.returncode == 0, done.stderr
    array, merge = job_ids(done.stdout)
    work = tmp_path / "out" / "fw.preprocess"
    info = cluster.wait(merge, timeout=90)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), logs(work / "logs")
    assert [cluster.job_info(f"{array}_{i}")["JobState"] for i in range(3)] == ["COMPLETED"] * 3

    from data_tools.preprocess import main as preprocess
    assert preprocess(["--input", *map(str, inputs), *FLAGS, "--output-prefix", str(tmp_path / "ref"),
                       "--no-progress"]) == 0
    for ext in (".bin", ".idx", ".meta.json"):
        assert (tmp_path / f"out/fw_text_document{ext}").read_bytes() == \
            (tmp_path / f"ref_text_document{ext}").read_bytes(), ext
    assert json.loads((tmp_path / "out/fw_text_document.meta.json").read_text())["num_sequences"] == 150

    # the work folder: the ordered list, one slice per task, a log per task; parts removed
    assert (work / "files.txt").read_text().splitlines() == [str(p) for p in inputs]
    assert [(work / f"parts/part-{i}.txt").read_text().splitlines() for i in range(3)] == \
        [[str(p)] for p in inputs]
    assert sorted(p.name for p in (work / "logs").iterdir()) == \
        [f"merge-{merge}.out"] + [f"preprocess-{array}_{i}.out" for i in range(3)]
    assert sorted(p.name for p in (work / "parts").iterdir()) == [f"part-{i}.txt" for i in range(3)]


def test_a_missing_input_fails_its_task_and_the_merge_never_runs(cluster, tmp_path):
    inputs = shards(tmp_path)
    # occupy every CPU so that the array waits while its input disappears
    blocker = cluster.sbatch(["--nodes=2", "--ntasks-per-node=2", "--time=1",
                              f"--output={tmp_path}/blocker-%j.out", "--wrap=sleep 60"])
    try:
        cluster.wait(blocker, timeout=30, until=lambda i: i.get("JobState") == "RUNNING")
        done = submit(["--array-size", 3, "--output-prefix", tmp_path / "fw", "--time", 2,
                       "--cpus-per-task", 1, "--", *FLAGS, "--", *inputs], tmp_path, cluster.env)
        assert done.returncode == 0, done.stderr
        array, merge = job_ids(done.stdout)
        inputs[1].unlink()
    finally:
        cluster.run("scancel", blocker, check=False)
    info = cluster.wait(merge, timeout=90)
    assert (info["JobState"], info["Reason"]) == ("CANCELLED", "DependencyNeverSatisfied")
    failed = cluster.wait(f"{array}_1", timeout=30)
    assert (failed["JobState"], failed["ExitCode"]) == ("FAILED", "2:0")
    log = (tmp_path / f"fw.preprocess/logs/preprocess-{array}_1.out").read_text()
    assert f"input file missing: {inputs[1]}" in log
    assert not list(tmp_path.glob("fw_text_document*"))
    assert not (tmp_path / f"fw.preprocess/logs/merge-{merge}.out").exists()


def fake_slurm(folder: Path) -> dict:
    """sbatch/squeue/scancel that only record that they were called."""
    folder.mkdir()
    for tool in ("sbatch", "squeue", "scancel"):
        script = folder / tool
        script.write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {folder}/calls\necho 1\n")
        script.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.parametrize("case", ["existing output", "missing input", "bad flag", "no inputs"])
def test_the_helper_refuses_before_submitting_anything(tmp_path, case):
    inputs = shards(tmp_path)
    env = fake_slurm(tmp_path / "bin")
    (tmp_path / "fw_text_document.bin").write_bytes(b"old")
    (tmp_path / "fw_text_document.idx").write_bytes(b"old")
    prefix = tmp_path / ("fw" if case == "existing output" else "new")
    flags = FLAGS + (["--no-such-flag"] if case == "bad flag" else [])
    files = {"missing input": [*inputs, tmp_path / "gone.jsonl"], "no inputs": []}.get(case, inputs)
    done = submit(["--array-size", 3, "--output-prefix", prefix, "--", *flags, "--", *files],
                  tmp_path, env)
    assert done.returncode == 2, done.stdout + done.stderr
    expected = {"existing output": r"fw_text_document\.bin, .*_document\.idx already exist: pass --overwrite",
                "missing input": r"input '.*gone\.jsonl' matches no file",
                "bad flag": r"unrecognized arguments: --no-such-flag",
                "no inputs": r"no input files after the second `--`"}[case]
    assert re.search(expected, done.stderr.strip().splitlines()[-1]), done.stderr
    assert not (tmp_path / "bin" / "calls").exists()   # no sbatch, nothing submitted
    assert not list(tmp_path.glob("*.preprocess"))      # and nothing written
    assert (tmp_path / "fw_text_document.bin").read_bytes() == b"old"


def test_dry_run_prints_the_commands_and_caps_the_array_at_the_number_of_inputs(tmp_path):
    inputs = shards(tmp_path)
    env = fake_slurm(tmp_path / "bin")
    done = submit(["--array-size", 8, "--output-prefix", tmp_path / "fw", "--partition", "cpu",
                   "--time", "1:00:00", "--dry-run", "--", *FLAGS, "--", *inputs], tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert "--array-size 8 is more than the 3 inputs: using 3 array tasks" in done.stderr
    array_line, merge_line = [line for line in done.stdout.splitlines() if line.strip().startswith("sbatch")]
    assert "--array=0-2" in array_line and "--partition=cpu" in array_line and "--time=1:00:00" in array_line
    assert f"{tmp_path}/fw.preprocess/logs/preprocess-%A_%a.out" in array_line
    assert "--dependency=afterok:<array job id>" in merge_line and "--kill-on-invalid-dep=yes" in merge_line
    assert not (tmp_path / "bin" / "calls").exists() and not list(tmp_path.glob("*.preprocess"))


def test_slices_are_contiguous_non_empty_and_balanced_by_size():
    sys.path.insert(0, str(SUBMIT.parent))
    from preprocess_submit import contiguous_slices
    assert contiguous_slices([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    assert contiguous_slices([100, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert contiguous_slices([1, 1, 1, 1, 100], 3) == [(0, 3), (3, 4), (4, 5)]
    assert contiguous_slices([5] * 10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]   # ties: the earlier cut
