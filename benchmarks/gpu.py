"""One-GPU benchmark (issue 15): the interdomain core against causal SDPA at 1.3B head shapes,
and training throughput and MFU of the 125M and 1.3B configs at 4K context, bf16.

    python benchmarks/gpu.py                          # one GPU, under 8 minutes on an H200
    python benchmarks/gpu.py --json runs/gpu.json     # also write every cell as JSON
    python benchmarks/gpu.py --device cpu --quick     # dry run on CPU: small shapes, few reps

(a) The core alone, forward + backward (batch 1 sequence, d_model 2048, 32 heads, head_dim 64,
    M = 64, chunk 64, parameters from the 1.3B mixer's own init): `chunked_interdomain` with
    backward="triton" (the Triton kernel), "autograd" and "recompute" (PyTorch chunked form),
    against torch.nn.functional.scaled_dot_product_attention(is_causal=True) in bf16 at the same
    head shapes (FlashAttention on H100/H200). The core's inputs have the mixer's dtypes under
    bf16 autocast (q bf16 after the feature map, k and v float32 after the norms). Each cell:
    minimum over --reps calls after one warm-up call (torch.cuda.synchronize around each), and
    the peak CUDA memory allocated during them (inputs included).
(b) A plain training step loop on LanguageModel (bf16 autocast, fp32 weights, lm_loss,
    backward, the trainer's AdamW: GuardedAdamW with its parameter groups and clipping, ZeRO-0
    as on one GPU) per config and model.core_impl; random tokens. The micro-batch is the first
    of --micro-batches that fits (an OOM steps down). --warmup steps, then the minimum over
    --steps timed steps. TFLOP/s and MFU use the trainer's own FLOP count and formula
    (training/metrics.py: model/accounting.py's training FLOPs per token x tokens/s, over
    train.peak_tflops, 989 by default: H100 SXM dense bf16, the same as H200).

Cells run in one worker subprocess per table; a cell that fails (OOM, error, unavailable
implementation) prints its reason in the cell, and a worker that dies (e.g. a CUDA fault) is
restarted for the remaining cells. Each part has a time budget: cells that would start after
it are reported as skipped. Exits 2 when no CUDA device is visible, unless --device cpu.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from allocator import ALLOCATOR_ENV  # noqa: E402  (beside this file)
from mixers import _timed  # noqa: E402  (minimum over reps after a warm-up, synchronized)

CORE_COLUMNS = [("triton", "Triton kernel"), ("autograd", "PyTorch chunked (autograd)"),
                ("recompute", "PyTorch chunked (recompute)"), ("sdpa", "causal SDPA (bf16)")]
TRAIN_MODELS = ["125m", "1p3b"]
TRAIN_IMPLS = ["autograd", "recompute", "triton"]
# --quick: tiny widths of the same configs (head_dim 64 kept), so the CPU dry run takes seconds
QUICK_OVERRIDES = {"125m": ["model.d_model=256", "model.n_heads=4", "model.n_layers=2", "model.vocab_size=1024"],
                   "1p3b": ["model.d_model=512", "model.n_heads=8", "model.n_layers=1", "model.vocab_size=1024"]}
GRACE_S = 20   # a worker still running this long after its part's deadline is killed
RESTART = 3    # a worker's exit status after a CUDA error, which poisons its context: start afresh
GiB = 2 ** 30


# ----------------------------------------------------------------------------- the FLOP count

def throughput(model_cfg, tokens_per_s: float, peak_tflops: float) -> dict:
    """TFLOP/s and MFU on one device, exactly as the trainer logs them (training/metrics.py):
    training FLOPs per token from model/accounting.py x tokens/s, over the peak."""
    from megatron_id.model.accounting import report
    flops_per_token = report(model_cfg).training_flops_per_token
    tflops = flops_per_token * tokens_per_s / 1e12 / 1   # one device
    return {"flops_per_token": flops_per_token, "tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else 0.0}


def train_config(model: str, impl: str, context: int, quick: bool, extra=()):
    from megatron_id.config import load_config
    items = [f"model.core_impl={impl}", f"model.seq_length={context}", "train.precision=bf16",
             *(QUICK_OVERRIDES[model] if quick else []), *extra]
    return load_config([ROOT / f"configs/model/{model}.yaml"], items)


# ----------------------------------------------------------------------------- worker side

def _oom(e: BaseException) -> bool:
    import torch
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if _oom(e):
        return "OOM"
    return f"{type(e).__name__}: {text[:160]}"


def _free(device) -> None:
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def core_cell(cell: dict, device) -> dict:
    """Forward + backward of the core (or of causal SDPA) at the 1.3B mixer's head shapes."""
    import torch
    import torch.nn.functional as F

    from megatron_id.config import load_config
    from megatron_id.model.init import initialize
    from megatron_id.model.layers import feature_map
    from megatron_id.model.mixers import build_mixer
    from megatron_id.ops.interdomain.chunked import chunked_interdomain
    column, N, B = cell["column"], cell["N"], cell["batch"]
    cfg = load_config([ROOT / "configs/model/1p3b.yaml"], []).model
    H, Dh = cfg.n_heads, cfg.d_model // cfg.n_heads
    g = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g).to(device)   # noqa: E731
    if column == "sdpa":
        q, k, v = (randn(B, H, N, Dh).to(torch.bfloat16).requires_grad_() for _ in range(3))
        grad = randn(B, H, N, Dh).to(torch.bfloat16)
        leaves = (q, k, v)

        def run():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    else:
        layer = build_mixer(cfg, cfg.init_std)
        initialize(layer, 0)   # the mixer's own Delta, A, C at init
        params = [p.detach().to(device).requires_grad_() for p in layer.core_parameters()]
        unit_rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)   # noqa: E731
        q = feature_map(randn(B, N, H, Dh)).to(torch.bfloat16).requires_grad_()
        k = unit_rms(feature_map(randn(B, N, H, Dh))).requires_grad_()
        v = unit_rms(randn(B, N, H, Dh)).requires_grad_()
        grad = randn(B, N, H, Dh)
        leaves = (q, k, v, *params)

        def run():
            out, _ = chunked_interdomain(q, k, v, *params, readout=layer.readout,
                                         c_vec=getattr(layer, "c_vec", None),
                                         chunk_size=cfg.chunk_size, backward=column)
            out.backward(grad)

    def fn():
        for t in leaves:
            t.grad = None
        run()
    try:
        seconds, peak = _timed(fn, cell["reps"], device, warmup=True)
    except ValueError as e:   # the op's refusal: no such backward yet, no triton, no CUDA, ...
        return {"ok": False, "reason": "unavailable: " + " ".join(str(e).split())[:200]}
    result = {"ok": True, "time": seconds, "memory": peak if device.type == "cuda" else None}
    if column == "triton":
        # the kernel's first runs on real hardware: its output and input gradients against the
        # PyTorch chunked form on the same inputs (relative error, the worst of the four)
        def out_and_grads(impl):
            for t in leaves:
                t.grad = None
            out, _ = chunked_interdomain(q, k, v, *params, readout=layer.readout,
                                         c_vec=getattr(layer, "c_vec", None), chunk_size=cfg.chunk_size,
                                         backward=impl)
            out.backward(grad)
            return [out.detach().float(), *(t.grad.float() for t in (q, k, v))]
        got, ref = out_and_grads("triton"), out_and_grads("recompute")
        result["error"] = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(got, ref))
    return result


