"""Look inside an indexed dataset: statistics, a decoded document, an integrity check.

    python -m data_tools.inspect data/fineweb_text_document               # statistics
    python -m data_tools.inspect data/fineweb --doc 12 --tokenizer tokenizer.json
    python -m data_tools.inspect data/fineweb --check                     # exit 1 when broken
    python -m data_tools.inspect data/fineweb --check --vocab-size 50304  # ... or ids >= 50304

--check verifies the offsets and the document index, scans every token id (bounded memory) and
reports their range, negative ids, an .idx dtype code that contradicts the .meta.json sidecar
(e.g. an int16 index over uint16 data) and, with --vocab-size, ids the model could not embed.
A dataset that cannot be opened at all (missing, truncated) is one error line, exit 2, and so
is a --tokenizer other than the one the sidecar records (it would decode the ids into wrong
text; --allow-tokenizer-mismatch decodes with it anyway, after a warning).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from megatron_id.data.indexed_dataset import (IndexedDataset, matching_meta, meta_path, read_meta,
                                              token_id_report)
from megatron_id.errors import UserError, run_guarded

from megatron_id.data.tokenizer import MISMATCH_FLAG, check_same_tokenizer, load_tokenizer, tokenizer_identity


class InspectError(UserError, ValueError):
    pass


def statistics(ds: IndexedDataset) -> str:
    lengths = np.asarray(ds.lengths)
    rows = [("prefix", str(ds.prefix)), ("dtype", str(ds.dtype)), ("documents", f"{len(ds):,}"),
            ("tokens", f"{ds.num_tokens:,}")]
    if len(ds):
        rows += [("tokens per document (min / mean / max)",
                  f"{lengths.min():,} / {lengths.mean():,.1f} / {lengths.max():,}"),
                 ("empty documents", f"{int((lengths == 0).sum()):,}")]
    meta = read_meta(ds.prefix)
    if meta is not None:
        rows.append(("sidecar", f"{meta_path(ds.prefix)} (vocab_size {meta.get('vocab_size')}, "
                                f"tokenizer {meta.get('tokenizer')}"
                                + (f", {meta['tokenizer_id']}" if meta.get("tokenizer_id") else "") + ")"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def check_decoding_tokenizer(ds: IndexedDataset, tokenizer, given, allow: bool) -> None:
    """--tokenizer is the tokenizer the dataset was made with, as far as its sidecar tells: by
    identity, else (sidecars written before identities) by vocabulary size. Another one would
    decode its ids into plausible-looking wrong text."""
    meta = matching_meta(ds) or {}
    recorded, path, vocab = meta.get("tokenizer_id"), meta.get("tokenizer"), meta.get("vocab_size")
    own, size = tokenizer_identity(tokenizer), tokenizer.get_vocab_size(with_added_tokens=True)
    fix = (f"Pass the tokenizer the data was preprocessed with (--tokenizer {path or '...'}), or "
           f"{MISMATCH_FLAG} to decode with this one on purpose.")
    if recorded is not None:
        check_same_tokenizer((f"dataset {ds.prefix}", recorded, path), (f"--tokenizer {given}", own, None),
                             fix, allow=allow, warn=_warn)
    elif vocab is not None and vocab != size:
        check_same_tokenizer((f"dataset {ds.prefix}", f"of {vocab:,} tokens", path),
                             (f"--tokenizer {given}", f"of {size:,} tokens", None), fix, allow=allow, warn=_warn)


def _warn(message: str) -> None:
    print(f"inspect: warning: {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data_tools.inspect", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("prefix", help="dataset prefix (with or without _text_document, .bin or .idx)")
    p.add_argument("--doc", type=int, action="append", default=[], help="print document N (repeatable)")
    p.add_argument("--tokenizer", help="decode --doc with this tokenizer.json (else print ids); it must be "
                   "the one the dataset's sidecar records")
    p.add_argument(MISMATCH_FLAG, action="store_true",
                   help="decode with a --tokenizer other than the one the sidecar records, on purpose")
    p.add_argument("--check", action="store_true",
                   help="verify offsets, document index and every token id; exit 1 when broken")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="with --check: also fail when an id is >= this (the model's vocab_size)")
    return p


def main(argv=None, debug: bool = False) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        ds = IndexedDataset(args.prefix)   # header, sizes and truncation are checked on opening
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        if tokenizer is not None:
            check_decoding_tokenizer(ds, tokenizer, args.tokenizer, args.allow_tokenizer_mismatch)
        for n in args.doc:
            if not 0 <= n < len(ds):
                raise InspectError(f"--doc {n}: document {n} does not exist in {ds.prefix} "
                                   f"(0..{len(ds) - 1}).")
        print(statistics(ds))
        for n in args.doc:
            ids = ds[n].tolist()
            print(f"\n--- document {n} ({len(ids)} tokens) ---")
            print(tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ids)
        if not args.check:
            return 0
        problems = ds.check()
        info, id_problems = token_id_report(ds, args.vocab_size, scan=True, what="--vocab-size")
        problems += id_problems
        if info["min"] is not None:
            print(f"token ids: {info['min']:,} .. {info['max']:,}"
                  + (f" (vocabulary {info['vocab_size']:,}, from the sidecar)" if info["vocab_size"] else ""))
        print("integrity: " + ("broken" if problems else "ok"))
        sys.stdout.flush()
        for problem in problems:
            print(f"inspect: error: {problem}", file=sys.stderr)
        return 1 if problems else 0
    return run_guarded("inspect", body, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
