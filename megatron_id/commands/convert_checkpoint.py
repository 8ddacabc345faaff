"""`megatron-id convert-checkpoint`: a ZeRO-0/1/2 checkpoint copied with its optimizer state
made loadable at any layout (checkpoint/reshard.py)."""
from __future__ import annotations


def add_parser(sub) -> None:
    cc = sub.add_parser("convert-checkpoint", allow_abbrev=False,
                        help="copy a ZeRO-0/1/2 checkpoint with its optimizer state made loadable at any layout")
    cc.add_argument("--input", required=True, help="train.save folder (its latest) or iter_ folder")
    cc.add_argument("--output", required=True, help="a new folder (a train.save folder for train.load)")
    cc.add_argument("--tensor-parallel", type=int, default=None,
                    help="the TP size you will load at: checked against the model before converting")
    cc.add_argument("--pipeline-parallel", type=int, default=None,
                    help="the PP size you will load at: checked against the model before converting")
    cc.set_defaults(func=run)


def run(args) -> int:
    """Add the re-shardable optimizer state to a checkpoint written without it (ZeRO-0/1/2), in a
    new folder: it then resumes WITH its optimizer state at any layout (checkpoint/reshard.py)."""
    from ..checkpoint.reshard import FOLDER, convert  # torch: not at import (cli.py)
    folder = convert(args.input, args.output, args.tensor_parallel, args.pipeline_parallel)
    print(f"{folder}: the checkpoint of {args.input} with its optimizer state per parameter in "
          f"{folder / FOLDER}; train from it at any layout with train.load={args.output}")
    return 0
