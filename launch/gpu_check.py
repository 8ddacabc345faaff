"""The steps of launch/gpu_check.sh that need Python, one subcommand each (read that script first).

    python launch/gpu_check.py kernel  [--dry-run]     the Triton core against the float64 PyTorch form
    python launch/gpu_check.py decode  [--dry-run]     eager decode against the CUDA-graph decode
    torchrun --nproc-per-node N launch/gpu_check.py losses --out F.json [key=value ...]
    python launch/gpu_check.py compare REFERENCE.json OTHER.json [...] [--rtol 1e-4]

Each prints its figures and exits 0 (PASS) or 1 (FAIL); a step that cannot run here (a GPU step
on a machine without CUDA, an --out that cannot be written) says so in one line, exit 2.
--dry-run: the same checks on the CPU (the kernels under TRITON_INTERPRET=1, small shapes; the
static decode step instead of the graph), which is how CI tests this script on machines without
a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# [our choice] tolerances per dot precision against the float64 form, relative over each tensor:
# the CPU tests' (tests/test_triton_core.py TOLERANCE; measured there with the tensor cores'
# rounding emulated: tf32 2.2e-3 output / 3.2e-3 worst gradient, tf32x3 about 1e-6)
TOLERANCE = {"tf32": 1e-2, "tf32x3": 1e-5}


def relative(a, b) -> float:
    a, b = a.detach().to(b.dtype), b.detach()
    denom = b.abs().pow(2).sum().sqrt().item()
    return (a - b).abs().pow(2).sum().sqrt().item() / (denom or 1.0)


def core_case(H, N, D, M, contraction, device, seed):
    """Inputs at a config's head shape: q, k, v [1, N, H, D], the S4D parameters at their init
    ranges, an initial state and three packed documents (seq_idx)."""
    import torch

    from megatron_id.ops.interdomain.ssm import s4d_inv_init
    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    a_log, a_im = s4d_inv_init(H, M)
    params = dict(log_dt=math.log(1e-3) + torch.rand(H, generator=g, dtype=torch.float64) * math.log(100),
                  a_log=a_log + 0.3 * randn(H, M), a_im=a_im,
                  c_re=torch.eye(M, dtype=torch.float64) + 0.4 * randn(H, M, M),
                  c_im=0.4 * randn(H, M, M))
    data = dict(q=None if contraction else randn(1, N, H, D), k=randn(1, N, H, D), v=randn(1, N, H, D))
    if contraction:
        params["c_vec"] = randn(H, M)
    state = torch.complex(randn(1, H, M, 2 * D), randn(1, H, M, 2 * D))
    seq_idx = torch.zeros(1, N, dtype=torch.long)
    seq_idx[0, N // 3:] = 1
    seq_idx[0, N // 3 + 64:] = 2     # one document starts inside a chunk, one on a chunk edge
    move = lambda t: None if t is None else t.to(device)
    return {k: move(v) for k, v in {**data, **params}.items()}, state.to(device), seq_idx.to(device)


def run_core(tensors, state, seq_idx, backward, dtypes, autocast):
    """Output, final state and every gradient of a weighted loss over both."""
    import torch

    from megatron_id.ops.interdomain import chunked_interdomain
    leaves = {}
    for name, t in tensors.items():
        if t is None:
            continue
        dtype = dtypes.get(name, torch.float64 if backward == "autograd" else torch.float32)
        leaves[name] = t.to(dtype).requires_grad_()
    init = state.to(torch.complex128 if backward == "autograd" else torch.complex64).requires_grad_()
    with torch.autocast(device_type=state.device.type, dtype=torch.bfloat16, enabled=autocast):
        out, final = chunked_interdomain(leaves.get("q"), leaves["k"], leaves["v"], leaves["log_dt"], leaves["a_log"],
                                         leaves["a_im"], leaves["c_re"], leaves["c_im"], c_vec=leaves.get("c_vec"),
                                         initial_state=init, output_final_state=True, chunk_size=64,
                                         backward=backward, seq_idx=seq_idx)
    g = torch.Generator(device=out.device).manual_seed(5)
    w = torch.randn(out.shape, generator=g, device=out.device, dtype=torch.float64)
    w_state = torch.randn(final.shape, generator=g, device=out.device, dtype=torch.complex128)
    loss = (out.double() * w).sum() + (final.to(torch.complex128) * w_state).real.sum()
    names = list(leaves) + ["initial_state"]
    grads = torch.autograd.grad(loss, [*leaves.values(), init])
    return out, final, dict(zip(names, grads))


def cmd_kernel(args) -> int:
    import torch
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megatron_id.ops.interdomain import triton_chunked as kernels
    device = torch.device("cpu" if args.dry_run else "cuda")
    shapes = [("125M", 12, 64, 64), ("1.3B", 32, 64, 64)] if not args.dry_run else [("tiny", 2, 16, 16)]
    N = 100 if args.dry_run else 2048
    failed = False
    print(f"{'case':44s} {'out':>8s} {'state':>8s} {'worst grad':>22s} {'tol':>6s} repeat  result")
    for label, H, D, M in shapes:
        for readout in ("query", "contraction"):
            for training in ("bf16", "fp32"):
                tensors, state, seq_idx = core_case(H, N, D, M, readout == "contraction", device, seed=H)
                bf16 = training == "bf16"
                dtypes = {"q": torch.bfloat16} if bf16 else {}   # the mixer's dtypes under bf16 autocast
                rounded = {k: (v.to(torch.bfloat16).double() if k == "q" and bf16 and v is not None else v)
                           for k, v in tensors.items()}
                ref = run_core(rounded, state, seq_idx, "autograd", {}, False)
                got = run_core(tensors, state, seq_idx, "triton", dtypes, bf16)
                again = run_core(tensors, state, seq_idx, "triton", dtypes, bf16)
                prec = kernels.dot_precision([torch.bfloat16] if bf16 else [torch.float32], bf16)
                errors = {"out": relative(got[0], ref[0]), "state": relative(got[1], ref[1])}
                grads = {n: relative(g, ref[2][n]) for n, g in got[2].items()}
                worst = max(grads, key=grads.get)
                repeat = all(torch.equal(got[2][n], again[2][n]) for n in got[2])
                ok = max(errors.values()) < TOLERANCE[prec] and grads[worst] < TOLERANCE[prec] and repeat
                failed |= not ok
                case = f"{label} H={H} D={D} M={M} N={N} {readout} {training} ({prec})"
                print(f"{case:44s} {errors['out']:8.1e} {errors['state']:8.1e} "
                      f"{worst + ' ' + format(grads[worst], '.1e'):>22s} "
                      f"{TOLERANCE[prec]:6.0e} {'bitwise' if repeat else 'DIFFERS'}  {'ok' if ok else 'FAIL'}",
                      flush=True)
    return 1 if failed else 0


def cmd_decode(args) -> int:
    import torch

    from megatron_id.config import load_config
    from megatron_id.inference.generate import generate_ids
    from megatron_id.model.language_model import LanguageModel
    device = torch.device("cpu" if args.dry_run else "cuda")
    graph = "static" if args.dry_run else "graph"
    failed = False
    cases = [("tiny", ["model.init_std=0.2"], 32)] if args.dry_run else \
        [("d256 h4 M64", ["model.d_model=256", "model.n_heads=4", "model.state_size=64", "model.init_std=0.2"], 64),
         ("1.3B", None, 64)]
    for label, items, new in cases:
        files = [ROOT / "configs/model/1p3b.yaml"] if items is None else [ROOT / "configs/model/tiny.yaml"]
        cfg = load_config(files, items or []).model
        model = LanguageModel(cfg, seed=3).eval().to(device)
        if items is None:   # the paper's decode timing is bf16 weights at batch 1
            model = model.to(torch.bfloat16)
            for name, p in model.named_parameters():
                if name.rsplit(".", 1)[-1] in ("a_im", "a_log", "log_dt", "c_re", "c_im"):
                    p.data = p.data.float()
        prompt = torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
        timings, outputs = {}, {}
        for decode in ("eager", graph):
            list(generate_ids(model, prompt, 4, decode=decode))          # warm up (and capture)
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync()
            start = time.perf_counter()
            outputs[decode] = list(generate_ids(model, prompt, new, decode=decode))
            sync()
            timings[decode] = (time.perf_counter() - start) / new * 1000
        same = outputs["eager"] == outputs[graph]
        failed |= not same
        print(f"{label:14s} {new} tokens, greedy: eager {timings['eager']:.2f} ms/token, {graph} "
              f"{timings[graph]:.2f} ms/token ({timings['eager'] / timings[graph]:.2f}x); tokens "
              f"{'equal' if same else 'DIFFER: ' + str(outputs)}", flush=True)
    return 1 if failed else 0


def cmd_attention(args) -> int:
    """Softmax with packed documents / a window (hybrids' A and W layers): the form the mixer
    picks on this device (FlexAttention, compiled, on CUDA; the blockwise form on the CPU)
    against the dense-mask SDPA in float64 ... float32 on CUDA: outputs and q, k, v gradients."""
    import torch

    from megatron_id.ops.attention import causal_attention, masked_attention
    device = torch.device("cpu" if args.dry_run else "cuda")
    N, H, D = (300, 2, 16) if args.dry_run else (4096, 12, 64)
    dtype = torch.float64 if args.dry_run else torch.float32
    failed = False
    for label, documents, window in (("documents", True, None), ("window 1024", False, 1024),
                                     ("documents + window", True, 1024)):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, H, N, D, generator=g, dtype=dtype).to(device).requires_grad_() for _ in range(3))
        seq = (torch.arange(N, device=device) * 3 // N)[None] if documents else None
        window = None if window is None else min(window, N // 3)
        want = masked_attention(q, k, v, seq, window)
        grad = torch.randn_like(want)
        want_grads = torch.autograd.grad(want, (q, k, v), grad)
        got = causal_attention(q, k, v, seq, window)
        got_grads = torch.autograd.grad(got, (q, k, v), grad)
        errors = [relative(got, want)] + [relative(a, b) for a, b in zip(got_grads, want_grads)]
        tolerance = 1e-10 if dtype == torch.float64 else 1e-4
        ok = max(errors) < tolerance
        failed |= not ok
        print(f"{label:20s} N={N} H={H} D={D} {str(dtype)[6:]}: out {errors[0]:.1e}, worst grad "
              f"{max(errors[1:]):.1e} (tolerance {tolerance:.0e}) {'ok' if ok else 'FAIL'}", flush=True)
    return 1 if failed else 0


def cmd_losses(args) -> int:
    """Under torchrun: train a few steps and write rank 0's losses to --out."""
    import torch.distributed as dist

    from megatron_id.config import load_config
    from megatron_id.training.distributed import init_distributed_from_env
    from megatron_id.training.engine import Trainer
    cfg = load_config([ROOT / "configs/model/tiny.yaml"], args.overrides)
    init_distributed_from_env(cfg.train.collective_timeout_minutes)
    trainer = Trainer(cfg)
    losses = [trainer.train_step() for _ in range(args.steps)]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(losses))
        print("losses", " ".join(f"{x:.6f}" for x in losses))
    dist.barrier()
    return 0


