"""`megatron-id export-hf`: a training checkpoint -> a Hugging Face folder."""
from __future__ import annotations

from .options import MISMATCH_HELP


def add_parser(sub) -> None:
    e = sub.add_parser("export-hf", help="a training checkpoint -> a Hugging Face folder", allow_abbrev=False)
    e.add_argument("--checkpoint", required=True, help="train.save folder (uses `latest`) or an iter_ folder")
    e.add_argument("--output", required=True,
                   help="a new or empty folder (a non-empty one is refused: see --overwrite)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace --output when it holds an earlier export and nothing else")
    e.add_argument("--tokenizer", help="tokenizer.json (default: the one recorded in the checkpoint)")
    e.add_argument("--prefill-chunk-size", type=int, default=2048)
    e.add_argument("--allow-tokenizer-mismatch", action="store_true", help=MISMATCH_HELP)
    e.set_defaults(func=run)


def run(args) -> int:
    from ..hf.export import export_hf  # torch: not at import (cli.py)
    out = export_hf(args.checkpoint, args.output, tokenizer=args.tokenizer,
                    prefill_chunk_size=args.prefill_chunk_size, overwrite=args.overwrite,
                    allow_tokenizer_mismatch=args.allow_tokenizer_mismatch)
    print(f"exported {args.checkpoint} -> {out} (load with AutoModelForCausalLM.from_pretrained("
          f"'{out}', trust_remote_code=True))")
    return 0
