"""How the activation coefficients of megatron_id/training/plan.py were obtained.

    python benchmarks/plan_coefficients.py [--mixers softmax interdomain s4d]   (about a minute on 2 CPU cores)

For one block (norms, mixer, SwiGLU) at 11 small shapes, it counts the bytes of every tensor
autograd saves for backward (torch.autograd.graph.saved_tensors_hooks; each storage once,
parameters and the block input excluded), in fp32 and under bf16 autocast, and fits
non-negative coefficients of the terms in plan.py's docstring. The FFN width is set apart from
d so that the d and f terms can be told apart. Prints the coefficients and the worst relative
error of the fit; plan.py adds 4 bytes per token and channel for the block input.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from scipy.optimize import nnls

from megatron_id.config import load_config
from megatron_id.model.language_model import Block
from megatron_id.model.mixers import MIXERS
from megatron_id.training.plan import COEFFICIENT_TERMS

# d, H, N, T (chunk), M (modes), B (micro-batch), f (FFN width)
SHAPES = [(256, 4, 512, 64, 64, 1, 256), (512, 4, 512, 64, 64, 1, 1536), (256, 8, 512, 64, 64, 1, 768),
          (256, 4, 1024, 64, 64, 1, 128), (256, 4, 512, 32, 64, 1, 768), (256, 4, 512, 64, 32, 1, 512),
          (256, 4, 512, 64, 64, 2, 768), (384, 4, 256, 64, 64, 2, 2048), (256, 2, 256, 16, 16, 1, 768),
          (128, 4, 512, 64, 64, 1, 384), (512, 8, 256, 32, 16, 1, 1024)]


def saved_bytes(mixer, d, H, N, T, M, B, f, autocast):
    cfg = load_config([], [f"model.mixer={mixer}", f"model.d_model={d}", f"model.n_heads={H}",
                           f"model.seq_length={N}", f"model.chunk_size={T}", f"model.state_size={M}",
                           f"model.ffn_hidden={f}", "model.n_layers=1"]).model
    block = Block(cfg, 0.02, "chunked")
    x = torch.randn(B, N, d, requires_grad=True)
    seen = {}

    def pack(t):   # views share a storage: count each storage once, at its full size
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            block(x)
    excluded = {p.untyped_storage().data_ptr() for p in block.parameters()}
    excluded.add(x.untyped_storage().data_ptr())
    return sum(v for k, v in seen.items() if k not in excluded)


def main():
    parser = argparse.ArgumentParser(description="Fit plan.py's activation coefficients of each mixer.")
    parser.add_argument("--mixers", nargs="+", default=["softmax", "interdomain", "s4d"], choices=sorted(MIXERS),
                        help="model.mixer values (default: softmax interdomain s4d); a mixer with "
                             "no state tables (not interdomain / s4d) is fitted on the d and f terms")
    args = parser.parse_args()
    for autocast in (False, True):
        for mixer in args.mixers:
            tables = mixer in ("interdomain", "s4d")
            rows, ys = [], []
            for d, H, N, T, M, B, f in SHAPES:
                tokens = B * N
                if not tables:
                    rows.append([tokens * d, tokens * f])
                else:
                    rows.append([tokens * d, tokens * f, tokens * H * M, tokens * d * M / T,
                                 H * M * M, H * T * M])
                ys.append(saved_bytes(mixer, d, H, N, T, M, B, f, autocast))
            A, y = np.array(rows, float), np.array(ys, float)
            coef, _ = nnls(A, y)
            err = np.max(np.abs(A @ coef - y) / y)
            names = COEFFICIENT_TERMS if tables else COEFFICIENT_TERMS[:2]   # the columns of `rows`
            print(f"{mixer:<12} bf16={autocast!s:<5} " +
                  " ".join(f"{n}={c:.1f}" for n, c in zip(names, coef)) + f"  max error {err:.1%}")


if __name__ == "__main__":
    main()