def cmd_compare(args) -> int:
    missing = [f for f in (args.reference, *args.others) if not Path(f).is_file()]
    if missing:
        print(f"gpu_check compare: no losses file {', '.join(missing)} (did its losses step fail?)", file=sys.stderr)
        return 1
    def read(path):
        try:
            losses = json.loads(Path(path).read_text())
        except (ValueError, UnicodeDecodeError) as e:
            losses = e
        if not (isinstance(losses, list) and losses and all(isinstance(x, (int, float)) for x in losses)):
            raise SystemExit(f"gpu_check compare: {path} is not a losses file (a JSON list of numbers, as "
                             f"gpu_check.py losses --out writes)")
        return losses

    reference = read(args.reference)
    failed = False
    for other in args.others:
        losses = read(other)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        ok = len(losses) == len(reference) and worst <= args.rtol and reference[0] != reference[-1]
        failed |= not ok
        print(f"{Path(other).stem:20s} worst relative difference {worst:.1e} over {len(losses)} steps "
              f"(tolerance {args.rtol:.0e}): {'ok' if ok else 'FAIL'}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python launch/gpu_check.py", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="step", required=True)
    for name in ("kernel", "decode", "attention"):
        s = sub.add_parser(name)
        s.add_argument("--dry-run", action="store_true", help="on the CPU, small shapes")
    s = sub.add_parser("losses")
    s.add_argument("--out", required=True)
    s.add_argument("--steps", type=int, default=4)
    s.add_argument("overrides", nargs="*")
    s = sub.add_parser("compare")
    s.add_argument("reference")
    s.add_argument("others", nargs="+")
    s.add_argument("--rtol", type=float, default=1e-4)
    return p


