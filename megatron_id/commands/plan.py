"""`megatron-id plan`: memory and communication per GPU of every layout; recommends one."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict

from ..config import ConfigError, GiB, load_config, parse_size
from ..model.pattern import model_label
from .options import add_config_args


def add_parser(sub) -> None:
    pl = sub.add_parser("plan", help="memory and communication per GPU of every layout; recommends one",
                        allow_abbrev=False)
    add_config_args(pl)
    pl.add_argument("--nodes", type=int, required=True)
    pl.add_argument("--gpus-per-node", type=int, required=True)
    pl.add_argument("--gpu-memory", required=True, help="per GPU, e.g. 80GiB")
    pl.add_argument("--seq-length", type=int, help="override model.seq_length")
    pl.add_argument("--global-batch", type=int, help="override train.global_batch_size (sequences)")
    pl.add_argument("--margin", type=float, default=0.10,
                    help="fraction of GPU memory kept free (fragmentation, spikes); default 0.10")
    pl.add_argument("--overhead", default="2GiB",
                    help="per-GPU constant: CUDA context, NCCL buffers, allocator (assumed; default 2GiB)")
    pl.add_argument("--max-micro-batch", type=int, default=64, help="largest micro-batch tried (powers of two)")
    pl.add_argument("--top", type=int, default=0, help="print only the first N rows (0: all)")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.set_defaults(func=run)


def run(args) -> int:
    """Memory and communication per GPU of every layout the engine accepts (training/plan.py)."""
    # every option before the config is read; `is not None`: 0 is a value given, and wrong
    for flag, value, least in (("--nodes", args.nodes, 1), ("--gpus-per-node", args.gpus_per_node, 1),
                               ("--seq-length", args.seq_length, 1), ("--global-batch", args.global_batch, 1),
                               ("--max-micro-batch", args.max_micro_batch, 1), ("--top", args.top, 0)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} {value}: must be at least {least}.")
    if not 0 <= args.margin < 1:
        raise ConfigError(f"--margin {args.margin}: must be in [0, 1) (a fraction of --gpu-memory kept free).")
    gpu_memory = parse_size(args.gpu_memory, "--gpu-memory")
    overhead = parse_size(args.overhead, "--overhead", allow_zero=True)
    usable = (1 - args.margin) * gpu_memory
    if overhead >= usable:   # (once "no layout fits: use more GPUs ...", which no number of GPUs cures)
        raise ConfigError(f"--overhead {args.overhead} is not less than the {usable / GiB:.3g} GiB a layout may use "
                          f"of --gpu-memory {args.gpu_memory} ({1 - args.margin:.0%}, --margin {args.margin:g}): "
                          f"no layout could fit; check --gpu-memory (one GPU's), lower --overhead (default 2GiB) or "
                          f"--margin "
                          f"(default 0.1).")
    # torch: not at import (cli.py), and after the options (a refusal takes 0.3 s, not 2)
    from ..training.plan import plan, rank_key, recommend
    overrides = list(args.overrides)
    if args.seq_length is not None:
        overrides.append(f"model.seq_length={args.seq_length}")
    if args.global_batch is not None:
        overrides.append(f"train.global_batch_size={args.global_batch}")
    cfg = load_config(args.config, overrides)
    estimates = plan(cfg, args.nodes * args.gpus_per_node, gpu_memory, margin=args.margin,
                     overhead=overhead, max_micro_batch=args.max_micro_batch)
    best, why = recommend(estimates)
    if args.json:
        print(json.dumps({"gpu_memory": gpu_memory, "margin": args.margin,
                          "recommended": asdict(best) if best else None, "reason": why,
                          "layouts": [asdict(e) for e in estimates]}))
        return 0 if best else 1
    m, t = cfg.model, cfg.train
    print(f"{model_label(m)} d_model={m.d_model} n_layers={m.n_layers} seq_length={m.seq_length} "
          f"global batch {t.global_batch_size} sequences, precision {t.precision.value}; "
          f"{args.nodes} x {args.gpus_per_node} GPUs of {gpu_memory / GiB:.0f} GiB, fits = total <= "
          f"{1 - args.margin:.0%} of that (overhead {overhead / GiB:.1f} GiB per GPU included)")
    rows = sorted(estimates, key=rank_key)   # the recommended layout first
    if args.top:
        rows = rows[:args.top]
    header = ("TP", "PP", "DP", "ZeRO", "mb", "GA", "ckpt", "weights", "grads", "optim", "zero-buf",
              "step", "activ", "total GiB", "fits", "comm DP", "comm TP", "comm PP GiB/step")
    print("  ".join(f"{h:>7}" for h in header))
    for e in rows:
        cells = (e.tensor, e.pipe, e.data, e.zero_stage, e.micro_batch_size, e.gradient_accumulation,
                 "yes" if e.activation_checkpointing else "no",
                 *(f"{v / GiB:.1f}" for v in (e.weights, e.gradients, e.optimizer, e.zero_buffers,
                                               e.optimizer_step, e.activations, e.total)),
                 "FITS" if e.fits else "-",
                 *(f"{v / GiB:.2f}" for v in (e.comm_dp, e.comm_tp, e.comm_pp)))
        print("  ".join(f"{c:>7}" for c in cells))
    if args.top and len(estimates) > args.top:
        print(f"... {len(estimates) - args.top} more (--top 0 for all)")
    if best:
        print(f"recommended: TP={best.tensor} PP={best.pipe} DP={best.data} ZeRO-{best.zero_stage} "
              f"micro-batch {best.micro_batch_size} activation checkpointing "
              f"{'on' if best.activation_checkpointing else 'off'}: {why}")
        print(f"  megatron-id train ... parallel.tensor_model_parallel_size={best.tensor} "
              f"parallel.pipeline_model_parallel_size={best.pipe} train.zero_stage={best.zero_stage} "
              f"train.micro_batch_size={best.micro_batch_size} "
              f"train.activation_checkpointing={str(best.activation_checkpointing).lower()}")
        return 0
    print(f"megatron-id plan: {why}", file=sys.stderr)   # an empty result is not a success
    return 1
