"""The fused decode step (megatron_id/inference/fused_decode.py) against the model's own step and
against softmax, at 125M width (d 768, 12 heads, M 64), fp32, on this CPU (issue 31).

    python benchmarks/decode_step.py                  # ~6 minutes on 2 cores
    python benchmarks/decode_step.py --quick          # 512 and 8K only, no compile

One layer's mixer step (the table benchmarks/mixers.py prints, now with the fused rows) at
batch 1 and 8 and prefixes 512 to 16K, then the whole 125M model's step at batch 1. The
decode cost does not depend on the state's values, so the states are random numbers of the
sizes a prefix of L tokens leaves (an interdomain state is the same size for every L; a
softmax KV cache holds L tokens). Each time is the median of --reps steps after warm-up; both
mixers run in the same process, one after the other, with the same thread count.

Rows: interdomain "own" is InterdomainMixer.forward with a state (today's recurrent form),
"fused" the fused step in torch ops, "C++" the fused step with its core as one C++ call
(inference/cpu_kernel.py: what FusedDecoder takes on a CPU), "compiled" the torch ops under
torch.compile; softmax "own" is
SoftmaxAttention.forward with its KV cache (a concatenation per token), "fused" the fused step
(a preallocated cache). The checks compare interdomain's best against softmax's best.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from allocator import ALLOCATOR_ENV  # noqa: E402

if any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items()):   # (they must be set before malloc starts)
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})

import torch  # noqa: E402

from megatron_id.config import load_config  # noqa: E402
from megatron_id.inference.fused_decode import FusedDecoder, fixed_state_mixer, fixed_state_mixer_kernel  # noqa: E402
from megatron_id.model import LanguageModel  # noqa: E402


def timed(fn, reps: int) -> float:
    """Median seconds of one call, after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(mixer: str, layers: int, vocab: int):
    cfg = load_config([ROOT / "configs/model/125m.yaml"], [f"model.mixer={mixer}", f"model.n_layers={layers}",
                                                            f"model.vocab_size={vocab}"]).model
    torch.manual_seed(0)
    return cfg, LanguageModel(cfg, seed=0).eval()


def random_states(cfg, model, batch: int, L: int) -> list:
    """Every layer's state after a prefix of L tokens, as the model's forward returns it."""
    H, Dh, M = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.state_size
    states = []
    for block in model.layers:
        if cfg.mixer.value == "softmax":
            states.append({"k": torch.randn(batch, L, H, Dh), "v": torch.randn(batch, L, H, Dh), "pos": L})
        else:
            convs = {name: torch.randn(batch, cfg.d_model, cfg.conv_kernel - 1)
                     for name in ("q_conv", "k_conv")}
            states.append({"ssm": 0.1 * torch.randn(batch, H, M, 2 * Dh, dtype=torch.complex64),
                           "conv": convs, "pos": L})
    return states


def one_row(states, row: int) -> list:
    pick = {"ssm": lambda t: t[row:row + 1], "k": lambda t: t[row:row + 1], "v": lambda t: t[row:row + 1]}
    out = []
    for s in states:
        r = {k: (pick[k](v) if k in pick else v) for k, v in s.items() if k != "conv"}
        if "conv" in s:
            r["conv"] = {k: v[row:row + 1] for k, v in s["conv"].items()}
        out.append(r)
    return out


def fused_decoder(model, states, batch: int, L: int, compile: bool = False, kernel: str = "auto"):
    dec = FusedDecoder(model, slots=batch, capacity=L + 8, compile=compile, kernel=kernel)
    for row in range(batch):
        dec.load(row, one_row(states, row), L)
    return dec


def layer_rows(batch: int, L: int, reps: int, compile: bool) -> dict:
    """Seconds per step of one layer's mixer, each way."""
    out = {}
    x = torch.randn(batch, 768)
    with torch.no_grad():
        for mixer in ("interdomain", "softmax"):
            cfg, model = build(mixer, 1, 64)
            states = random_states(cfg, model, batch, L)
            layer = model.layers[0].mixer
            own = dict(states[0])
            if mixer == "interdomain":
                layer(x[:, None], state=own, return_state=True)   # builds the cached step tables
            out[(mixer, "own")] = timed(lambda: layer(x[:, None], state=own, return_state=True), reps)
            dec = fused_decoder(model, states, batch, L)
            fused = dec.layers[0]
            angles = dec.positions.float()[:, None] * next(iter(dec.rope_tables.values()))
            rope = (angles.cos()[:, None, :], angles.sin()[:, None, :])
            if mixer == "interdomain":
                out[(mixer, "fused")] = timed(lambda: fixed_state_mixer(x, rope, fused.tensors, fused.static), reps)
                kernel = fused_decoder(model, states, batch, L, kernel="cpp")
                core = kernel.layers[0]
                out[(mixer, "C++")] = timed(
                    lambda: fixed_state_mixer_kernel(x, rope, core.tensors, core.static, kernel.core), reps)
                if compile:
                    step = torch.compile(fixed_state_mixer, dynamic=False)
                    compiled = fused_decoder(model, states, batch, L, compile=True).layers[0]
                    out[(mixer, "compiled")] = timed(lambda: step(x, rope, compiled.tensors, compiled.static), reps)
            else:
                lengths = [L + 1] * batch
                out[(mixer, "fused")] = timed(lambda: fused.mixer(x, rope, dec.positions, lengths), reps)

    return out


