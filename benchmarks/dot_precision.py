"""The Triton core's error per dot precision, against the float64 naive form, on the CPU.

    python benchmarks/dot_precision.py                      # every precision, both readouts
    python benchmarks/dot_precision.py --per-kernel tf32    # which kernel's dots carry the error

The kernels run under Triton's interpreter with the tensor cores' rounding of the dot operands
emulated (triton_chunked._dot: tf32 keeps 10 mantissa bits, truncated as the MMA reads an fp32
register; tf32x3 adds the two cross products of the remainders; bf16 rounds to nearest even),
at the tile of every shipped config above tiny (T = M = R = Dv = 64), 200 tokens (a partial
last chunk), two heads, a given initial state, Delta at its init range. Each cell: the relative
error over the whole tensor (output, final state, every gradient). --per-kernel: one kernel in
that precision, the others exact ("ieee"). This is how triton_chunked.dot_precision was chosen
(docs/gpu.md "Dot precision").
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from conftest import relative_error  # noqa: E402  (tests/: the shared inputs and loss)
from test_interdomain_forms import core_inputs, run_form  # noqa: E402

from megatron_id.ops.interdomain import triton_chunked  # noqa: E402


def case(readout: str, N: int):
    contraction = readout == "contraction"
    tensors, state = core_inputs(1, torch.float32, B=1, N=N, H=2, R=64, Dv=64, M=64, delta="init",
                                 contraction=contraction, with_state=True)
    tensors["initial_state"] = state.to(torch.complex64).requires_grad_()
    ref_in = {n: None if t is None else t.detach().to(torch.float64 if not t.is_complex() else torch.complex128)
              .requires_grad_() for n, t in tensors.items()}
    return tensors, run_form("naive", ref_in, ref_in["initial_state"], "hermitian", 64)


def errors(tensors, ref) -> dict:
    got = run_form("triton", tensors, tensors["initial_state"], "hermitian", 64)
    found = {"out": relative_error(got[0], ref[0]), "state": relative_error(got[1], ref[1])}
    found.update({name: relative_error(g, ref[2][name]) for name, g in got[2].items()})
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precisions", nargs="+", default=list(triton_chunked.PRECISIONS),
                   choices=triton_chunked.PRECISIONS)
    p.add_argument("--per-kernel", metavar="PREC", choices=triton_chunked.PRECISIONS,
                   help="one kernel at a time in PREC, the others in ieee")
    p.add_argument("--tokens", type=int, default=200)
    args = p.parse_args(argv)
    launch = triton_chunked.launch
    print(f"# relative error against the float64 naive form, T = M = R = Dv = 64, {args.tokens} tokens, 2 heads")
    for readout in ("hermitian", "contraction"):
        tensors, ref = case(readout, args.tokens)
        if args.per_kernel:
            names = ["walk_forward", "carry_backward"] + (["contraction_forward", "contraction_backward"]
                                                          if readout == "contraction" else
                                                          ["query_forward", "query_backward_dv", "query_backward_dq"])
            rows = []
            for only in names:
                def one(name, grid, *a, _only=only, **c):
                    if "PREC" in c:
                        c["PREC"] = args.per_kernel if name == _only else "ieee"
                    return launch(name, grid, *a, **c)
                triton_chunked.launch = one
                try:
                    rows.append((f"{only} in {args.per_kernel}", errors(tensors, ref)))
                finally:
                    triton_chunked.launch = launch
        else:
            rows = []
            for prec in args.precisions:
                os.environ["MEGATRON_ID_DOT_PRECISION"] = prec
                rows.append((prec, errors(tensors, ref)))
            os.environ.pop("MEGATRON_ID_DOT_PRECISION", None)
        names = list(rows[0][1])
        print(f"\n## {readout} readout\n")
        print("| dots | " + " | ".join(names) + " | worst |")
        print("|---|" + "---|" * (len(names) + 1))
        for label, found in rows:
            worst = max(found, key=found.get)
            print(f"| {label} | " + " | ".join(f"{found[n]:.1e}" for n in names) + f" | {worst} {found[worst]:.1e} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
