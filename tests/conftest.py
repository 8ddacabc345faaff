import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = ROOT / "configs"

torch.set_num_threads(min(2, os.cpu_count() or 1))
# The Triton kernels (ops/interdomain/triton_chunked.py) run under Triton's CPU interpreter in
# the tests; the flag is read when the kernels are defined, so it is set before any import.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The fused decode step's C++ kernel (megatron_id/inference/cpu_kernel.py) is built into a folder
# of this session, not the user's cache, so that every run proves it builds from source (~10 s,
# once: subprocesses inherit the folder, and those that import this file make none of their own).
if "TORCH_EXTENSIONS_DIR" not in os.environ:
    os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="megatron-id-extensions-")
    atexit.register(shutil.rmtree, os.environ["TORCH_EXTENSIONS_DIR"], ignore_errors=True)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the whole tensor (complex allowed); 0 when both are zero."""
    a, b = a.detach(), b.detach()
    denom = b.abs().pow(2).sum().sqrt().item()
    num = (a - b).abs().pow(2).sum().sqrt().item()
    return num if denom == 0 else num / denom


def copy_without_reshardable_optimizer(checkpoint: Path, tag: str, folder: Path) -> Path:
    """A copy of `checkpoint` as a run without train.reshardable_optimizer writes it: its
    iter folder `tag` without optim/ and without optim/'s entries in the manifest."""
    import json
    import shutil
    shutil.copytree(checkpoint, folder)
    shutil.rmtree(folder / tag / "optim")
    manifest = folder / tag / "manifest.json"
    entries = json.loads(manifest.read_text())
    entries["files"] = {k: v for k, v in entries["files"].items() if not k.startswith("optim/")}
    manifest.write_text(json.dumps(entries))
    return folder


@pytest.fixture
def tiny_config():
    from megatron_id.config import load_config

    def make(*overrides):
        return load_config([CONFIGS / "model" / "tiny.yaml"], list(overrides)).model
    return make


@pytest.fixture(scope="session")
def fineweb_prefix(tmp_path_factory):
    """The bundled FineWeb-Edu sample preprocessed with the GPT-2 tokenizer (once per session)."""
    from data_tools.preprocess import main as preprocess
    out = tmp_path_factory.mktemp("data") / "fineweb"
    assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"),
                       "--tokenizer", str(ROOT / "tests/data/gpt2-tokenizer.json"),
                       "--output-prefix", str(out), "--append-eod", "--no-progress"]) == 0
    return f"{out}_text_document"


# The compile matrix of tests/test_gpu_readiness.py (every shipped config's Triton kernels for
# sm_80 and sm_90: ~5 CPU-minutes of LLVM and ptxas) starts in the background when that test is
# collected, at the lowest priority, so that it takes the CPU the suite leaves idle (processes
# waiting on sockets, sleeps, spawn) rather than 2.5 minutes of wall time; the test waits for it.
_MATRIX: dict = {}


def _compile_env(cache_dir) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # triton 3.9's default, without its warning
    return env


def pytest_collection_finish(session):
    import subprocess
    import tempfile
    if not any(item.nodeid.startswith("tests/test_gpu_readiness.py::test_every_shipped_config")
               for item in session.items):
        return
    folder = Path(tempfile.mkdtemp(prefix="megatron-id-kernels-"))
    (folder / "cache").mkdir()
    _MATRIX.update(folder=folder, out=folder / "rows.json", log=open(folder / "stdout", "w"),
                   err=open(folder / "stderr", "w"))
    _MATRIX["process"] = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-m", "megatron_id.ops.interdomain.resources", "--jobs", "2",
         "--json", str(_MATRIX["out"])], cwd=ROOT, env=_compile_env(folder / "cache"),
        stdout=_MATRIX["log"], stderr=_MATRIX["err"], stdin=subprocess.DEVNULL)


def pytest_unconfigure(config):
    import shutil
    if "process" in _MATRIX:
        if _MATRIX["process"].poll() is None:
            _MATRIX["process"].kill()
        _MATRIX["log"].close()
        _MATRIX["err"].close()
        shutil.rmtree(_MATRIX["folder"], ignore_errors=True)


def compile_matrix(timeout: float):
    """(returncode, stdout, stderr, rows) of the background compile matrix, or None when it was
    not started (the readiness test was not collected)."""
    import json
    if "process" not in _MATRIX:
        return None
    code = _MATRIX["process"].wait(timeout=timeout)
    _MATRIX["log"].flush()
    _MATRIX["err"].flush()
    rows = json.loads(_MATRIX["out"].read_text()) if _MATRIX["out"].exists() else []
    return code, (_MATRIX["folder"] / "stdout").read_text(), (_MATRIX["folder"] / "stderr").read_text(), rows


@pytest.fixture(scope="session")
def kernel_compile_env(tmp_path_factory):
    """The environment of a subprocess that compiles the Triton kernels for a GPU (never under
    the interpreter), with one Triton cache for the session (the background matrix's)."""
    return _compile_env(_MATRIX["folder"] / "cache" if _MATRIX else tmp_path_factory.mktemp("triton-cache"))


@pytest.fixture(scope="session")
def gpu_check_dry_run(kernel_compile_env, tmp_path_factory):
    """`bash launch/gpu_check.sh --dry-run` once per session: (completed process, its folder).
    tests/test_gpu_readiness.py checks its steps, tests/test_gpu_benchmark.py the benchmark's
    tables it printed (benchmarks/gpu.py --device cpu --quick)."""
    import subprocess
    out = tmp_path_factory.mktemp("gpu-check") / "check"
    done = subprocess.run(["bash", "launch/gpu_check.sh", "--dry-run", str(out)], cwd=ROOT,
                          env={**kernel_compile_env, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=900, stdin=subprocess.DEVNULL)
    return done, out