def model_rows(L: int, reps: int, compile: bool) -> dict:
    """Seconds per step of the whole 125M model (GPT-2 vocabulary), batch 1."""
    out = {}
    for mixer in ("interdomain", "softmax"):
        cfg, model = build(mixer, 12, 50257)
        states = random_states(cfg, model, 1, L)
        token = torch.zeros(1, dtype=torch.long)
        with torch.no_grad():
            own = [dict(s) for s in states]
            tok = token[:, None]
            out[(mixer, "own")] = timed(lambda: model(tok, states=own, return_states=True), reps)
            ways = ["fused", "C++"] + (["compiled"] if compile else []) if mixer == "interdomain" else ["fused"]
            for way in ways:
                dec = fused_decoder(model, states, 1, L, compile=way == "compiled",
                                    kernel="cpp" if way == "C++" else "torch")

                def step():
                    dec.step(token)
                    dec.positions -= 1   # stay at L (the softmax cache's length decides its cost)
                    dec.lengths = [n - 1 for n in dec.lengths]
                out[(mixer, way)] = timed(step, reps)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="prefixes 512 and 8K, batch 1 and 8, no compile")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prefixes = [512, 8192] if args.quick else [512, 2048, 8192, 16384]
    compile = not args.quick
    ways = {"interdomain": ["own", "fused", "C++"] + (["compiled"] if compile else []), "softmax": ["own", "fused"]}
    print(f"# decode step, 125M width (d 768, 12 heads, M 64), fp32, {args.threads} threads, "
          f"median of {args.reps} steps\n")
    print("## one layer's mixer: ms per step (tokens/s)\n")
    head = [f"{m} {w}" for m, ws in ways.items() for w in ws]
    print("| batch | prefix | " + " | ".join(head) + " | softmax best / interdomain best |")
    print("|---|---|" + "---|" * (len(head) + 1))
    best = {}
    for batch in (1, 8):
        for L in prefixes:
            t = layer_rows(batch, L, args.reps, compile)
            cells = [f"{t[(m, w)] * 1e3:.3f} ({batch / t[(m, w)]:,.0f})" for m, ws in ways.items() for w in ws]
            best[(batch, L)] = (min(t[("interdomain", w)] for w in ways["interdomain"]),
                                min(t[("softmax", w)] for w in ways["softmax"]))
            ratio = best[(batch, L)][1] / best[(batch, L)][0]
            print(f"| {batch} | {L:,} | " + " | ".join(cells) + f" | {ratio:.2f}x |", flush=True)
    print("\n## the whole 125M model (12 layers, GPT-2 vocabulary), batch 1: ms per token\n")
    mways = ways
    mhead = [f"{m} {w}" for m, ws in mways.items() for w in ws]
    print("| prefix | " + " | ".join(mhead) + " |")
    print("|---|" + "---|" * len(mhead))
    for L in ([512, 8192] if args.quick else [512, 2048, 8192]):
        t = model_rows(L, max(5, args.reps // 3), compile)
        print(f"| {L:,} | " + " | ".join(f"{t[(m, w)] * 1e3:.1f}" for m, ws in mways.items() for w in ws) + " |",
              flush=True)
    print("\n## checks (one layer; interdomain's best way against softmax's best)\n")
    i512, s512 = best[(1, 512)]
    i8k, s8k = best[(1, 8192)]
    print(f"- {'PASS' if i512 <= s512 else 'FAIL'}: batch 1, prefix 512: interdomain {i512 * 1e3:.3f} ms "
          f"<= softmax {s512 * 1e3:.3f} ms")
    print(f"- {'PASS' if s8k >= 3 * i8k else 'FAIL'}: batch 1, prefix 8K: interdomain {s8k / i8k:.1f}x faster "
          f"than softmax (>= 3x)")
    from2k = [L for L in prefixes if L >= 2048]
    ok = all(best[(8, L)][0] <= best[(8, L)][1] for L in from2k)
    print(f"- {'PASS' if ok else 'FAIL'}: batch 8, prefixes " + ", ".join(f"{L:,}" for L in from2k) +
          ": interdomain tokens/s >= softmax's (" +
          ", ".join(f"{best[(8, L)][1] / best[(8, L)][0]:.2f}x" for L in from2k) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
