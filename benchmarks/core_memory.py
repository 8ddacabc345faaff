"""Peak memory and time of one mixer layer's forward + backward at long contexts, 125M width
(d=768, 12 heads, M=64, chunk 64, batch 1): the interdomain layer with the recomputing backward
(model.core_impl=recompute, the default from 8K tokens), the same layer with autograd keeping
every intermediate (core_impl=autograd), causal SDPA (the softmax layer), and optionally the
interdomain layer of another checkout (--baseline-tree: e.g. the commit before the
recomputing backward, `git worktree add /tmp/before <commit>`).

    python benchmarks/core_memory.py                                   # ~6 min on 2 cores
    python benchmarks/core_memory.py --baseline-tree /tmp/before --lengths 4096,16384

Every cell runs in a fresh subprocess. Memory, two ways (CPU): peak RSS above the RSS before
the first call (what the OS gives the process, glibc's heap growth included), and peak live
heap bytes above those before the timed call (glibc mallinfo2 sampled every 0.5 ms: the
analogue of CUDA's max_memory_allocated; CUDA reports max allocated for both columns).
Times: minimum over --reps calls after a warm-up call.
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

GiB = 2 ** 30


def worker(kind: str, N: int, reps: int, device_name: str, tree: str) -> dict:
    sys.path.insert(0, tree)
    import torch

    from megatron_id.config import load_config
    from megatron_id.model.init import initialize
    from megatron_id.model.mixers import build_mixer
    device = torch.device(device_name)
    over = {"recompute": ["model.mixer=interdomain", "model.core_impl=recompute"],
            "autograd": ["model.mixer=interdomain", "model.core_impl=autograd"],
            "baseline": ["model.mixer=interdomain"], "softmax": ["model.mixer=softmax"]}[kind]
    cfg = load_config([Path(tree) / "configs/model/125m.yaml"], over).model
    layer = build_mixer(cfg, cfg.init_std)
    initialize(layer, 0)
    layer.to(device)
    x = torch.randn(1, N, cfg.d_model, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    from measure import peak_and_time  # (beside this file)
    return peak_and_time(lambda: layer(x).square().mean().backward(), reps, device)


def run_cell(kind, N, reps, device, tree):
    env = {**os.environ, **(ALLOCATOR_ENV if device == "cpu" else {})}
    out = subprocess.run([sys.executable, __file__, "--worker", kind, str(N), str(reps), device, tree],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark cell {kind} N={N} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096,8192,16384")
    parser.add_argument("--long", type=int, default=32768, help="a length for the recomputing layer alone (0: none)")
    parser.add_argument("--baseline-tree", default=None, help="another checkout whose interdomain layer to time")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default=None)
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, n, reps, device, tree = args.worker
        print(json.dumps(worker(kind, int(n), int(reps), device, tree)))
        return 0
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.baseline_tree and not (Path(args.baseline_tree) / "megatron_id").is_dir():
        parser.error(f"--baseline-tree {args.baseline_tree}: no megatron_id package there "
                     "(make one with: git worktree add /tmp/before <commit>)")
    lengths = [int(v) for v in args.lengths.split(",")]
    kinds = ["recompute", "autograd", "softmax"] + (["baseline"] if args.baseline_tree else [])
    res = {}
    for N in lengths:
        for kind in kinds:
            tree = args.baseline_tree if kind == "baseline" else str(ROOT)
            res[kind, N] = run_cell(kind, N, args.reps, device, tree)
            print(f"  measured {kind:>9} N={N:>6}: {res[kind, N]['time']:.2f} s", file=sys.stderr)
    if args.long:
        res["recompute", args.long] = run_cell("recompute", args.long, 1, device, str(ROOT))
    print(f"# one layer, forward + backward, 125M width, batch 1, {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    ref = "baseline" if args.baseline_tree else "autograd"
    cols = kinds
    print("| N | " + " | ".join(f"{k} time | {k} peak RSS | {k} peak live" for k in cols) +
          f" | recompute / {ref} time |")
    print("|---|" + "---|---|---|" * len(cols) + "---|")
    for N in lengths + ([args.long] if args.long else []):
        cells = []
        for k in cols:
            r = res.get((k, N))
            cells += ["-"] * 3 if r is None else [f"{r['time']:.2f} s", f"{r['rss'] / 2**20:.0f} MiB",
                                                   f"{r['live'] / 2**20:.0f} MiB"]
        ratio = res[("recompute", N)]["time"] / res[(ref, N)]["time"] if (ref, N) in res else None
        print(f"| {N} | " + " | ".join(cells) + f" | {'-' if ratio is None else f'{ratio:.2f}x'} |")

    print("\n## acceptance checks (issue 15)\n")
    checks = []
    if ("recompute", 16384) in res:
        r, s = res["recompute", 16384], res["softmax", 16384]
        checks.append((f"16K peak RSS: recompute {r['rss'] / 2**20:.0f} MiB <= SDPA {s['rss'] / 2**20:.0f} MiB",
                       r["rss"] <= s["rss"]))
        checks.append((f"16K peak live: recompute {r['live'] / 2**20:.0f} MiB vs SDPA {s['live'] / 2**20:.0f} MiB "
                       "(reported; CUDA's measure)", True))
        t = r["time"] / res[ref, 16384]["time"]
        checks.append((f"16K time: recompute {t:.2f}x the {ref} layer (<= 1.2)", t <= 1.2))
    if args.long:
        r = res["recompute", args.long]
        checks.append((f"{args.long // 1024}K runs: peak RSS {r['rss'] / GiB:.1f} GiB (< 24 GiB)", r["rss"] < 24 * GiB))
    for text, ok in checks:
        print(f"- {'PASS' if ok else 'FAIL'}: {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
