"""Look inside an indexed dataset: statistics, a decoded document, an integrity check.

    python -m data_tools.inspect data/fineweb_text_document               # statistics
    python -m data_tools.inspect data/fineweb --doc 12 --tokenizer tokenizer.json
    python -m data_tools.inspect data/fineweb --check                     # exit 1 when broken
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from megatron_id.data.indexed_dataset import IndexedDataset, IndexedDatasetError

from .tokenizer import TokenizerError, load_tokenizer


def statistics(ds: IndexedDataset) -> str:
    lengths = np.asarray(ds.lengths)
    rows = [("prefix", str(ds.prefix)), ("dtype", str(ds.dtype)), ("documents", f"{len(ds):,}"),
            ("tokens", f"{ds.num_tokens:,}")]
    if len(ds):
        rows += [("tokens per document (min / mean / max)",
                  f"{lengths.min():,} / {lengths.mean():,.1f} / {lengths.max():,}"),
                 ("empty documents", f"{int((lengths == 0).sum()):,}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_tools.inspect", description=__doc__.splitlines()[0])
    p.add_argument("prefix", help="dataset prefix (with or without _text_document, .bin or .idx)")
    p.add_argument("--doc", type=int, action="append", default=[], help="print document N (repeatable)")
    p.add_argument("--tokenizer", help="decode --doc with this tokenizer.json (else print ids)")
    p.add_argument("--check", action="store_true", help="verify sizes, offsets and document index")
    args = p.parse_args(argv)
    try:
        ds = IndexedDataset(args.prefix)   # header, sizes and truncation are checked on opening
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    except (IndexedDatasetError, TokenizerError) as err:
        print(f"inspect: error: {err}", file=sys.stderr)
        return 1
    print(statistics(ds))
    for n in args.doc:
        if not 0 <= n < len(ds):
            print(f"inspect: error: document {n} does not exist (0..{len(ds) - 1}).", file=sys.stderr)
            return 1
        ids = ds[n].tolist()
        print(f"\n--- document {n} ({len(ids)} tokens) ---")
        print(tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ids)
    if args.check:
        problems = ds.check()
        for problem in problems:
            print(f"BROKEN: {problem}", file=sys.stderr)
        print("integrity: " + ("broken" if problems else "ok"))
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
