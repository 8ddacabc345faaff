"""In-job restarts (issue 53): a rank killed with SIGKILL, one that raises and one that hangs are
restarted inside the same `megatron-id train --nproc 4` under torch.distributed.elastic, each
attempt resuming from the newest local save (train.local_save), and the run's losses equal an
uninterrupted run's bit for bit; the work lost is at most the local save interval. The same under
the SLURM cluster the tests start: tests/test_slurm.py."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bad_inputs import refused
from conftest import CONFIGS, ROOT

TINY = str(CONFIGS / "model" / "tiny.yaml")
STEPS = 12


def _args(prefix, folder: Path, *extra) -> list[str]:
    return ["--config", TINY, f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            "train.precision=fp32", "train.micro_batch_size=1", "train.global_batch_size=4",
            f"train.train_tokens={64 * 4 * STEPS}", "train.eval_iters=0", "optimizer.warmup_tokens=0",
            f"train.save={folder / 'checkpoints'}", "train.save_interval=1000", "train.log_interval=1",
            f"train.metrics_file={folder / 'metrics.jsonl'}", "train.collective_timeout_minutes=0.25", *extra]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_ID_INJECT_FAULTS"}
    return {**env, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5", **extra}


def _losses(metrics: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [line["step"] for line in lines]
    assert steps == sorted(set(steps)), f"each step has exactly one line: {steps}"
    return {line["step"]: line["train/loss"] for line in lines}


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of `rank` among the launcher's children (the elastic agent runs in the launcher)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if f"RANK={rank}".encode() in env:   # (an element: LOCAL_RANK=1 is another)
            return int(entry.name)
    return None


def _train(args, env, *, kill_at: int | None = None, kill_rank: int = 0, timeout: float = 600, nproc: int = 4):
    """`megatron-id train --nproc 4 <args>`; with kill_at, SIGKILL rank `kill_rank` once the metrics
    file shows step `kill_at` (in the first attempt). Returns (exit status, output, killed step)."""
    metrics = Path(next(a for a in args if a.startswith("train.metrics_file=")).split("=", 1)[1])
    out = metrics.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "megatron_id.cli", "train", "--nproc", str(nproc), *args],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        killed, deadline = None, time.monotonic() + timeout
        try:
            while launcher.poll() is None:
                assert time.monotonic() < deadline, "the run did not end"
                if kill_at is not None and killed is None and metrics.exists():
                    done = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line]
                    if done and max(done) >= kill_at:
                        pid = _rank_pid(launcher.pid, kill_rank)
                        if pid is not None:
                            os.kill(pid, signal.SIGKILL)
                            killed = max(done)
                time.sleep(0.05)
        finally:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGINT)
                launcher.wait(60)
    return launcher.returncode, out.read_text(), killed


def _resumed_steps(output: str) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from the local saves of step (\d+)", output)]


@pytest.mark.slow
def test_a_killed_a_raising_and_a_hung_rank_restart_in_the_job_and_losses_equal_an_uninterrupted_run(
        fineweb_prefix, tmp_path):
    tp2 = ["parallel.tensor_model_parallel_size=2"]
    status, output, _ = _train(_args(fineweb_prefix, tmp_path / "plain", *tp2), _env())
    assert status == 0, output[-3000:]
    expected = _losses(tmp_path / "plain" / "metrics.jsonl")
    assert sorted(expected) == list(range(1, STEPS + 1))

    # attempt 0: SIGKILL of a random rank at a random step; attempt 1: rank 1 raises at step 8;
    # attempt 2: rank 2 hangs at step 10 (its peers' collectives time out); attempt 3 finishes
    rng = random.Random()
    kill_at, kill_rank = rng.randint(3, 5), rng.randrange(4)   # (after the first local save)
    run = tmp_path / "restarted"
    faults = "raise:step=8:rank=1:attempt=1; hang:step=10:rank=2:attempt=2"
    status, output, killed = _train(
        _args(fineweb_prefix, run, *tp2, "train.max_restarts=3", f"train.local_save={tmp_path / 'local'}",
              "train.local_save_interval=2"),
        _env(MEGATRON_ID_INJECT_FAULTS=faults), kill_at=kill_at, kill_rank=kill_rank)
    shown = f"killed rank {kill_rank} at step {killed}\n{output[-6000:]}"
    assert status == 0, shown
    assert killed is not None, shown
    for attempt in (1, 2, 3):
        assert f"in-job restart {attempt} of at most 3 (train.max_restarts)" in output, shown
    assert "injected fault (MEGATRON_ID_INJECT_FAULTS): rank 1 raises at step 8, attempt 1" in output, shown
    assert "rank 2 hangs at step 10, attempt 2" in output, shown
    assert "did not complete within train.collective_timeout_minutes=0.25" in output, shown
    # the peers of a failed rank say so in one line each, not in a traceback of gloo's error
    assert "a peer rank ended during step" in output, shown
    assert not re.search(r"RuntimeError: .*Connection (closed|reset) by peer", output), shown
    # each attempt resumed from the newest local save; the kill lost at most the save interval
    resumed = _resumed_steps(output)
    assert len(resumed) == 3 and resumed[1:] == [6, 8], shown
    assert killed - resumed[0] <= 2, shown
    # losses equal the uninterrupted run's, bit for bit, with one metrics line per step
    assert _losses(run / "metrics.jsonl") == expected, shown
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(row.get("train/restarts", 0) for row in rows) == 3   # the count, beside the step's scalars
    assert (run / "checkpoints" / "latest").read_text() == f"iter_{STEPS:07d}"
    left = sorted(path.name for path in (tmp_path / "local").iterdir())
    assert not left, f"a finished run's local saves are removed: {left}"


@pytest.mark.slow
def test_a_killed_rank_restarts_at_pp2_dp2_and_the_losses_equal_an_uninterrupted_run(fineweb_prefix, tmp_path):
    pp2 = ["parallel.pipeline_model_parallel_size=2", "train.zero_stage=1", "train.micro_batch_size=1"]
    status, output, _ = _train(_args(fineweb_prefix, tmp_path / "plain", *pp2), _env())
    assert status == 0, output[-3000:]
    expected = _losses(tmp_path / "plain" / "metrics.jsonl")
    # durable saves every 5 steps too, and train.load unset: the restart resumes from train.save or
    # the local saves, whichever is newer
    run = tmp_path / "restarted"
    status, output, killed = _train(
        _args(fineweb_prefix, run, *pp2, "train.max_restarts=1", f"train.local_save={tmp_path / 'local'}",
              "train.local_save_interval=2", "train.save_interval=5"), _env(), kill_at=random.randint(6, 7),
        kill_rank=3)
    shown = f"killed at step {killed}\n{output[-6000:]}"
    assert status == 0 and killed is not None, shown
    assert "in-job restart 1 of at most 1" in output, shown
    local = _resumed_steps(output)
    assert local == [] or (local[0] >= 6 and "newer than train.save's step 5" in output), shown
    assert killed - (local[0] if local else 5) <= 2, shown
    assert _losses(run / "metrics.jsonl") == expected, shown


@pytest.mark.slow
def test_the_restart_budget_spent_ends_the_run_with_the_failed_ranks_status(fineweb_prefix, tmp_path):
    """Every attempt fails (attempt=any): after train.max_restarts restarts the run ends with the
    status a run without restarts has, naming the rank; no checkpoint claims the run finished."""
    status, output, _ = _train(_args(fineweb_prefix, tmp_path, "train.max_restarts=1"),
                               _env(MEGATRON_ID_INJECT_FAULTS="exit:step=2:rank=1:status=7:attempt=any"), nproc=2)
    assert status == 7, output[-3000:]
    assert "in-job restart 1 of at most 1" in output
    assert output.strip().splitlines()[-1] == ("megatron-id train: rank 1 failed (exit 7) after 1 in-job restart(s) "
                                               "(train.max_restarts=1); the run ended with it")


def test_restart_and_local_save_settings_are_refused_before_any_rank_starts(tmp_path):
    train = ["megatron_id.cli", "train", "--nproc", "2", "--config", TINY]
    refused([*train, "train.max_restarts=2"], unchanged=[tmp_path],
            mention=r"train.max_restarts=2 without train.save: a restarted run resumes from a checkpoint")
    refused([*train, "train.max_restarts=-1"], unchanged=[tmp_path], mention=r"train.max_restarts=-1 is invalid")
    refused([*train, f"train.save={tmp_path}/ck", f"train.local_save={tmp_path}/local"], unchanged=[tmp_path],
            mention=r"train.local_save_interval=0 is invalid: it must be at least 1 with train.local_save set")
    refused([*train, f"train.save={tmp_path}/ck", f"train.local_save={tmp_path}/ck/local",
             "train.local_save_interval=5"], unchanged=[tmp_path],
            mention=r"train.local_save=.*/ck/local is inside train.save=.*: give a node-local folder of its own")
    refused([*train, f"train.save={tmp_path}/ck", f"train.local_save={tmp_path}/local", "train.local_save_interval=5",
             "train.zero_stage=3"], unchanged=[tmp_path], mention=r"with train.zero_stage=3: a local save holds")
    (tmp_path / "a-file").write_text("kept")
    refused([*train, f"train.save={tmp_path}/ck", f"train.local_save={tmp_path}/a-file", "train.local_save_interval=5",
             "train.max_restarts=1"], unchanged=[tmp_path],
            mention=r"train.local_save=.*/a-file is a file, not a folder")
    refused([*train, f"train.save={tmp_path}/ck", "train.max_restarts=1"], unchanged=[tmp_path],
            env={"MEGATRON_ID_INJECT_FAULTS": "crash:step=1"},
            mention=r"MEGATRON_ID_INJECT_FAULTS: unknown fault 'crash'")


def _steps_then_resume_locally(rank, world, items, local, stop_at):
    """Train to `stop_at` with local saves every 2 steps, drop the trainer (a failed attempt),
    then build a new one on the same config: it resumes from the local saves and trains on."""
    import shutil

    import torch.distributed as dist

    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    cfg = load_config([TINY], [*items, f"train.local_save={local}", "train.local_save_interval=2"])
    first = Trainer(cfg)
    before = first.train(max_steps=stop_at)
    first.close()
    if rank == 0:   # a failure before any durable save: its end-of-train save never happened
        shutil.rmtree(cfg.train.save)
    dist.barrier()
    second = Trainer(cfg)
    resumed_at = second.step
    after = second.train()
    second.close()
    return before, resumed_at, after


def _uninterrupted(rank, world, items):
    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    losses = trainer.train()
    trainer.close()
    return losses


def test_a_local_save_resumes_bit_for_bit_at_zero_0(fineweb_prefix, tmp_path):
    """Each rank's module, optimizer (the guard itself at ZeRO-0; DeepSpeed's ZeRO-1/2 partitions in
    the launcher tests above), step counters and RNG come back from its own file: the losses after
    it equal an uninterrupted run's."""
    zero = 0
    from distributed import run_distributed
    items = [f"data.data_path=[{fineweb_prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
             "train.precision=fp32", f"train.zero_stage={zero}", "train.micro_batch_size=1",
             "train.global_batch_size=4", f"train.train_tokens={64 * 4 * 6}", "train.eval_iters=0",
             "optimizer.warmup_tokens=0", f"train.save={tmp_path / 'ck'}", "train.save_interval=1000"]
    want = run_distributed(_uninterrupted, 2, args=(items,), timeout=300)[0]
    items[-2] = f"train.save={tmp_path / 'ck2'}"
    before, resumed_at, after = run_distributed(_steps_then_resume_locally, 2, timeout=300,
                                                args=(items, tmp_path / "local", 5))[0]
    assert resumed_at == 4, "the newest local save (step 4; train.save holds none now)"
    assert before == want[:5] and after == want[4:]
    assert not any((tmp_path / "local").iterdir()), "removed when the run finished"


