"""launch/local.sh, the one-machine twin of launch/slurm/train.sbatch: the same run folder
(logs, resolved config, checkpoints), train.load defaulting to train.save so the same command
resumes, and arguments checked before any process starts. Every launch/ script passes shellcheck."""
import os
import shutil
import subprocess
import sys

import pytest
from conftest import CONFIGS, ROOT

TINY = str(CONFIGS / "model" / "tiny.yaml")


def local(run_dir, *args):
    env = {**os.environ, "NPROC": "2", "MEGATRON_ID_DEVICE": "cpu", "MEGATRON_ID_RUN_DIR": str(run_dir),
           "MEGATRON_ID_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", "launch/local.sh", "--config", TINY, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_local_launcher_trains_records_and_resumes_with_the_same_command(fineweb_prefix, tmp_path):
    run = tmp_path / "run"
    args = [f"data.data_path=[{fineweb_prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            "train.zero_stage=1", "train.precision=fp32", "train.micro_batch_size=2",
            "train.global_batch_size=4", "train.train_tokens=768", "train.eval_iters=0"]
    done = local(run, *args)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "TP=1 PP=1 DP=2, micro-batch 2 x 1 accumulation, about " in out and "; step 0 of 3" in out
    assert f"starting from scratch; checkpoints go to {run / 'checkpoints'}" in out
    assert (run / "checkpoints" / "latest").read_text() == "iter_0000003"
    (log,) = (run / "logs").glob("*.out")
    assert "finished at step 3" in log.read_text()
    (record,) = (run / "logs").glob("*.config.yaml")
    assert f"load: {run / 'checkpoints'}" in record.read_text()
    # the same command again: train.load = train.save, so it finds the run finished
    again = local(run, *args)
    assert again.returncode == 0 and "finished already: step 3 of 3; nothing to do" in again.stdout, again.stdout
    # a layout the process count cannot hold is refused before torchrun starts
    bad = local(run, *args, "parallel.tensor_model_parallel_size=4")
    assert bad.returncode == 2 and "world size 2 does not factor" in bad.stderr, bad.stderr
    assert "nothing was started" in bad.stderr and "nothing was started 2" not in bad.stderr
    # refused arguments into a new run folder leave no folder behind
    fresh = local(tmp_path / "new-run", *args, "train.sve=1")
    assert fresh.returncode == 2 and "unknown config key 'train.sve'" in fresh.stderr
    assert not (tmp_path / "new-run").exists()


def test_every_launch_script_passes_shellcheck():
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is missing: .ci/run installs it (apt-get install shellcheck)")
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    scripts = sorted(p for p in (ROOT / "launch").rglob("*") if p.suffix in (".sh", ".sbatch"))
    assert len(scripts) >= 4, scripts
    done = subprocess.run(["shellcheck", "--severity=info", *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


# ------------------------------------------------------------------ issue 41 group C: the documented launchers
# Under torchrun (the README's by-hand block used it) every refusal was followed by torchrun's 25-line
# ChildFailedError report and exit 1, and a SIGTERM ended in a SignalException traceback and exit 1 while the
# last project line said "(exit 3)". `megatron-id train --nproc N` starts the ranks itself (the README,
# launch/local.sh and the quickstart use it): one line and the ranks' own status.

from bad_inputs import refused  # noqa: E402


def test_nproc_refusals_are_one_line_before_any_rank_starts(tmp_path):
    train = ["megatron_id.cli", "train", "--config", TINY]
    refused([*train, "--nproc", "0"], unchanged=[tmp_path], mention=r"--nproc 0: give the number of processes")
    refused([*train, "--nproc", "2"], env={"RANK": "0"}, unchanged=[tmp_path],
            mention=r"--nproc 2: this process is already one rank started by a launcher \(RANK=0 is set\): "
                    r"drop --nproc")
    refused([*train, "--nproc", "2"], env={"SLURM_STEP_NUM_TASKS": "4"}, unchanged=[tmp_path],
            mention=r"--nproc 2: srun started 4 tasks")
    done = refused([*train, "--nproc", "2", "parallel.tensor_model_parallel_size=4"], unchanged=[tmp_path],
                   mention=r"world size 2 does not factor into TP=4")
    assert done.stderr.count("error:") == 1
    done = refused([*train, "--nproc", "2", "model.d_model=64", "model.d_model=128", "train.sve=1"],
                   unchanged=[tmp_path], mention=r"unknown config key 'train.sve'")
    assert done.stderr.count("given twice") == 1   # its warnings, once, when no rank starts to say them
    # launch/local.sh takes train's arguments; the process count is its NPROC
    done = local(tmp_path / "run", "--nproc", "2")
    assert done.returncode == 2 and "--nproc: the number of processes is NPROC here" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()
    # 4,096 CPU ranks: their planned memory together, before 4,096 processes import torch
    refused([*train, "--nproc", "4096", "train.global_batch_size=4096", "train.micro_batch_size=1"],
            env={"DS_ACCELERATOR": "cpu"}, unchanged=[tmp_path],
            mention=r"planned memory .* GiB per rank x 4096 rank\(s\) on this host is more than the")


def test_a_problem_the_ranks_find_is_one_line_with_their_status(fineweb_prefix, tmp_path):
    save = tmp_path / "checkpoints"
    save.mkdir()
    (save / "notes.txt").write_text("mine")   # train.save holding other files: found by rank 0
    done = refused(["megatron_id.cli", "train", "--nproc", "2", "--config", TINY, f"data.data_path=[{fineweb_prefix}]",
                    "model.vocab_size=50257", f"train.save={save}", "train.train_tokens=768",
                    "train.global_batch_size=4", "train.micro_batch_size=2"],
                   mention=r"^megatron-id: error: train.save=.* holds files that are not checkpoints",
                   unchanged=[tmp_path])
    assert done.returncode == 2, done.returncode
    for noise in ("ChildFailedError", "torch.distributed.elastic", "torch/distributed/run.py"):
        assert noise not in done.stderr, done.stderr


def test_each_rank_gets_the_torchrun_variables_and_the_allocator_settings():
    from megatron_id.allocator import ALLOCATOR_ENV
    from megatron_id.training.launcher import rank_environment
    env = rank_environment({"PATH": "/bin"}, 1, 2, 29500)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} \
        == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}
    assert env["OMP_NUM_THREADS"] == "1" and all(env[k] == v for k, v in ALLOCATOR_ENV.items())
    mine = rank_environment({"OMP_NUM_THREADS": "4", "MALLOC_TRIM_THRESHOLD_": "0"}, 0, 1, 1)
    assert mine["OMP_NUM_THREADS"] == "4" and mine["MALLOC_TRIM_THRESHOLD_"] == "0"   # exported wins
    assert "MALLOC_MMAP_THRESHOLD_" not in mine


def test_megatron_id_train_keeps_freed_memory_whoever_launched_it(monkeypatch):
    """The by-hand block trained ~1.5x slower than the quickstart, whose script alone exported glibc's
    malloc settings: `megatron-id train` sets them itself (mallopt), for torchrun's and srun's ranks too."""
    code = ("import os, sys; from megatron_id.cli import main; "
            f"status = main(['train', '--config', {TINY!r}, 'train.sve=1']); "
            "print(status, os.environ.get('MALLOC_MMAP_THRESHOLD_'), os.environ.get('MALLOC_TRIM_THRESHOLD_'))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", str(4 << 30), str(64 << 30)], done.stdout + done.stderr[-2000:]
    from megatron_id.allocator import keep_freed_memory
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")   # the user's choice: left as it is
    before = dict(os.environ)
    assert keep_freed_memory() is False and dict(os.environ) == before


@pytest.mark.slow
def test_sigterm_to_the_local_launcher_saves_and_exits_3_in_one_line(fineweb_prefix, tmp_path):
    import signal
    import time
    run = tmp_path / "run"
    env = {**os.environ, "NPROC": "2", "MEGATRON_ID_DEVICE": "cpu", "MEGATRON_ID_RUN_DIR": str(run),
           "MEGATRON_ID_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    args = [f"data.data_path=[{fineweb_prefix}]", "data.split=100,0,0", "model.vocab_size=50257", "train.zero_stage=1",
            "train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=4",
            "train.train_tokens=2560000", "train.eval_iters=0", "train.log_interval=1"]
    proc = subprocess.Popen(["bash", "launch/local.sh", "--config", TINY, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        logs = list((run / "logs").glob("*.out")) if (run / "logs").is_dir() else []
        if logs and "step 1/" in logs[0].read_text():
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)   # to the script: it passes it to megatron-id train, which passes it on
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 3, (out + err)[-3000:]
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "stopped early (exit 3) with a checkpoint" in lines[-1], err[-3000:]
    stopped = [line for line in (out + err).splitlines() if line.startswith("stopped at step ")]
    assert len(stopped) == 1 and stopped[0].endswith("(exit 3)"), out[-3000:]
    for noise in ("Traceback", "SignalException", "ChildFailedError"):
        assert noise not in out + err, (out + err)[-3000:]
    assert (run / "checkpoints" / "latest").is_file()
