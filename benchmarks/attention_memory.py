"""Peak memory and time of document-aware causal attention, forward + backward, at long
contexts (125M head shapes: 12 heads of 64, batch 1, float32, packed documents of 1/3 of the
sequence each): the dense-mask SDPA the softmax mixer used before (ops/attention.masked_attention,
a [1, 1, N, N] boolean mask that SDPA turns into a float one), the blockwise form that replaced
it on CPU (blockwise_attention), the same with a 1,024-token window (a W layer), and causal SDPA
without documents (the floor: what the flash kernel needs).

    python benchmarks/attention_memory.py                        # ~3 min on 2 cores
    python benchmarks/attention_memory.py --lengths 4096,16384

Every cell runs in a fresh subprocess (glibc's settings of benchmarks/allocator.py). Memory
above what q, k, v held before the timed calls, and time, as benchmarks/measure.py takes them:
peak RSS, peak live heap bytes (CUDA: max allocated), the minimum time over --reps calls.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from allocator import ALLOCATOR_ENV  # noqa: E402  (beside this file)

KINDS = ["dense", "blockwise", "window", "causal"]


def worker(kind: str, N: int, reps: int, device_name: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn.functional as F

    from megatron_id.ops.attention import blockwise_attention, causal_attention, masked_attention
    device = torch.device(device_name)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, N, 64, generator=g).to(device).requires_grad_() for _ in range(3))
    seq = (torch.arange(N, device=device) * 3 // N)[None]   # three documents
    op = {"dense": lambda: masked_attention(q, k, v, seq),
          "blockwise": lambda: (causal_attention if device.type == "cuda" else blockwise_attention)(q, k, v, seq),
          "window": lambda: (causal_attention if device.type == "cuda" else blockwise_attention)(q, k, v, seq, 1024),
          "causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}[kind]
    from measure import peak_and_time  # (beside this file)

    def drop_grads():
        for t in (q, k, v):
            t.grad = None
    return peak_and_time(lambda: op().sum().backward(), reps, device, after_call=drop_grads)


def run_cell(kind, N, reps, device):
    env = {**os.environ, **(ALLOCATOR_ENV if device == "cpu" else {})}
    out = subprocess.run([sys.executable, __file__, "--worker", kind, str(N), str(reps), device],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark cell {kind} N={N} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default=None)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, n, reps, device = args.worker
        print(json.dumps(worker(kind, int(n), int(reps), device)))
        return 0
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        lengths = [int(v) for v in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths {args.lengths}: give comma-separated token counts, e.g. 4096,16384")
    if not lengths or min(lengths) < 2:
        parser.error(f"--lengths {args.lengths}: every length must be at least 2")
    res = {}
    for N in lengths:
        for kind in KINDS:
            res[kind, N] = run_cell(kind, N, args.reps, device)
            print(f"  measured {kind:>9} N={N:>6}: {res[kind, N]['time']:.2f} s", file=sys.stderr)
    print(f"# causal attention with 3 packed documents, forward + backward, 12 heads x 64, batch 1, float32, "
          f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| N | " + " | ".join(f"{k} time | {k} peak RSS | {k} peak live" for k in KINDS) +
          " | blockwise / dense peak live |")
    print("|---|" + "---|---|---|" * len(KINDS) + "---|")
    for N in lengths:
        cells = []
        for k in KINDS:
            r = res[k, N]
            cells += [f"{r['time']:.2f} s", f"{r['rss'] / 2**20:.0f} MiB", f"{r['live'] / 2**20:.0f} MiB"]
        ratio = res["blockwise", N]["live"] / max(res["dense", N]["live"], 1)
        print(f"| {N} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    if 16384 not in lengths:
        return 0
    print("\n## acceptance check (issue 27)\n")
    b, d = res["blockwise", 16384], res["dense", 16384]
    checks = [(f"16K with documents: blockwise peak live {b['live'] / 2**20:.0f} MiB < 0.25 x dense "
               f"{d['live'] / 2**20:.0f} MiB", b["live"] < 0.25 * d["live"]),
              (f"16K with documents: blockwise peak RSS {b['rss'] / 2**20:.0f} MiB < 0.25 x dense "
               f"{d['rss'] / 2**20:.0f} MiB", b["rss"] < 0.25 * d["rss"])]
    for text, ok in checks:
        print(f"- {'PASS' if ok else 'FAIL'}: {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
