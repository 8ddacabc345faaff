"""launch/slurm/train.sbatch on a real SLURM cluster (tests/slurm_cluster.py: munged, slurmctld
and 2 emulated nodes on this machine), 2 nodes x 2 tasks on CPU (MEGATRON_ID_DEVICE=cpu):

- TP=2 x DP=2 and TP=2 x PP=2 jobs complete, write their checkpoint, and their losses equal the
  same runs under torchrun on one node; the TP=2 x PP=2 job runs with in-job restarts
  (train.max_restarts) and a rank killed mid-run is restarted inside the allocation;
- a job sent SIGUSR1 mid-run saves, requeues itself, resumes and finishes: its losses and final
  weights equal the uninterrupted job's;
- a rank killed with SIGKILL ends the whole job within 60 s, and the job is not requeued;
- a rendezvous host that does not resolve and a bad argument fail at once, with the reason.

Every wait has a timeout; every job has --time. The cluster is stopped whatever happens.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, ROOT
from slurm_cluster import cluster_for_tests

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SCRIPT = str(ROOT / "launch" / "slurm" / "train.sbatch")
TINY = str(CONFIGS / "model" / "tiny.yaml")
STEPS = 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One 2-node cluster for the module; skipped where SLURM cannot run (a failure under CI)."""
    yield from cluster_for_tests(tmp_path_factory.mktemp("slurm"))


def items(prefix, tp, pp, tensorboard: Path, *extra):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
            "train.zero_stage=1", "train.precision=fp32", "train.micro_batch_size=2",
            "train.global_batch_size=4", f"train.train_tokens={STEPS * 4 * 64}", "optimizer.lr=1e-2",
            "optimizer.warmup_tokens=512", "optimizer.min_lr=1e-3", "train.log_interval=1",
            "train.eval_iters=0", "train.save_interval=1000", f"train.tensorboard_dir={tensorboard}", *extra]


def submit(cluster, run_dir: Path, train_args, *sbatch_args, env=None, tasks_per_node=2) -> str:
    run_dir.mkdir(parents=True, exist_ok=True)
    exports = {"MEGATRON_ID_DEVICE": "cpu", "MEGATRON_ID_RUN_DIR": str(run_dir),
               "MEGATRON_ID_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **(env or {})}
    return cluster.sbatch(["--nodes=2", f"--ntasks-per-node={tasks_per_node}", "--time=10",
                           f"--job-name={run_dir.name}", f"--output={run_dir}/slurm-%j.out", *sbatch_args,
                           SCRIPT, *train_args],
                          cwd=ROOT, env=exports)


def job_log(run_dir: Path, job: str) -> str:
    path = run_dir / "logs" / f"{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for_text(cluster, run_dir: Path, job: str, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in job_log(run_dir, job):
            return
        state = cluster.job_info(job).get("JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            raise AssertionError(f"job {job} ended ({state}) before '{text}':\n{job_log(run_dir, job)[-3000:]}")
        time.sleep(0.2)
    cluster.run("scancel", job, check=False)
    raise TimeoutError(f"waited {timeout} s for '{text}' in job {job}'s log:\n{job_log(run_dir, job)[-3000:]}")


def losses(tensorboard: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tensorboard))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss")}


def torchrun(train_args, log: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "megatron_id.cli", "train", *train_args]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=240)
    assert done.returncode == 0, log.read_text()[-3000:]


def module_states(ckpt: Path) -> dict:
    states = {}
    for path in sorted(ckpt.glob("*model_states.pt")):
        module = torch.load(path, map_location="cpu", weights_only=True)["module"]
        states.update({f"{path.name}:{k}": v for k, v in module.items()})
    assert states, f"no model files in {ckpt}"
    return states


def assert_relative_close(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)
    for step, value in want.items():
        assert abs(got[step] - value) <= tol * abs(value), (step, got[step], value)


@pytest.fixture(scope="module")
def uninterrupted(cluster, fineweb_prefix, tmp_path_factory):
    """The TP=2 x DP=2 job, run once: compared with torchrun, and with the preempted job."""
    run = tmp_path_factory.mktemp("runs") / "tp2dp2"
    train_args = ["--config", TINY, *items(fineweb_prefix, 2, 1, run / "tb")]
    job = submit(cluster, run, train_args)
    info = cluster.wait(job, timeout=240)
    return run, job, info, train_args