def train_cell(cell: dict, device, deadline: float) -> dict:
    """Tokens/s of a plain training step loop; the first micro-batch in the list that fits."""
    import torch

    from megatron_id.config import ConfigError
    from megatron_id.model import LanguageModel, lm_loss
    from megatron_id.model.accounting import report
    from megatron_id.training.optim import GuardedAdamW, parameter_groups
    try:
        cfg = train_config(cell["model"], cell["impl"], cell["context"], cell["quick"])
    except ConfigError as e:
        return {"ok": False, "reason": "unavailable: " + " ".join(str(e).split())[:200]}
    model = LanguageModel(cfg.model, seed=cfg.seed).to(device)   # init draws on CPU generators
    if cell["compile"]:
        model.compile()   # in place, as train.compile does (engine.compile())
    o = cfg.optimizer
    # the trainer's optimizer at ZeRO-0 (its groups, clipping and finiteness check); the LR
    # does not change the cost: the smallest one keeps random-token steps finite
    opt = GuardedAdamW(parameter_groups(model, o), lr=o.min_lr, betas=(o.adam_beta1, o.adam_beta2),
                       eps=o.adam_eps, clip_grad=o.clip_grad)
    bf16 = cfg.train.precision.value == "bf16"
    context, tried, result = cfg.model.seq_length, [], None
    for mb in cell["micro_batches"]:
        if time.time() > deadline:
            tried.append(f"{mb}: skipped (time budget)")
            break
        tokens = torch.randint(0, cfg.model.vocab_size, (mb, context + 1), device=device)

        def step():
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(tokens[:, :-1])
            lm_loss(logits, tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        failed = None   # a reason: not the exception, whose frames would keep the step's tensors
        try:
            updates = opt.updates
            for _ in range(cell["warmup"]):
                step()
            seconds, peak = _timed(step, cell["steps"], device, warmup=False)
            skipped = cell["warmup"] + cell["steps"] - (opt.updates - updates)
            result = {"micro_batch": mb, "time": seconds, "memory": peak if device.type == "cuda" else None,
                      "skipped_updates": skipped}
        except ValueError as e:   # the core's refusal (no triton, no CUDA, ...): as in table (a)
            failed = "unavailable: " + " ".join(str(e).split())[:200]
        except Exception as e:   # noqa: BLE001  (OOM steps down; anything else ends the cell)
            failed = None if _oom(e) else f"{mb}: {_reason(e)}"
            tried.append(f"{mb}: {_reason(e)}")
        opt.zero_grad(set_to_none=True)
        _free(device)
        if result is not None or failed is not None:
            break
    if result is None:
        return {"ok": False, "reason": failed if failed and failed.startswith("unavailable")
                else "; ".join(tried) or "no micro-batch tried"}
    tokens_per_step = result["micro_batch"] * context
    tokens_per_s = tokens_per_step / result["time"]
    return {"ok": True, **result, "tried": tried, "tokens_per_step": tokens_per_step,
            "tokens_per_s": tokens_per_s, "parameters": report(cfg.model).parameters,
            **throughput(cfg.model, tokens_per_s, cell["peak_tflops"])}


def worker(spec: dict) -> None:
    """Runs the cells in order, printing START <key> before and RESULT <json> after each."""
    import torch
    torch.manual_seed(0)
    device = torch.device(spec["device"])
    for cell in spec["cells"]:
        print("START " + cell["key"], flush=True)
        if cell["part"] == "exit":   # tests: a worker that dies inside a cell
            os._exit(cell["status"])
        if time.time() > spec["deadline"]:
            res = {"ok": False, "reason": "skipped (time budget)"}
        else:
            try:
                res = core_cell(cell, device) if cell["part"] == "core" else \
                    train_cell(cell, device, spec["deadline"])
            except Exception as e:   # noqa: BLE001  (the reason goes into the cell)
                res = {"ok": False, "reason": _reason(e)}
            _free(device)
        print("RESULT " + json.dumps({"key": cell["key"], **res}), flush=True)
        if "CUDA error" in res.get("reason", ""):   # sticky: every later cell would fail alike
            os._exit(RESTART)


# ----------------------------------------------------------------------------- parent side

def run_cells(cells: list, device: str, deadline: float) -> dict:
    """Results by key, from worker subprocesses; a worker that dies is restarted after the
    cell it died in (which reports how it died), one past its part's deadline is killed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if device == "cpu":
        env.update(ALLOCATOR_ENV)
    results = {}
    while True:
        pending = [c for c in cells if c["key"] not in results]
        if not pending:
            return results
        spec, done_before = {"device": device, "deadline": deadline, "cells": pending}, len(results)
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
            proc.stdin.write(json.dumps(spec))
            proc.stdin.close()
            lines = queue.Queue()
            threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put(None)], daemon=True).start()
            current = None
            while True:
                try:
                    line = lines.get(timeout=max(deadline + GRACE_S - time.time(), 0.1))
                except queue.Empty:
                    proc.kill()
                    proc.wait()
                    for c in pending:
                        results.setdefault(c["key"], {"ok": False, "reason": "timed out (time budget)"
                                                      if c["key"] == current else "skipped (time budget)"})
                    return results
                if line is None:
                    break
                if line.startswith("START "):
                    current = line[6:].strip()
                elif line.startswith("RESULT "):
                    res = json.loads(line[7:])
                    key = res.pop("key")
                    results[key], current = res, None
                    print(f"  {time.strftime('%H:%M:%S')} {key}: {cells_label(res)}", file=sys.stderr, flush=True)
            rc = proc.wait()
            err.seek(0)
            tail = [ln for ln in err.read().splitlines() if ln.strip()][-1:] or [""]
        died = f"worker died (exit {rc}): {tail[0].strip()[:160]}"
        if current is not None:   # the cell it died in; a fresh worker goes on with the others
            results[current] = {"ok": False, "reason": died}
        elif rc != RESTART or len(results) == done_before:   # died between cells: give up on the rest
            for c in pending:
                results.setdefault(c["key"], {"ok": False, "reason": died})


def cells_label(res: dict) -> str:
    if not res.get("ok"):
        return "failed: " + res.get("reason", "?")
    return "ok: " + (f"{res['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in res else fmt_time(res["time"]))


def fmt_time(t) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.3f} s"


def cell_text(res: dict | None) -> str:
    if res is None:
        return "-"
    if not res["ok"]:
        return res["reason"].replace("|", "/")
    mem = f" / {res['memory'] / GiB:.2f} GiB" if res.get("memory") is not None else ""
    return fmt_time(res["time"]) + mem


def core_table(results: dict, lengths: list) -> tuple[list, list]:
    """Markdown lines and JSON rows of table (a)."""
    head = "| N | " + " | ".join(name for _, name in CORE_COLUMNS) + \
        " | kernel vs chunked | kernel vs SDPA | kernel's rel. error vs PyTorch |"
    lines, rows = [head, "|---" * (len(CORE_COLUMNS) + 4) + "|"], []
    for N in lengths:
        cells = {col: results.get(f"core/{col}/{N}") for col, _ in CORE_COLUMNS}
        t = {col: r["time"] for col, r in cells.items() if r and r["ok"]}
        chunked = min([t[c] for c in ("autograd", "recompute") if c in t], default=None)
        vs_chunked = f"{chunked / t['triton']:.2f}x" if "triton" in t and chunked else "-"
        vs_sdpa = f"{t['sdpa'] / t['triton']:.2f}x" if "triton" in t and "sdpa" in t else "-"
        error = (cells["triton"] or {}).get("error")
        lines.append(f"| {N} | " + " | ".join(cell_text(cells[c]) for c, _ in CORE_COLUMNS) +
                     f" | {vs_chunked} | {vs_sdpa} | {'-' if error is None else f'{error:.1e}'} |")
        rows.append({"N": N, **{c: cells[c] for c, _ in CORE_COLUMNS},
                     "kernel_vs_chunked": chunked / t["triton"] if "triton" in t and chunked else None,
                     "kernel_vs_sdpa": t["sdpa"] / t["triton"] if "triton" in t and "sdpa" in t else None})
    return lines, rows


def train_table(results: dict, cells: list) -> tuple[list, list]:
    head = ("| model | parameters | core_impl | compile | micro-batch | tokens/step | step time | tokens/s | "
            "TFLOP/s | MFU | peak memory |")
    lines, rows = [head, "|---" * 11 + "|"], []
    for c in cells:
        r = results.get(c["key"], {"ok": False, "reason": "not run"})
        label = c["model"] + (" (quick)" if c["quick"] else "")
        first = f"| {label} | "
        if r["ok"]:
            mb = str(r["micro_batch"]) + (f" (tried {', '.join(r['tried'])})" if r["tried"] else "")
            mem = f"{r['memory'] / GiB:.1f} GiB" if r.get("memory") is not None else "-"
            note = f" ({r['skipped_updates']} skipped updates)" if r["skipped_updates"] else ""
            lines.append(first + f"{r['parameters'] / 1e6:,.0f}M | {c['impl']} | {'yes' if c['compile'] else 'no'} | "
                         f"{mb} | {r['tokens_per_step']:,} | {fmt_time(r['time'])}{note} | {r['tokens_per_s']:,.0f} | "
                         f"{r['tflops']:.3g} | {100 * r['mfu']:.3g}% | {mem} |")
        else:
            lines.append(first + f"- | {c['impl']} | {'yes' if c['compile'] else 'no'} | "
                         f"{r['reason'].replace('|', '/')} | - | - | - | - | - | - |")
        rows.append({"model": c["model"], "core_impl": c["impl"], "compile": c["compile"], "quick": c["quick"],
                     "context": c["context"], **r})
    return lines, rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="small shapes, one rep: an end-to-end check")
    p.add_argument("--json", metavar="PATH", help="also write every cell as JSON")
    p.add_argument("--parts", default="core,train", help="comma-separated: core, train")
    p.add_argument("--lengths", default=None, help="table (a) lengths (default 2048,4096,8192,16384)")
    p.add_argument("--batch", type=int, default=1, help="table (a) sequences per call")
    p.add_argument("--reps", type=int, default=None, help="table (a) timed calls per cell (default 10)")
    p.add_argument("--context", type=int, default=None, help="table (b) tokens per sequence (default 4096)")
    p.add_argument("--micro-batches", default=None, help="table (b) sizes to try, largest first (default 16,8,4,2,1)")
    p.add_argument("--warmup", type=int, default=None, help="table (b) untimed steps (default 3)")
    p.add_argument("--steps", type=int, default=None, help="table (b) timed steps (default 5)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak per device for MFU (default train.peak_tflops: 989, H100 SXM / H200 dense bf16)")
    p.add_argument("--compile", action="store_true",
                   help="add a torch.compile row (125M, core_impl=auto): compilation is not in the 8 minutes")
    p.add_argument("--budget", type=float, default=420, help="seconds for both parts together (default 420)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.load(sys.stdin))
        return 0

    import torch

    from megatron_id.config import load_config
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: no CUDA device is visible (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}); run it on a GPU machine, or `--device cpu --quick` for a dry run.",
              file=sys.stderr)
        return 2
    quick = args.quick
    lengths = [int(x) for x in (args.lengths or ("128,256" if quick else "2048,4096,8192,16384")).split(",")]
    pick = lambda given, quick_value, full_value: given if given is not None else (  # noqa: E731
        quick_value if quick else full_value)
    reps, context = pick(args.reps, 1, 10), pick(args.context, 256, 4096)
    micro_batches = [int(x) for x in pick(args.micro_batches, "2,1", "16,8,4,2,1").split(",")]
    warmup, steps = pick(args.warmup, 1, 3), pick(args.steps, 2, 5)
    peak = args.peak_tflops or load_config([], []).train.peak_tflops
    parts = set(args.parts.split(","))

    start = time.time()
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"# benchmarks/gpu.py on {name} ({args.device}), torch {torch.__version__}"
          f"{', quick' if quick else ''}; budget {args.budget:.0f} s\n")
    out = {"device": args.device, "device_name": name, "torch": torch.__version__, "quick": quick,
           "peak_tflops": peak}

    if "core" in parts:
        cfg = load_config([ROOT / "configs/model/1p3b.yaml"], []).model
        cells = [{"key": f"core/{col}/{N}", "part": "core", "column": col, "N": N, "batch": args.batch, "reps": reps}
                 for N in lengths for col, _ in CORE_COLUMNS]
        # the core gets 40% of the budget (if training follows), the rest is training's
        deadline = start + args.budget * (0.4 if "train" in parts else 1.0)
        t0 = time.time()
        res = run_cells(cells, args.device, deadline)
        lines, out["core"] = core_table(res, lengths)
        print(f"## (a) interdomain core, forward + backward, 1.3B head shapes (d_model {cfg.d_model}, "
              f"{cfg.n_heads} heads, head_dim {cfg.d_model // cfg.n_heads}, M={cfg.state_size}, chunk "
              f"{cfg.chunk_size}), batch {args.batch}\n")
        print("\n".join(lines))
        print(f"\nEach cell: minimum over {reps} call(s) after one warm-up"
              f"{', and the peak CUDA memory allocated (inputs included)' if args.device == 'cuda' else ''}. "
              "kernel vs chunked: the faster PyTorch column's time / the kernel's; kernel vs SDPA: SDPA's "
              f"time / the kernel's (above 1: the kernel is faster). {time.time() - t0:.0f} s\n")

    if "train" in parts:
        cells = [{"key": f"train/{m}/{impl}", "part": "train", "model": m, "impl": impl, "compile": False}
                 for m in TRAIN_MODELS for impl in TRAIN_IMPLS]
        if args.compile:
            cells.append({"key": "train/125m/auto/compile", "part": "train", "model": "125m", "impl": "auto",
                          "compile": True})
        for c in cells:
            c.update(context=context, quick=quick, micro_batches=micro_batches, warmup=warmup, steps=steps,
                     peak_tflops=peak)
        t0 = time.time()
        res = run_cells(cells, args.device, start + args.budget)
        lines, out["train"] = train_table(res, cells)
        print(f"## (b) training throughput on one device, {context}-token context, bf16\n")
        print("\n".join(lines))
        print(f"\nPlain step loop (forward, lm_loss, backward, GuardedAdamW step), random tokens; {warmup} "
              f"warm-up step(s), then the minimum over {steps} timed step(s); micro-batch: the first of "
              f"{','.join(map(str, micro_batches))} that fits. TFLOP/s and MFU as the trainer logs them "
              f"(model/accounting.py training FLOPs per token x tokens/s); MFU against a peak of {peak:g} "
              f"TFLOP/s ({'--peak-tflops' if args.peak_tflops else 'train.peak_tflops'}; H100 SXM / H200 "
              f"dense bf16 = 989). {time.time() - t0:.0f} s\n")

    out["elapsed_s"] = time.time() - start
    print(f"elapsed {out['elapsed_s']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