def refusal(args) -> str | None:
    """A step that cannot run here, in one line (before any work): the GPU steps without a CUDA
    device (torch would fail deep inside with "Torch not compiled with CUDA enabled"), the kernel
    step without triton, an --out that cannot be written, a losses file that is not one."""
    if args.step in ("kernel", "decode", "attention") and not args.dry_run:
        import torch
        if not torch.cuda.is_available():
            built = f"torch {torch.__version__} " + ("has no CUDA device visible" if torch.version.cuda
                                                     else "is a CPU build")
            return (f"gpu_check {args.step}: needs a CUDA GPU and {built}: run it on the GPU machine "
                    f"(bash launch/gpu_check.sh), or add --dry-run for the same check on the CPU.")
    if args.step == "kernel" and not args.dry_run:
        try:
            import triton  # noqa: F401
        except ImportError:
            return ("gpu_check kernel: triton is not installed: pip install -e '.[triton]' "
                    "(a CUDA torch usually brings it).")
    if args.step == "losses":
        out = Path(args.out)
        if out.is_dir() or not out.parent.is_dir():
            return (f"gpu_check losses: --out {args.out}: give a file in an existing folder "
                    f"({'it is a folder' if out.is_dir() else f'{out.parent} does not exist'}).")
        if args.steps < 1:
            return f"gpu_check losses: --steps {args.steps}: at least 1."
    return None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    why = refusal(args)
    if why:
        if os.environ.get("RANK", "0") == "0":   # under torchrun (losses): one line, not one per rank
            print(why, file=sys.stderr)
        return 2
    return {"kernel": cmd_kernel, "decode": cmd_decode, "attention": cmd_attention, "losses": cmd_losses,
            "compare": cmd_compare}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