def test_a_rank_removes_its_own_files_of_its_run_and_a_write_cut_short_but_nothing_else(tmp_path):
    """A rank killed during torch.save leaves `<name>.partialPID` (the CI run of stop 60 met one
    left after a finished run). Superseded and finished, a rank removes its own files of this run,
    cut short or not; another rank's, another run's and a stranger's stay."""
    from megatron_id.training.resilience import LocalSaves
    saves = LocalSaves.__new__(LocalSaves)   # (the naming only: no trainer, no process group)
    saves.folder, saves.fp, saves.rank = tmp_path, "0123456789abcdef", 1
    ours = [saves._path(4), saves._path(6), Path(f"{saves._path(8)}.partial4242")]
    others = [tmp_path / "megatron-id-local.0123456789abcdef.rank00002.step000000004.pt",   # another rank's
              tmp_path / "megatron-id-local.fedcba9876543210.rank00001.step000000004.pt",   # another run's
              tmp_path / "megatron-id-local.0123456789abcdef.rank00001.step000000004.pt.bak",
              tmp_path / "notes.txt"]
    for path in ours + others:
        path.write_bytes(b"x")
    assert saves.steps() == [4, 6]   # the partial write is never a step to resume from
    saves.remove_all()
    assert sorted(tmp_path.iterdir()) == sorted(others)
