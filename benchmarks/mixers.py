"""Benchmark one mixer layer at 125M width (d=768, 12 heads, M=64): forward+backward time and
peak memory against sequence length, the chunked form against the naive recurrence, decode-step
latency against prefix length, and achieved GFLOP/s against a measured matmul peak.

    python benchmarks/mixers.py                      # the full table (about 10 min on 2 cores)
    python benchmarks/mixers.py --lengths 512,2048 --naive-max 1024 --decode 512,4096   # quick

Every cell runs in a fresh subprocess, so peak memory is that cell's own (CUDA: max allocated;
CPU: peak RSS above the RSS before the first call). On CPU the subprocesses raise glibc's
mmap/trim thresholds so freed memory is reused instead of being returned to the OS and
page-faulted in again on every call; without that, page faults (expensive in small VMs) made
long sequences look superlinear for every mixer. Intel's PyTorch CPU tuning guide gives the same
advice (jemalloc/tcmalloc). Times are the minimum over --reps calls after one warm-up call.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from allocator import ALLOCATOR_ENV  # noqa: E402  (benchmarks/allocator.py, beside this file)

# interdomain = the layer as configured (model.core_impl=auto); recompute / autograd / triton =
# the same layer with that core_impl forced (triton: CUDA only); naive = the naive form
LAYER_KINDS = ["interdomain", "recompute", "s4d", "softmax", "naive"]
CORE_IMPL_KINDS = ("recompute", "autograd", "triton")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _config(kind: str, device):
    from megatron_id.config import load_config
    if kind in CORE_IMPL_KINDS:
        return load_config([ROOT / "configs/model/125m.yaml"], [f"model.core_impl={kind}"]).model
    mixer = "interdomain" if kind in ("naive", "core_chunked", "core_naive") else kind
    return load_config([ROOT / "configs/model/125m.yaml"], [f"model.mixer={mixer}"]).model


def _timed(fn, reps: int, device, warmup: bool):
    import torch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()   # memory baseline before the first call: model and inputs exist, activations not yet
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.max_memory_allocated()
    else:
        base = _rss_bytes()
    if warmup:
        fn()
        sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return best, max(peak, 0)


def worker_train(kind: str, N: int, reps: int, device_name: str) -> dict:
    """Forward+backward of one layer (kinds in LAYER_KINDS) or of the core alone (core_*)."""
    import torch

    from megatron_id.model.init import initialize
    from megatron_id.model.mixers import build_mixer
    from megatron_id.ops.interdomain import FORMS
    device = torch.device(device_name)
    cfg = _config(kind, device)
    g = torch.Generator().manual_seed(0)
    if kind.startswith("core_"):
        H, Dh = cfg.n_heads, cfg.d_model // cfg.n_heads
        layer = build_mixer(cfg, cfg.init_std)
        initialize(layer, 0)
        params = [p.detach().to(device).requires_grad_() for p in layer.core_parameters()]
        q, k, v = (torch.randn(1, N, H, Dh, generator=g).to(device).requires_grad_() for _ in range(3))
        form = kind.split("_", 1)[1]
        kw = dict(chunk_size=cfg.chunk_size) if form == "chunked" else {}
        fn = lambda: FORMS[form](q, k, v, *params, **kw)[0].square().mean().backward()
    else:
        layer = build_mixer(cfg, cfg.init_std, form="naive" if kind == "naive" else "chunked")
        initialize(layer, 0)
        layer.to(device)
        x = torch.randn(1, N, cfg.d_model, generator=g).to(device).requires_grad_()
        fn = lambda: layer(x).square().mean().backward()
    slow = kind in ("naive", "core_naive")
    t, mem = _timed(fn, 1 if slow else reps, device, warmup=not slow)
    return {"time": t, "memory": mem}


def worker_decode(kind: str, L: int, reps: int, device_name: str) -> dict:
    """Latency of one decode step of one layer after a prefix of L tokens (batch 1)."""
    import torch

    from megatron_id.model.init import initialize
    from megatron_id.model.mixers import build_mixer
    device = torch.device(device_name)
    cfg = _config(kind, device)
    layer = build_mixer(cfg, cfg.init_std)
    initialize(layer, 0)
    layer.to(device).eval()
    H, Dh = cfg.n_heads, cfg.d_model // cfg.n_heads
    x = torch.randn(1, 1, cfg.d_model, device=device)
    with torch.no_grad():
        if kind == "softmax":   # a KV cache holding L tokens
            state = {"k": torch.randn(1, L, H, Dh, device=device),
                     "v": torch.randn(1, L, H, Dh, device=device), "pos": L}
        else:                   # the state after any prefix has the same size; build it by prefill
            _, state = layer(torch.randn(1, min(L, 256), cfg.d_model, device=device), return_state=True)
            state["pos"] = L
        layer(x, state=state, return_state=True)   # builds the cached step tables
        t, _ = _timed(lambda: layer(x, state=state, return_state=True), reps, device, warmup=True)
    return {"time": t}


def matmul_peak(device_name: str) -> float:
    import torch
    device = torch.device(device_name)
    a, b = (torch.randn(2048, 2048, device=device) for _ in range(2))
    t, _ = _timed(lambda: a @ b, 5, device, warmup=True)
    return 2 * 2048 ** 3 / t / 1e9


def run_cell(mode: str, kind: str, n: int, reps: int, device: str) -> dict:
    env = {**os.environ, **(ALLOCATOR_ENV if device == "cpu" else {})}
    cmd = [sys.executable, __file__, "--worker", mode, kind, str(n), str(reps), device]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark cell {mode} {kind} N={n} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt_time(t):
    return "-" if t is None else (f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s")


def fmt_mem(b):
    return "-" if b is None else f"{b / 2**20:.0f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--naive-max", type=int, default=4096, help="longest N for the naive form")
    parser.add_argument("--decode", default="512,2048,8192,16384", help="prefix lengths")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, kind, n, reps, device = args.worker
        fn = worker_train if mode == "train" else worker_decode
        print(json.dumps(fn(kind, int(n), int(reps), device)))
        return 0

    import torch

    from megatron_id.model.accounting import mixer_forward_flops_per_token
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":   # the fused kernel and the PyTorch form it replaces, side by side
        LAYER_KINDS[1:1] = ["autograd", "triton"]
    lengths = [int(x) for x in args.lengths.split(",")]
    decode_lengths = [int(x) for x in args.decode.split(",")]
    print(f"# mixer layer benchmark, 125M width (d=768, H=12, M=64, chunk 64), batch 1, {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    res = {}
    for N in lengths:
        for kind in LAYER_KINDS + ["core_chunked", "core_naive"]:
            if "naive" in kind and N > args.naive_max:
                continue
            res[kind, N] = run_cell("train", kind, N, args.reps, device)
            print(f"  measured {kind:>12} N={N:>6}: {fmt_time(res[kind, N]['time'])}", file=sys.stderr)

    get = lambda kind, N, key="time": res.get((kind, N), {}).get(key)
    print("\n## forward + backward time of one layer (growth: time(N) / time(previous N))\n")
    print("| N | " + " | ".join(f"{k} | growth" for k in LAYER_KINDS) + " |")
    print("|---|" + "---|---|" * len(LAYER_KINDS))
    for i, N in enumerate(lengths):
        cells = []
        for kind in LAYER_KINDS:
            t, prev = get(kind, N), get(kind, lengths[i - 1]) if i else None
            cells += [fmt_time(t), f"{t / prev:.2f}x" if t and prev else ""]
        print(f"| {N} | " + " | ".join(cells) + " |")

    print("\n## peak memory of one layer's forward + backward\n")
    print("| N | " + " | ".join(LAYER_KINDS) + " |")
    print("|---|" + "---|" * len(LAYER_KINDS))
    for N in lengths:
        print(f"| {N} | " + " | ".join(fmt_mem(get(k, N, "memory")) for k in LAYER_KINDS) + " |")

    print("\n## the core alone (no projections): chunked form vs naive recurrence, forward + backward\n")
    print("| N | chunked | naive | naive / chunked |")
    print("|---|---|---|---|")
    for N in lengths:
        c, n = get("core_chunked", N), get("core_naive", N)
        print(f"| {N} | {fmt_time(c)} | {fmt_time(n)} | {f'{n / c:.1f}x' if c and n else '-'} |")

    peak = matmul_peak(device)
    cfg = _config("interdomain", None)
    flops_token = 3 * mixer_forward_flops_per_token(cfg)
    print("\n## achieved throughput of the interdomain layer (chunked), forward + backward\n")
    print(f"measured fp32 matmul peak (2048^3): {peak:.0f} GFLOP/s; layer FLOPs per token "
          f"(3 x forward, as `megatron-id params` counts them): {flops_token / 1e6:.1f} MFLOP\n")
    print("| N | GFLOP/s | % of matmul peak |")
    print("|---|---|---|")
    for N in lengths:
        t = get("interdomain", N)
        if t:
            g = flops_token * N / t / 1e9
            print(f"| {N} | {g:.0f} | {100 * g / peak:.0f}% |")

    print("\n## decode: one step of one layer after a prefix of L tokens (batch 1)\n")
    kinds = ["interdomain", "s4d", "softmax"]
    dec = {(k, L): run_cell("decode", k, L, 50, device)["time"] for L in decode_lengths for k in kinds}
    print("| prefix L | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for L in decode_lengths:
        print(f"| {L} | " + " | ".join(f"{dec[k, L] * 1e3:.2f} ms" for k in kinds) + " |")

    print("\n## acceptance checks (issue 2)\n")
    checks = []
    if get("interdomain", 16384) and get("interdomain", 2048):
        r = get("interdomain", 16384) / get("interdomain", 2048)
        checks.append((f"interdomain time(16K)/time(2K) = {r:.1f} <= 10 (linear: 8)", r <= 10))
        s = get("softmax", 16384) / get("softmax", 2048)
        checks.append((f"softmax time(16K)/time(2K) = {s:.1f} (quadratic attention: towards 64)", s > r))
    if get("core_naive", 4096) and get("core_chunked", 4096):
        r = get("core_naive", 4096) / get("core_chunked", 4096)
        checks.append((f"core at 4K: chunked is {r:.1f}x faster than the naive recurrence (>= 20)", r >= 20))
        r2 = get("naive", 4096) / get("interdomain", 4096)
        print(f"(whole layer at 4K, projections included: chunked {r2:.1f}x faster than naive)")
    if get("interdomain", 8192) and get("softmax", 8192):
        r = get("softmax", 8192) / get("interdomain", 8192)
        checks.append((f"at 8K the interdomain layer is {r:.2f}x the speed of causal SDPA (> 1)", r > 1))
    for text, ok in checks:
        print(f"- {'PASS' if ok else 'FAIL'}: {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
