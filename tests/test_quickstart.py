"""The quickstart: the README's first command, run from a fresh copy of the repository (its
tracked files only), preprocesses, trains on 2 processes with ZeRO-1, validates and checkpoints."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


def tracked_copy(dest):
    """What a fresh clone holds: the tracked files of the working tree (uncommitted edits included)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, names.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


@pytest.mark.slow
def test_quickstart_runs_as_the_readme_says_from_a_fresh_clone(tmp_path):
    readme = (ROOT / "README.md").read_text()
    first_command = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip()
    assert first_command == "bash launch/quickstart.sh"
    clone = tmp_path / "clone"
    tracked_copy(clone)
    assert not (clone / "runs").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DS_ACCELERATOR")}
    env["PYTHON"] = sys.executable
    done = subprocess.run(["bash", "-c", first_command], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    (run,) = (clone / "runs").iterdir()            # runs/quickstart-<date-time>
    log = (run / "train.log").read_text()
    assert "TP=1 PP=1 DP=2 ZeRO-1" in log                      # a real parallel layout with ZeRO
    valid = [float(v) for v in re.findall(r"validation at step \d+ \| loss ([\d.]+)", log)]
    assert len(valid) == 3 and valid[-1] < valid[0] < 9.0, valid   # it learned (10.8 at init)
    latest = (run / "checkpoints" / "latest").read_text()
    assert latest == "iter_0000150"
    assert (run / "checkpoints" / latest / "mp_rank_00_model_states.pt").is_file()
    assert len(list((run / "checkpoints" / latest).glob("*optim_states.pt"))) == 2   # ZeRO-1: one per DP rank
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    for line in (f"log:          {run / 'train.log'}", f"checkpoint:   {run / 'checkpoints' / latest}",
                 f"TensorBoard:  tensorboard --logdir {run / 'tensorboard'}"):
        assert line in output, line
