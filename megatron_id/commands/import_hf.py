"""`megatron-id import-hf`: an exported folder -> a training checkpoint at any TP/PP."""
from __future__ import annotations

from .options import MISMATCH_HELP, add_verify_arg


def add_parser(sub) -> None:
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
    i.add_argument("--allow-tokenizer-mismatch", action="store_true", help=MISMATCH_HELP)
    add_verify_arg(i)
    i.set_defaults(func=run)


def run(args) -> int:
    from ..hf.export import import_hf  # torch: not at import (cli.py)
    out = import_hf(args.input, args.output, args.tensor_parallel, args.pipeline_parallel,
                    overwrite=args.overwrite, allow_tokenizer_mismatch=args.allow_tokenizer_mismatch,
                    verify=args.verify)
    print(f"imported {args.input} -> {out} (TP={args.tensor_parallel}, PP={args.pipeline_parallel}; "
          f"weights only: train with train.load={out})")
    return 0
