"""Look inside an indexed dataset: statistics, a decoded document, an integrity check.

    python -m data_tools.inspect data/fineweb_text_document               # statistics
    python -m data_tools.inspect data/fineweb --doc 12 --tokenizer tokenizer.json
    python -m data_tools.inspect data/fineweb --check                     # exit 1 when broken
    python -m data_tools.inspect data/fineweb --check --vocab-size 50304  # ... or ids >= 50304
    python -m data_tools.inspect data/megatron_made --write-meta --tokenizer tokenizer.json

--check verifies the offsets and the document index, scans every token id (bounded memory) and
reports their range, negative ids, an .idx dtype code that contradicts the .meta.json sidecar
(e.g. an int16 index over uint16 data), every chunk of the .bin against the checksums its sidecar
recorded, with --vocab-size ids the model could not embed, and ids the tokenizer that made the data
cannot produce (at or above the size of --tokenizer, else of the one the sidecar records),
whatever --vocab-size says.

--write-meta writes the `.meta.json` sidecar for data that has none (Megatron-LM's and NeoX's
tools write only .bin/.idx): the token-id range, the counts and the crc32 of every 16 MiB of the
.bin, in one pass; with --tokenizer also its path, identity, vocabulary and end-of-document id
(or --vocab-size alone). Training then reads the sidecar instead of scanning the .bin at every
launch, and checks the .bin against it (data.verify). A sidecar of ours that matches the pair but
predates checksums gets them (the rest kept); one that describes other data, or a file of that
name that is not ours, is refused (--replace-meta replaces a sidecar of ours).
A dataset that cannot be opened at all (missing, truncated) is one error line, exit 2, and so
is a --tokenizer other than the one the sidecar records (it would decode the ids into wrong
text; --allow-tokenizer-mismatch decodes with it anyway, after a warning).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from megatron_id.atomic import write_atomic_text
from megatron_id.data.indexed_dataset import (
    META_FORMAT,
    IndexedDataset,
    KnownTokenizer,
    matching_meta,
    meta_path,
    read_meta,
    scan_bin,
    temp_path,
    token_id_report,
    verify_bin,
)
from megatron_id.data.tokenizer import (
    MISMATCH_FLAG,
    check_same_tokenizer,
    load_tokenizer,
    tokenizer_file,
    tokenizer_identity,
)
from megatron_id.errors import UserError, run_guarded


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
                   help="verify offsets, document index and every token id (against --vocab-size and the "
                        "tokenizer's size: --tokenizer, else the sidecar's); exit 1 when broken")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="with --check: also fail when an id is >= this (the model's vocab_size); with "
                        "--write-meta: the vocabulary size to record")
    p.add_argument("--write-meta", action="store_true",
                   help="write the .meta.json sidecar (id range, counts, checksums) of data that has none")
    p.add_argument("--replace-meta", action="store_true",
                   help="with --write-meta: replace a sidecar of ours that describes other data")
    return p


def write_meta(ds: IndexedDataset, args, tokenizer) -> int:
    """--write-meta: see the module's docstring."""
    path = meta_path(ds.prefix)
    ours, matching = read_meta(ds.prefix), matching_meta(ds)
    if path.exists() and ours is None:
        raise InspectError(f"{path} exists and is not a megatron_id sidecar: nothing was written. Move it "
                           f"away if it is not needed, then run --write-meta again.")
    if matching is not None and isinstance(matching.get("checksum"), dict) and not args.replace_meta:
        print(f"{path} already describes this pair, checksums included: nothing written")
        return 0
    if ours is not None and matching is None and not args.replace_meta:
        raise InspectError(f"{path} describes other data ({ours.get('num_tokens')} tokens in "
                           f"{ours.get('num_sequences')} sequences; the pair holds {ds.num_tokens} in {len(ds)}): "
                           f"nothing was written. If the .bin/.idx are the data you mean, add --replace-meta.")
    if matching is not None and matching.get("dtype") != str(ds.dtype) and not args.replace_meta:
        raise InspectError(f"{path} records {matching.get('dtype')} token ids but {ds.idx_path} declares {ds.dtype}: "
                           f"nothing was written; --check says more.")
    print(f"scanning {ds.bin_path} ({ds.bin_path.stat().st_size:,} bytes) ...", file=sys.stderr, flush=True)
    found = scan_bin(ds, checksum=True)
    keep = matching if matching is not None and not args.replace_meta else {}
    if keep and (found["min"], found["max"]) != (keep.get("min_token_id"), keep.get("max_token_id")):
        raise InspectError(f"{ds.bin_path} holds token ids {found['min']}..{found['max']} but {path} records "
                           f"{keep.get('min_token_id')}..{keep.get('max_token_id')}: the .bin changed after the "
                           f"sidecar was written; nothing was written. --check says more; --replace-meta records "
                           f"the .bin as it is now.")
    vocab = args.vocab_size or (tokenizer.get_vocab_size(with_added_tokens=True) if tokenizer is not None else None) \
        or keep.get("vocab_size")
    if vocab is not None and found["max"] is not None and found["max"] >= vocab:
        raise InspectError(f"{ds.bin_path} holds token id {found['max']}, not below the vocabulary size {vocab} "
                           f"to record: nothing was written. Give the vocabulary of the tokenizer that made it.")
    if tokenizer is not None:
        from megatron_id.data.tokenizer import EOD_CANDIDATES
        named = {"tokenizer": str(Path(args.tokenizer).resolve()), "tokenizer_id": tokenizer_identity(tokenizer),
                 "eod_id": next((tokenizer.token_to_id(c) for c in EOD_CANDIDATES
                                 if tokenizer.token_to_id(c) is not None), None)}
    else:
        named = {k: keep.get(k) for k in ("tokenizer", "tokenizer_id", "eod_id")}
    meta = {"format": META_FORMAT, "dtype": str(ds.dtype), "vocab_size": vocab, "max_token_id": found["max"],
            "min_token_id": found["min"], "num_sequences": len(ds), "num_documents": len(ds.document_index) - 1,
            "num_tokens": ds.num_tokens, **named, "bin_bytes": ds.bin_path.stat().st_size,
            "checksum": found["checksum"]}
    # the data tools' temporary name: a later preprocess or merge of this prefix removes it if a kill left it
    write_atomic_text(path, json.dumps(meta, indent=1) + "\n", temp=temp_path(path))
    print(f"wrote {path}: token ids {found['min']}..{found['max']}, {len(found['checksum']['chunks']):,} chunk "
          f"checksum(s)" + (f", vocabulary {vocab:,}" if vocab else ", vocabulary unknown (give --tokenizer or "
                                                                      "--vocab-size to record it)"))
    return 0


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
        if args.replace_meta and not args.write_meta:
            raise InspectError("--replace-meta goes with --write-meta (it says which sidecar may be replaced).")
        if args.write_meta:
            return write_meta(ds, args, tokenizer)
        print(statistics(ds))
        for n in args.doc:
            ids = ds[n].tolist()
            print(f"\n--- document {n} ({len(ids)} tokens) ---")
            print(tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ids)
            size = tokenizer.get_vocab_size(with_added_tokens=True) if tokenizer else None
            beyond = sorted({i for i in ids if i >= size}) if size else []
            if beyond:   # the tokenizer's decode leaves them out of the text without a word
                count = sum(i >= size for i in ids)
                _warn(f"document {n} holds {count:,} id{'s' if count > 1 else ''} that --tokenizer {args.tokenizer} "
                      f"({size:,} tokens) cannot decode ({', '.join(map(str, beyond[:4]))}"
                      f"{', ...' if len(beyond) > 4 else ''}): left out of the text above. --check says more.")
        if not args.check:
            return 0
        problems = ds.check()
        known = None if tokenizer is None else KnownTokenizer(
            f"--tokenizer {args.tokenizer}", tokenizer.get_vocab_size(with_added_tokens=True),
            str(tokenizer_file(args.tokenizer)))
        info, id_problems = token_id_report(ds, args.vocab_size, scan=True, what="--vocab-size", tokenizer=known,
                                            tokenizer_option="--tokenizer")
        problems += id_problems
        if not id_problems:   # (a range already wrong says enough)
            problems += verify_bin(ds, full=True)
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
