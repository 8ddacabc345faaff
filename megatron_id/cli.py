"""The `megatron-id` command. Subcommands grow with the project; each is small.

    megatron-id params --config configs/model/125m.yaml [key=value ...]
    megatron-id preprocess --input ... --tokenizer ... --output-prefix ...   (= python -m data_tools.preprocess)
    torchrun --nproc-per-node N -m megatron_id.cli train --config run.yaml [key=value ...]
    megatron-id export-hf --checkpoint runs/x/checkpoints --output runs/x/hf
    megatron-id import-hf --input runs/x/hf --output runs/y/checkpoints --tensor-parallel 2
    megatron-id generate --checkpoint runs/x/hf --prompt "The water cycle" --max-new-tokens 50
    megatron-id check-checkpoint runs/x/checkpoints [--all]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from .config import load_config
from .errors import run_guarded


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
    cfg = load_config(args.config, args.overrides)   # config errors first, before heavy imports
    from .training.distributed import init_distributed_from_env
    from .training.engine import Trainer
    import torch.distributed as dist
    init_distributed_from_env(cfg.train.collective_timeout_minutes)
    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.train()
        if dist.get_rank() == 0:
            t = cfg.train
            print(f"finished at step {trainer.step}; checkpoint: {t.save or 'not saved (train.save unset)'}; "
                  f"TensorBoard: {t.tensorboard_dir or 'off (train.tensorboard_dir unset)'}",
                  file=sys.stderr, flush=True)
    finally:
        if trainer is not None:
            trainer.close()
    # every rank reaches the end before any exits; then entry() ends the process without the
    # interpreter's teardown of the process group and DeepSpeed (see entry)
    _TEARDOWN.append(dist.barrier)
    return 0


# Run after main() returns, just before the process exits (see entry()).
_TEARDOWN: list = []


def cmd_check_checkpoint(args) -> int:
    """Verify checkpoint folders against their manifests offline: the one `latest` names (or
    every iter_ folder with --all, or the iter_ folder given). Exit 0 only when all are whole."""
    from pathlib import Path
    from .training.checkpoint import CheckpointError, latest_folder, verify_checkpoint
    root = Path(args.path)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a folder: give a train.save folder or an iter_XXXXXXX folder.")
    if (root / "manifest.json").is_file() or (root / "client_state.pt").is_file():
        folders = [root]
    elif args.all:
        folders = sorted(p for p in root.glob("iter_*") if p.is_dir())
    else:
        folders = [latest_folder(root)] if latest_folder(root) is not None else []
    if not folders:
        raise CheckpointError(f"{root} holds no checkpoint (no `latest`, no iter_ folder): give a train.save "
                              f"folder or an iter_XXXXXXX folder.")
    stale = sorted((root / ".incomplete").glob("iter_*"))
    for path in stale:
        print(f"note: {path} was left by an interrupted save (the next run into {root} removes it)")
    damaged = 0
    for folder in folders:
        problems = verify_checkpoint(folder)
        if problems:
            damaged += 1
            for problem in problems:
                print(f"DAMAGED {folder}: {problem}", file=sys.stderr)
        else:
            print(f"ok {folder}")
    if damaged:
        raise CheckpointError(f"{damaged} of {len(folders)} checkpoint folders in {root} are damaged "
                              f"(listed above): resume from a whole one by writing its name into {root}/latest.")
    return 0


def cmd_export_hf(args) -> int:
    from .hf.export import export_hf
    out = export_hf(args.checkpoint, args.output, tokenizer=args.tokenizer,
                    prefill_chunk_size=args.prefill_chunk_size, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} -> {out} (load with AutoModelForCausalLM.from_pretrained("
          f"'{out}', trust_remote_code=True))")
    return 0


def cmd_import_hf(args) -> int:
    from .hf.export import import_hf
    out = import_hf(args.input, args.output, args.tensor_parallel, args.pipeline_parallel,
                    overwrite=args.overwrite)
    print(f"imported {args.input} -> {out} (TP={args.tensor_parallel}, PP={args.pipeline_parallel}; "
          f"weights only: train with train.load={out})")
    return 0


def cmd_generate(args) -> int:
    from .hf.export import BadOptionError
    from .hf.generate import check_options, generate_ids, load_model_and_tokenizer, stream_text
    import torch
    # option values first: a bad one fails before the model is loaded
    check_options(args.max_new_tokens, args.temperature, args.top_k, args.prefill_chunk_size)
    model, tokenizer, eos = load_model_and_tokenizer(args.checkpoint, args.tokenizer)
    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
        raise BadOptionError(f"--prompt {args.prompt!r} gives no tokens: give a prompt with some text.")
    sys.stdout.write(args.prompt)
    stream_text(tokenizer, generate_ids(
        model, prompt, args.max_new_tokens, eos_id=None if args.ignore_eos else eos,
        temperature=args.temperature, top_k=args.top_k, prefill_chunk_size=args.prefill_chunk_size,
        generator=torch.Generator().manual_seed(args.seed)))
    sys.stdout.write("\n")
    return 0


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-id", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an expected error too (or MEGATRON_ID_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("params", help="parameter count, recurrent state and FLOPs of a config",
                       allow_abbrev=False)
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_params)
    sub.add_parser("preprocess", help="tokenize a corpus into .bin/.idx (see --help of it)")
    t = sub.add_parser("train", help="train with DeepSpeed (launch with torchrun / srun / deepspeed)",
                       allow_abbrev=False)
    _add_config_args(t)
    t.set_defaults(func=cmd_train)
    c = sub.add_parser("check-checkpoint", help="verify checkpoint files against their manifest (sizes, sha256)",
                       allow_abbrev=False)
    c.add_argument("path", help="train.save folder (checks the one `latest` names) or an iter_XXXXXXX folder")
    c.add_argument("--all", action="store_true", help="check every iter_ folder of a train.save folder")
    c.set_defaults(func=cmd_check_checkpoint)
    e = sub.add_parser("export-hf", help="a training checkpoint -> a Hugging Face folder", allow_abbrev=False)
    e.add_argument("--checkpoint", required=True, help="train.save folder (uses `latest`) or an iter_ folder")
    e.add_argument("--output", required=True,
                   help="a new or empty folder (a non-empty one is refused: see --overwrite)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace --output when it holds an earlier export and nothing else")
    e.add_argument("--tokenizer", help="tokenizer.json (default: the one recorded in the checkpoint)")
    e.add_argument("--prefill-chunk-size", type=int, default=2048)
    e.set_defaults(func=cmd_export_hf)
    i = sub.add_parser("import-hf", help="an exported folder -> a training checkpoint at any TP/PP",
                       allow_abbrev=False)
    i.add_argument("--input", required=True)
    i.add_argument("--output", required=True,
                   help="a new or empty folder (a non-empty one is refused: see --overwrite)")
    i.add_argument("--overwrite", action="store_true",
                   help="replace --output when it holds one earlier import and nothing else "
                        "(never a folder with training checkpoints)")
    i.add_argument("--tensor-parallel", type=int, default=1)
    i.add_argument("--pipeline-parallel", type=int, default=1)
    i.set_defaults(func=cmd_import_hf)
    g = sub.add_parser("generate", help="stream text from a training checkpoint or an exported folder",
                       allow_abbrev=False)
    g.add_argument("--checkpoint", required=True, help="train.save folder, iter_ folder or exported folder")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prefill-chunk-size", type=int, default=2048)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--tokenizer")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv   # the traceback of an expected error (also MEGATRON_ID_DEBUG=1)
    argv = [a for a in argv if a != "--debug"]
    if argv[:1] == ["preprocess"]:   # its own flags (Megatron's names), so hand over whole
        from data_tools.preprocess import main as preprocess_main
        return preprocess_main(argv[1:], debug=debug)
    args = build_parser().parse_args(argv)
    return run_guarded("megatron-id", lambda: args.func(args), debug=debug)


def entry() -> None:
    """The `megatron-id` program. After a training run, the process ends with os._exit once
    stdout/stderr are flushed: C++ objects of DeepSpeed and torch.distributed torn down by the
    interpreter at exit can abort ("terminate called without an active exception", exit 1
    after a successful run), which breaks SLURM `afterok` chains and requeue logic."""
    status = main()
    if _TEARDOWN:
        for fn in _TEARDOWN:
            fn()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