def test_tp2_dp2_job_completes_and_matches_torchrun(uninterrupted, fineweb_prefix, tmp_path):
    run, job, info, _ = uninterrupted
    log = job_log(run, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    assert "TP=2 PP=1 DP=2, micro-batch 2 x 1 accumulation, about " in log
    assert f"GiB per GPU (megatron-id plan's estimate); step 0 of {STEPS}" in log
    assert "2 node(s) node[1-2], 4 task(s)" in log and "starting from scratch" in log
    assert f"finished: step {STEPS} of {STEPS}" in log
    assert (run / "checkpoints" / "latest").read_text() == f"iter_{STEPS:07d}"
    assert (run / "logs" / f"{job}.nodes").read_text().split() == ["node1", "node2"]
    assert f"JobId={job}" in (run / "logs" / f"{job}.0.job").read_text()
    assert "tensor_model_parallel_size: 2" in (run / "logs" / f"{job}.0.config.yaml").read_text()
    # the same run under torchrun on one node, same seed
    torchrun(["--config", TINY, *items(fineweb_prefix, 2, 1, tmp_path / "tb"), f"train.save={tmp_path / 'ckpt'}"],
             tmp_path / "torchrun.log")
    reference = losses(tmp_path / "tb")
    assert len(reference) == STEPS and reference[STEPS] < reference[1]
    assert_relative_close(losses(run / "tb"), reference)


def test_tp2_pp2_job_restarts_a_killed_rank_in_its_allocation_and_matches_torchrun(cluster, fineweb_prefix, tmp_path):
    """train.max_restarts (issue 53): one task per node runs its ranks under torch's elastic agent;
    rank 3 (second node) is killed with SIGKILL mid-run, every rank restarts in the same
    allocation from the newest local save, no requeue, and the losses equal an uninterrupted
    torchrun run's."""
    run = tmp_path / "tp2pp2"
    restarts = ["train.max_restarts=1", f"train.local_save={tmp_path / 'local'}", "train.local_save_interval=2"]
    job = submit(cluster, run, ["--config", TINY, *items(fineweb_prefix, 2, 2, run / "tb", *restarts)])
    wait_for_text(cluster, run, job, "step 5/")
    pid = _elastic_rank_pid(job, 3)
    assert pid is not None, job_log(run, job)[-3000:]
    os.kill(pid, signal.SIGKILL)
    info = cluster.wait(job, timeout=240)
    log = job_log(run, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "0", log[-4000:]
    assert "TP=2 PP=2 DP=1" in log and f"finished: step {STEPS} of {STEPS}" in log
    assert "in-job restart 1 of at most 1 (train.max_restarts)" in log, log[-4000:]
    resumed = int(log.split("resumed from the local saves of step ")[1].split()[0])
    assert resumed >= 4, log[-4000:]
    assert (run / "checkpoints" / "latest").read_text() == f"iter_{STEPS:07d}"
    torchrun(["--config", TINY, *items(fineweb_prefix, 2, 2, tmp_path / "tb")], tmp_path / "torchrun.log")
    assert_relative_close(losses(run / "tb"), losses(tmp_path / "tb"), tol=0.0)


def _elastic_rank_pid(job: str, rank: int) -> int | None:
    """The pid of the training process of global rank `rank` under the elastic agents of job `job`."""
    for pid, env, _ in _processes():
        if (env.get(b"SLURM_JOB_ID") == job.encode() and env.get(b"RANK") == str(rank).encode()
                and b"TORCHELASTIC_RUN_ID" in env):
            return pid
    return None


def _processes():
    """(pid, environment, command line) of each process of this machine that can be read."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        yield int(proc.name), env, cmdline


def test_usr1_checkpoints_requeues_and_resumes_exactly(uninterrupted, cluster, fineweb_prefix, tmp_path):
    """`scancel --batch --signal=USR1` is what `#SBATCH --signal=B:USR1@180` does before the
    time limit. SLURM holds a requeued job for about 2 minutes (its BeginTime); the test lets
    it start at once, as an operator would with `scontrol update StartTime=now`."""
    reference_run, reference_job, _, _ = uninterrupted
    run = tmp_path / "preempted"
    job = submit(cluster, run, ["--config", TINY, *items(fineweb_prefix, 2, 1, run / "tb")])
    wait_for_text(cluster, run, job, "step 4/")
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    info = cluster.wait(job, timeout=120, until=lambda i: i.get("Restarts") == "1" and i.get("JobState") == "PENDING")
    # SLURM's hold lets the nodes finish the first attempt: a restart within the second of the
    # requeue is refused by the nodes ("Job credential revoked") and fails the job. Wait for
    # idle nodes and a clock tick, as the hold would, then let it start.
    cluster.wait_until_idle(timeout=60)
    time.sleep(2)
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    info = cluster.wait(job, timeout=240)
    log = job_log(run, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", log[-4000:]
    assert "SIGUSR1: every rank saves a checkpoint and stops" in log
    stopped = int(log.split("stopped at step ")[1].split()[0])
    assert 4 <= stopped < STEPS, log[-4000:]
    assert f"requeueing job {job} (restart 1 of at most 20); the next attempt resumes from step {stopped}" in log
    assert f"resuming from {run / 'checkpoints'}/latest (step {stopped})" in log
    assert f"finished: step {STEPS} of {STEPS}" in log
    assert (run / "logs" / f"{job}.1.job").exists() and (run / "logs" / f"{job}.1.config.yaml").exists()
    # exact resume: every step's loss and the final weights equal the uninterrupted job's
    assert_relative_close(losses(run / "tb"), losses(reference_run / "tb"), tol=0.0)
    got = module_states(run / "checkpoints" / f"iter_{STEPS:07d}")
    want = module_states(reference_run / "checkpoints" / f"iter_{STEPS:07d}")
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _rank_pid(job: str, rank: int) -> int | None:
    """The pid of the training process of `rank` in SLURM job `job` (all nodes are this machine)."""
    for pid, env, cmdline in _processes():
        if (env.get(b"SLURM_JOB_ID") == job.encode() and env.get(b"SLURM_PROCID") == str(rank).encode()
                and b"megatron_id.cli\0train" in cmdline):
            return pid
    return None


def test_a_killed_rank_ends_the_job_within_60_s(cluster, fineweb_prefix, tmp_path):
    """2 nodes x 1 task (DP=2): rank 1, on the second node, is killed."""
    run = tmp_path / "killed"
    job = submit(cluster, run,
                 ["--config", TINY, *items(fineweb_prefix, 1, 1, run / "tb", "train.train_tokens=10000000")],
                 tasks_per_node=1)
    wait_for_text(cluster, run, job, "step 2/")
    pid = _rank_pid(job, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    info = cluster.wait(job, timeout=120)
    elapsed = time.monotonic() - killed
    log = job_log(run, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0" and info["Restarts"] == "0", log[-3000:]
    assert elapsed <= 60, elapsed
    assert "training failed (exit" in log and "requeueing" not in log, log[-3000:]
    print(f"killed rank: job ended {elapsed:.1f} s after the SIGKILL")


def test_an_unresolvable_rendezvous_host_fails_at_once(cluster, fineweb_prefix, tmp_path):
    run = tmp_path / "no-host"
    started = time.monotonic()
    job = submit(cluster, run, ["--config", TINY, *items(fineweb_prefix, 2, 1, run / "tb")],
                 env={"MASTER_ADDR": "no-such-node.invalid"})
    info = cluster.wait(job, timeout=60)
    log = job_log(run, job)
    assert info["JobState"] == "FAILED" and time.monotonic() - started < 60
    assert "the rendezvous host 'no-such-node.invalid' does not resolve" in log, log
    assert "export MASTER_ADDR=" in log and "ranks' output below" not in log


def test_bad_training_arguments_fail_before_any_rank_starts(cluster, fineweb_prefix, tmp_path):
    run = tmp_path / "bad-args"
    job = submit(cluster, run, ["--config", TINY, *items(fineweb_prefix, 2, 1, run / "tb"), "model.n_heads=3"])
    info = cluster.wait(job, timeout=60)
    log = job_log(run, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", log
    assert "megatron-id: error:" in log and "nothing was started" in log and "ranks' output below" not in log
    assert not (run / "checkpoints").exists()
