"""The `megatron-id` command. Subcommands grow with the project; each is small.

    megatron-id params --config configs/model/125m.yaml [key=value ...]
    megatron-id preprocess --input ... --tokenizer ... --output-prefix ...   (= python -m data_tools.preprocess)
    torchrun --nproc-per-node N -m megatron_id.cli train --config run.yaml [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from .config import ConfigError, load_config


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", default=[], metavar="YAML",
                   help="config file; repeat to merge several (later wins)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides, e.g. model.mixer=softmax model.n_layers=2")


def cmd_params(args) -> int:
    from .model.accounting import report
    cfg = load_config(args.config, args.overrides)
    r = report(cfg.model)
    if args.json:
        print(json.dumps(asdict(r)))
        return 0
    m = cfg.model
    print(f"mixer={m.mixer.value} d_model={m.d_model} n_layers={m.n_layers} n_heads={m.n_heads} "
          f"state_size={m.state_size} query_readout={m.query_readout} "
          f"dual_kv_input={m.dual_kv_input} rope={m.rope} seq_length={m.seq_length}")
    rows = [("parameters", f"{r.parameters:,}"),
            ("non-embedding parameters", f"{r.non_embedding_parameters:,}")]
    if r.state_per_token_per_layer is not None:
        rows.append(("recurrent state per layer (real numbers, any context)",
                     f"{r.state_per_token_per_layer:,}"))
    else:
        rows.append(("KV cache per layer (real numbers)",
                     f"{r.kv_cache_per_token_per_layer:,} x context length"))
    rows += [("forward FLOPs per token", f"{r.forward_flops_per_token:,}"),
             ("training FLOPs per token (3 x forward)", f"{r.training_flops_per_token:,}")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v:>20}")
    return 0


def cmd_train(args) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _cuda() else "cuda")
    import warnings
    # DeepSpeed calls a torch.distributed function that torch has deprecated: not the user's concern
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")
    from .training.distributed import init_distributed_from_env
    from .training.engine import NonFiniteTrainingError, Trainer
    cfg = load_config(args.config, args.overrides)   # config errors before any process group
    init_distributed_from_env()
    trainer = Trainer(cfg)
    try:
        trainer.train()
    except NonFiniteTrainingError as err:
        import torch.distributed as dist
        if dist.get_rank() == 0:
            print(f"error: {err}", file=sys.stderr)
        return 1
    import torch.distributed as dist
    if dist.get_rank() == 0:
        t = cfg.train
        print(f"finished at step {trainer.step}; checkpoint: {t.save or 'not saved (train.save unset)'}; "
              f"TensorBoard: {t.tensorboard_dir or 'off (train.tensorboard_dir unset)'}", file=sys.stderr)
    dist.destroy_process_group()
    return 0


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["preprocess"]:   # its own flags (Megatron's names), so hand over whole
        from data_tools.preprocess import main as preprocess_main
        return preprocess_main(argv[1:])
    parser = argparse.ArgumentParser(prog="megatron-id", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("params", help="parameter count, recurrent state and FLOPs of a config")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_params)
    sub.add_parser("preprocess", help="tokenize a corpus into .bin/.idx (see --help of it)")
    t = sub.add_parser("train", help="train with DeepSpeed (launch with torchrun / srun / deepspeed)")
    _add_config_args(t)
    t.set_defaults(func=cmd_train)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"megatron-id: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
