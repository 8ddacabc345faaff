"""`megatron-id params`: parameter count, recurrent state and FLOPs of a config."""
from __future__ import annotations

import json
from dataclasses import asdict

from ..config import load_config
from ..model.pattern import describe_pattern, is_hybrid
from .options import add_config_args


def add_parser(sub) -> None:
    p = sub.add_parser("params", help="parameter count, recurrent state and FLOPs of a config",
                       allow_abbrev=False)
    add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..model.accounting import report  # torch: not at import (cli.py)
    cfg = load_config(args.config, args.overrides)
    r = report(cfg.model)
    if args.json:
        print(json.dumps(asdict(r)))
        return 0
    m = cfg.model
    attention = (f" n_kv_heads={m.n_kv_heads}" if m.n_kv_heads not in (None, m.n_heads) else "") + \
        (" qkv_bias=True" if m.qkv_bias else "")   # said only when set (softmax layers)
    print(f"mixer={m.mixer.value} d_model={m.d_model} n_layers={m.n_layers} n_heads={m.n_heads}{attention} "
          f"state_size={m.state_size} query_readout={m.query_readout} "
          f"dual_kv_input={m.dual_kv_input} rope={m.rope} seq_length={m.seq_length}")
    if is_hybrid(m) or m.layer_pattern:
        window = f", window {m.window}" if m.window else ""
        print(f"layers: {describe_pattern(m)}{window}")
    rows = [("parameters", f"{r.parameters:,}"),
            ("non-embedding parameters", f"{r.non_embedding_parameters:,}")]
    if r.state_per_token_per_layer is not None:
        rows.append(("recurrent state per interdomain/s4d layer (real numbers, any context)",
                     f"{r.state_per_token_per_layer:,}"))
    if r.kv_cache_per_token_per_layer is not None:
        rows.append(("KV cache per softmax layer (real numbers)",
                     f"{r.kv_cache_per_token_per_layer:,} x context length"))
    if is_hybrid(m) or m.layer_pattern:
        grows = f" + {r.decode_state_per_token:,} x context" if r.decode_state_per_token else " (any context)"
        rows.append(("decode state, all layers (real numbers)", f"{r.fixed_state:,}{grows}"))
        rows.append((f"  at model.seq_length={m.seq_length:,}", f"{r.decode_state(m.seq_length):,}"))
    rows += [("forward FLOPs per token", f"{r.forward_flops_per_token:,}"),
             ("training FLOPs per token (3 x forward)", f"{r.training_flops_per_token:,}")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v:>20}")
    return 0
