"""Peak memory and time of the LM head's forward+backward with its loss: plain (the whole
[tokens, vocabulary] logits, then the vocab-parallel cross entropy; what train.fused_lm_head_loss=false
runs) against fused (parallel/fused_cross_entropy.py, chunked over tokens), at 4K tokens,
d=768 (125M) and GPT-2's vocabulary of 50,257 padded to 50,304 (the trainer's padding at TP=1).

    python benchmarks/lm_head_memory.py                           # the table (~6 min on 2 cores)
    python benchmarks/lm_head_memory.py --tokens 1024 --reps 1 --chunks default   # quick

Every cell runs in a fresh subprocess, measured as benchmarks/mixers.py measures its cells
(its `_timed`): peak memory is CUDA's max_memory_allocated, or on CPU the peak RSS above the
RSS once the inputs (h, the weight, the targets) exist, with the glibc settings of
benchmarks/allocator.py. Both paths make the weight's gradient (154 MiB in float32) and h's;
both are in the peak. Times are the minimum over --reps calls after one warm-up call.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from allocator import ALLOCATOR_ENV  # noqa: E402  (beside this file)
from mixers import _timed, fmt_mem, fmt_time  # noqa: E402  (the repository's cell measurement)

D, VOCAB, PADDED = 768, 50_257, 50_304


def worker(kind: str, tokens: int, chunk: int | None, precision: str, reps: int, device_name: str) -> dict:
    import torch

    from megatron_id.parallel.fused_cross_entropy import fused_lm_head_loss, naive_lm_head_loss
    device = torch.device(device_name)
    g = torch.Generator().manual_seed(0)
    # made without temporaries: freed memory stays resident (allocator.py) and would sit in the baseline
    h = torch.randn(tokens, D, generator=g).to(device).requires_grad_()
    w = torch.randn(PADDED, D, generator=g).mul_(0.02).to(device).requires_grad_()
    target = torch.randint(0, VOCAB, (tokens,), generator=g).to(device)

    def step():
        h.grad = w.grad = None   # as the optimizer's zero_grad(set_to_none=True): one set of grads
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            if kind == "plain":
                loss = naive_lm_head_loss(h, w, target, None, VOCAB)
            else:
                loss = fused_lm_head_loss(h, w, target, None, VOCAB, chunk_size=chunk)
        loss.backward()
        return loss

    seconds, memory = _timed(step, reps, device, warmup=True)
    return {"time": seconds, "memory": memory, "loss": step().item()}


def run_cell(kind, tokens, chunk, precision, reps, device) -> dict:
    env = {**os.environ, **(ALLOCATOR_ENV if device == "cpu" else {})}
    cmd = [sys.executable, __file__, "--worker", kind, str(tokens), str(chunk or 0), precision, str(reps), device]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"cell {kind} {precision} chunk={chunk} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (B x N)")
    parser.add_argument("--precisions", default="fp32,bf16", help="fp32 and/or bf16 (autocast)")
    parser.add_argument("--chunks", default="default,128,1024",
                        help="fused chunk sizes in tokens ('default': CHUNK_ELEMENTS logits per chunk)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, tokens, chunk, precision, reps, device = args.worker
        print(json.dumps(worker(kind, int(tokens), int(chunk) or None, precision, int(reps), device)))
        return 0

    import torch

    from megatron_id.parallel.fused_cross_entropy import default_chunk_size
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    T = args.tokens
    print(f"LM head + loss, forward+backward: {T} tokens, d={D}, vocabulary {VOCAB:,} (padded {PADDED:,}), "
          f"{device}, {torch.get_num_threads()} threads; float32 logits alone: {fmt_mem(T * PADDED * 4)}")
    print(f"{'path':<8}{'precision':>10}{'chunk':>8}{'time':>12}{'peak memory':>14}{'vs plain':>10}{'loss':>10}")
    for precision in args.precisions.split(","):
        plain = run_cell("plain", T, None, precision, args.reps, device)
        rows = [("plain", "-", plain)]
        for c in args.chunks.split(","):
            chunk = default_chunk_size(PADDED) if c == "default" else int(c)
            rows.append(("fused", f"{chunk}" + ("*" if c == "default" else ""),
                         run_cell("fused", T, chunk, precision, args.reps, device)))
        for path, chunk, cell in rows:
            ratio = plain["memory"] / cell["memory"] if cell["memory"] else float("inf")
            print(f"{path:<8}{precision:>10}{chunk:>8}{fmt_time(cell['time']):>12}{fmt_mem(cell['memory']):>14}"
                  f"{ratio:>9.1f}x{cell['loss']:>10.4f}", flush=True)
    print("* the default chunk (parallel/fused_cross_entropy.py CHUNK_ELEMENTS); memory: peak above the inputs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
