"""Generation: decode latency per token against the prefix length, and peak prefill memory with
and without chunked prefill.

    python benchmarks/generation.py            # ~5 minutes on 2 cores

Model: a small width (d 256, 4 heads, 4 layers, M 64, GPT-2 vocabulary), random weights (latency
and memory do not depend on the values), batch 1, fp32, on this CPU with 2 threads. Each cell
runs in a fresh process (so peak RSS is its own):
  decode   prefill a random prefix of N tokens (chunks of 2,048), then time 32 decode steps
           (one token each, the model's own state / KV cache); the median per token.
  prefill  a 16K-token prompt in one call vs chunks of 1,024 tokens; peak RSS of the process
           (CUDA: max allocated), minus the RSS after building the model.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from allocator import ALLOCATOR_ENV  # noqa: E402  (benchmarks/allocator.py, beside this file)
PREFIXES = [512, 1024, 2048, 4096, 8192, 16384]
MIXERS = ["interdomain", "softmax"]


def build(mixer: str):
    import torch
    from megatron_id.config import load_config
    from megatron_id.model import LanguageModel
    cfg = load_config([ROOT / "configs/model/tiny.yaml"], [
        f"model.mixer={mixer}", "model.d_model=256", "model.n_heads=4", "model.n_layers=4",
        "model.state_size=64", "model.vocab_size=50257", "model.seq_length=2048"]).model
    torch.manual_seed(0)
    return LanguageModel(cfg, seed=0).eval()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cell(kind: str, mixer: str, n: int, chunk: int) -> dict:
    import torch
    torch.set_num_threads(2)
    model = build(mixer)
    base = rss_mib()
    tokens = torch.randint(0, 50257, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = None
        for start in range(0, n, chunk):
            logits, states = model(tokens[:, start:start + chunk], states=states, return_states=True)
        if kind == "prefill":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            return {"peak_mib": peak - base}
        times, token = [], logits[:, -1:].argmax(-1)
        for _ in range(32):
            start = time.perf_counter()
            logits, states = model(token, states=states, return_states=True)
            times.append(time.perf_counter() - start)
            token = logits[:, -1:].argmax(-1)
    return {"decode_ms": 1000 * statistics.median(times[4:])}


def run(kind: str, mixer: str, n: int, chunk: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--cell", kind, mixer, str(n), str(chunk)],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **ALLOCATOR_ENV, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--cell"]:
        kind, mixer, n, chunk = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(cell(kind, mixer, n, chunk)))
        return
    print("## decode latency per token (4 layers, d 256, batch 1, median of 28 steps)\n")
    print("| prefix | " + " | ".join(MIXERS) + " |")
    print("|---|" + "---|" * len(MIXERS))
    for n in PREFIXES:
        row = [f"{run('decode', m, n, 2048)['decode_ms']:.2f} ms" for m in MIXERS]
        print(f"| {n:,} | " + " | ".join(row) + " |", flush=True)
    print("\n## peak prefill memory above the model, 16K-token prompt\n")
    print("| mixer | one call | chunks of 1,024 |")
    print("|---|---|---|")
    for m in MIXERS:
        full, chunked = run("prefill", m, 16384, 16384), run("prefill", m, 16384, 1024)
        print(f"| {m} | {full['peak_mib']:,.0f} MiB | {chunked['peak_mib']:,.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
