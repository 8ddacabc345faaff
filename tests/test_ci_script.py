"""`.ci/run`, the script CI runs on a fresh clone: it checks the scratch disk before installing
anything (stop 37's CI died 20 minutes in with "No space left on device") and removes the temp
folder of its venv on exit."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_too_little_scratch_space_is_refused_before_any_install(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "MIN_FREE_GIB": "1000000"}
    env.pop("CI_VENV", None)
    done = subprocess.run(["bash", str(ROOT / ".ci/run")], env=env, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{tmp_path} has" in done.stderr and "need 1000000 GiB" in done.stderr, done.stderr
    assert "pip" not in done.stdout + done.stderr   # refused before the venv and the installs
    assert list(tmp_path.iterdir()) == []           # its mktemp folder went with the trap


def test_ci_script_passes_shellcheck():
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is missing: .ci/run installs it (apt-get install shellcheck)")
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    done = subprocess.run(["shellcheck", "--severity=info", str(ROOT / ".ci/run")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
