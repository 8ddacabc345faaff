"""`megatron-id convert`: a softmax checkpoint -> a weights-only checkpoint whose layers
--layer-pattern marks I (or S) are interdomain (S4D-only) layers initialised from the attention
they replace (checkpoint/conversion.py, model/convert.py; docs/conversion.md)."""
from __future__ import annotations


def add_parser(sub) -> None:
    c = sub.add_parser("convert", allow_abbrev=False,
                       help="a softmax checkpoint -> interdomain / hybrid layers initialised from its attention "
                            "(docs/conversion.md)")
    c.add_argument("--checkpoint", required=True,
                   help="a softmax training checkpoint (its train.save folder or an iter_ folder), e.g. one written "
                        "by megatron-id import-hf")
    c.add_argument("--output", required=True,
                   help="a new or empty folder (a non-empty one is refused: see --overwrite)")
    c.add_argument("--layer-pattern", default=None, metavar="PATTERN",
                   help="one letter per layer: I (interdomain) or S (S4D-only) converts a layer, A / W keeps it as the "
                        "source has it; | marks pipeline stages (e.g. IIAIIIAI). With --select: I only, or left out")
    c.add_argument("--select", type=int, default=None, metavar="N",
                   help="choose the pattern: keep the N layers of lowest attention entropy on --data-path as softmax, "
                        "convert the others to I")
    c.add_argument("--data-path", default=None, metavar="PREFIX",
                   help="--select's tokens: a dataset prefix written by megatron-id preprocess with the model's "
                        "tokenizer")
    c.add_argument("--select-samples", type=int, default=8, help="sequences --select measures attention on")
    c.add_argument("--select-seq-length", type=int, default=512, help="tokens per --select sequence")
    c.add_argument("--tensor-parallel", type=int, default=None, help="TP of the checkpoint written (default: the "
                   "source's)")
    c.add_argument("--pipeline-parallel", type=int, default=None, help="PP of the checkpoint written (default: the "
                   "source's)")
    c.add_argument("--seed", type=int, default=42,
                   help="the model init's seed: the new tensors are those LanguageModel(student, seed) draws")
    c.add_argument("--overwrite", action="store_true",
                   help="replace --output when it holds one earlier import or conversion and nothing else")
    c.add_argument("overrides", nargs="*", metavar="model.KEY=VALUE",
                   help="the new layers' switches (default: the interdomain defaults), e.g. model.query_readout=false "
                        "model.state_size=32")
    c.set_defaults(func=run)


def run(args) -> int:
    # torch: not at import (cli.py)
    from ..checkpoint.conversion import convert, summary
    from .import_hf import model_overrides
    done = convert(args.checkpoint, args.output, args.layer_pattern, args.tensor_parallel, args.pipeline_parallel,
                   args.overrides, seed=args.seed, overwrite=args.overwrite, select=args.select,
                   data_path=args.data_path, select_samples=args.select_samples,
                   select_seq_length=args.select_seq_length)
    print(f"converted {args.checkpoint} -> {done.output} (TP={done.layout['tensor']}, PP={done.layout['pipe']}; "
          f"pattern {done.record['pattern']}; seed {args.seed})")
    for line in summary(done):
        print(line)
    tokenizer = f" data.tokenizer={done.tokenizer}" if done.tokenizer else ""
    print(f"weights only: train with train.load={done.output}{tokenizer} and its model: {model_overrides(done.output)}")
    return 0

