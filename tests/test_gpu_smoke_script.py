"""launch/gpu_smoke.sh, the user path on a GPU in a few minutes: it refuses to write into a folder
that holds anything. Its steps run on the CPU inside launch/gpu_check.sh's dry run."""
import os
import subprocess

from conftest import ROOT


def test_gpu_smoke_script_refuses_a_folder_that_holds_anything(tmp_path):
    """Its steps pass on the CPU inside launch/gpu_check.sh's dry run
    (tests/test_gpu_readiness.py::test_gpu_check_dry_run_passes_every_step checks each of them)."""
    env = {**os.environ, "SMOKE_DEVICE": "cpu", "PYTHON": "python"}
    out = tmp_path / "smoke"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    again = subprocess.run(["bash", "launch/gpu_smoke.sh", str(out)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
    assert (out / "notes.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
