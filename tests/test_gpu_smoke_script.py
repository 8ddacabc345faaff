"""launch/gpu_smoke.sh, the first command on any GPU machine, run on the CPU (SMOKE_DEVICE=cpu):
every step of the user path passes, and it refuses to write into a folder that holds anything."""
import os
import subprocess

import pytest

from conftest import ROOT

STEPS = ["preprocess", "train", "train-checkpoint", "resume", "resume-continues-at-step-5",
         "check-checkpoint", "export-hf", "generate", "hf-bf16-keeps-ssm-fp32"]


@pytest.mark.slow
def test_gpu_smoke_script_passes_every_step_on_the_cpu(tmp_path):
    env = {**os.environ, "SMOKE_DEVICE": "cpu", "PYTHON": "python"}
    out = tmp_path / "smoke"
    done = subprocess.run(["bash", "launch/gpu_smoke.sh", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    for name in STEPS:
        assert f"PASS  {name} (" in done.stdout, (name, done.stdout[-3000:])
    assert done.stdout.strip().splitlines()[-1] == "gpu_smoke: PASS"
    assert (out / "checkpoints" / "latest").read_text() == "iter_0000006"
    again = subprocess.run(["bash", "launch/gpu_smoke.sh", str(out)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
