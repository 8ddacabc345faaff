"""What data.carry_state keeps per row: the state every layer hands the next window.

    python benchmarks/carry_state.py            # the paper's 125M and 1.3B configs, a table

Measured from the tensors a forward returns (LanguageModel(return_states=True) on 16 tokens,
weights left uninitialised: the real shapes and dtypes), as training/carry.py carries them: each
layer's complex S4D state and its short convs' last K-1 inputs, in the training dtypes (fp32
weights: complex64 state; bf16 autocast keeps the state in fp32 too, the chunked core works in
float32). Per row, so a rank's cost is this x micro-batch size x gradient accumulation, and a
checkpoint holds it once per rank. It does not grow with the window or the document.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_id.config import load_config  # noqa: E402
from megatron_id.model import LanguageModel  # noqa: E402


@torch.no_grad()
def carried_bytes(config: Path, window: int = 16) -> dict:
    cfg = load_config([config], []).model
    model = LanguageModel(cfg, seed=None)
    for p in model.parameters():   # (uninitialised memory may hold anything: finite values, any)
        p.zero_()
    _, states = model(torch.zeros(1, window, dtype=torch.long), return_states=True)
    ssm = sum(s["ssm"].numel() * s["ssm"].element_size() for s in states)
    conv = sum(t.numel() * t.element_size() for s in states for t in s["conv"].values())
    return {"model": config.stem, "layers": cfg.n_layers, "ssm": ssm, "conv": conv, "total": ssm + conv,
            "weights": sum(p.numel() for p in model.parameters()) * 4}


def main() -> int:
    rows = [carried_bytes(ROOT / "configs" / "model" / name) for name in ("125m.yaml", "1p3b.yaml")]
    print("| model | layers | S4D state / row | conv tails / row | total / row | x 8 rows | fp32 weights |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mib = lambda b: f"{b / 2**20:,.2f} MiB"   # noqa: E731
        print(f"| {r['model']} | {r['layers']} | {mib(r['ssm'])} | {mib(r['conv'])} | {mib(r['total'])} | "
              f"{mib(8 * r['total'])} | {mib(r['weights'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
