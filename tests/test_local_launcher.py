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
