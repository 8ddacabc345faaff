"""Building the CPU decode kernel (megatron_id/inference/cpu_kernel.py) when other processes
are or were at it (issue 52): torch guards its build with a `lock` file that a killed process
leaves behind, and every later `generate` and `serve` waited on it forever, printing nothing.

The kernel is built (once) in the session's TORCH_EXTENSIONS_DIR (tests/conftest.py), which
tests/test_fused_decode.py has usually filled already; these tests only put lock files beside
it. Each call runs on a thread with a deadline, so that a hang fails the test instead of CI.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from megatron_id.errors import BadOptionError
from megatron_id.inference import cpu_kernel

# A process holding the build as a builder does: our flock on <folder>.lock, then torch's `lock`
# file in the folder (its FileBaton); it holds them until killed, or for argv[3] seconds and
# then lets go as torch and the kernel would (the file removed, the flock dropped at exit).
HOLDER = """
import fcntl, os, sys, time
lock, baton, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
fd = os.open(lock, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, b"host test, pid %d" % os.getpid())
open(baton, "x").close()
print("holding", flush=True)
time.sleep(seconds)
os.remove(baton)
"""


@pytest.fixture
def folder():
    """The kernel's build folder in the session's TORCH_EXTENSIONS_DIR (torch's rule); its
    `lock` file is removed at the end whatever happened."""
    name = cpu_kernel.module_name(cpu_kernel._flags())
    path = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / name
    path.mkdir(parents=True, exist_ok=True)
    yield path
    (path / "lock").unlink(missing_ok=True)


def kernel_within(seconds: float) -> tuple[object, list, float]:
    """(the kernel or None, the warnings, seconds taken) of a fresh build-or-load; fails when it
    takes longer than `seconds` (the thread is left waiting: the fixture's cleanup frees it)."""
    out = {}

    def run():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["kernel"] = cpu_kernel.fixed_state_step_kernel.__wrapped__()
        out["warnings"] = [str(w.message) for w in caught]
    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"building or loading the kernel still waits after {seconds} s"
    return out["kernel"], out["warnings"], time.monotonic() - start


def hold(folder: Path, seconds: float) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder.with_name(folder.name + ".lock")),
                               str(folder / "lock"), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_a_lock_file_left_by_a_killed_build_is_removed_and_the_kernel_loads(folder, capsys):
    (folder / "lock").touch()   # what a process killed inside torch's build leaves
    kernel, caught, _ = kernel_within(180)
    assert kernel is not None, caught
    assert f"megatron-id: removed {folder / 'lock'}, left by a build of the CPU decode kernel that was killed" in \
        capsys.readouterr().err
    assert not (folder / "lock").exists()


def test_a_live_builder_past_the_timeout_leaves_the_torch_path_with_a_warning_then_its_kill_frees_the_build(
        folder, capsys, monkeypatch):
    monkeypatch.setenv("MEGATRON_ID_KERNEL_LOCK_TIMEOUT", "1")
    holder = hold(folder, 600)
    try:
        kernel, caught, took = kernel_within(60)
        assert kernel is None and took < 30, took
        lock = folder.with_name(folder.name + ".lock")
        assert any(f"waited 1 s for {lock}, held by another process building the fused decode step's CPU kernel "
                   f"(host test, pid {holder.pid}): decoding with the torch ops instead" in w for w in caught), caught
        assert f"waiting for another process building the fused decode step's CPU kernel (host test, pid " \
               f"{holder.pid}; lock {lock}), up to 1 s" in capsys.readouterr().err
        # killed inside the build: its `lock` file stays, the flock goes with it
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert (folder / "lock").exists()
        kernel, caught, _ = kernel_within(180)
        assert kernel is not None, caught
        assert f"removed {folder / 'lock'}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_second_process_waits_for_the_first_build_and_says_so(folder, capsys):
    """Two processes at once: the second waits on the first's lock (saying for whom), then loads
    what it built."""
    built = (folder / f"{folder.name}.so").is_file()
    holder = hold(folder, 2)
    try:
        kernel, caught, took = kernel_within(180)
        assert kernel is not None, caught
        err = capsys.readouterr().err
        assert f"waiting for another process building the fused decode step's CPU kernel (host test, pid " \
               f"{holder.pid}" in err
        assert "removed" not in err, err
        if built:   # (what the first built is loaded, not built again)
            assert "building the fused decode step's CPU kernel (once" not in err, err
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_lock_timeout_is_named(value, monkeypatch):
    monkeypatch.setenv("MEGATRON_ID_KERNEL_LOCK_TIMEOUT", value)
    with pytest.raises(BadOptionError, match=rf"MEGATRON_ID_KERNEL_LOCK_TIMEOUT='{value}': give the seconds to wait"):
        cpu_kernel.fixed_state_step_kernel.__wrapped__()
