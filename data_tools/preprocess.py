"""Tokenize a corpus into Megatron indexed binaries: <output-prefix>_<key>_document.{bin,idx}.

    python -m data_tools.preprocess --input 'fineweb/*.parquet' --tokenizer tokenizer.json \\
        --output-prefix data/fineweb --append-eod --workers 8 --min-int-score 3
    (also: megatron-id preprocess ...)

Flags follow Megatron-LM's tools/preprocess_data.py (--input, --json-keys, --tokenizer-model,
--vocab-file/--merge-file, --append-eod, --output-prefix, --workers, --partitions; GPT-NeoX's
--jsonl-keys is accepted too). FineWeb-Edu filters apply to rows that have the field.

How it runs: one reader thread streams documents in batches (bounded queue, so memory stays
flat whatever the input size) while the main thread tokenizes each batch with `tokenizers`'
encode_batch, which releases the GIL and spreads the batch over --workers threads; batches are
written in input order, so the output bytes do not depend on --workers. Outputs are written
under temporary names and renamed when complete. With --partitions K the inputs are split into
K groups written separately and then merged (and the parts removed).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import os
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np

from megatron_id.data.indexed_dataset import IndexedDatasetWriter, best_dtype
from megatron_id.errors import UserError, run_guarded

from .progress import Progress
from .readers import InputError, Record, expand_inputs, iter_documents
from .tokenizer import TokenizerError, eod_id, load_tokenizer

BATCH_CHARS = 4_000_000   # text per tokenizer call; ~1M tokens


class PreprocessError(UserError, ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data_tools.preprocess", description=__doc__.splitlines()[0])
    io_ = p.add_argument_group("input / output")
    io_.add_argument("--input", nargs="+", required=True, help="files, globs or HF dataset folders")
    io_.add_argument("--json-keys", "--jsonl-keys", nargs="+", default=["text"], dest="json_keys",
                     help="fields to tokenize; one dataset per key (default: text)")
    io_.add_argument("--output-prefix", required=True)
    io_.add_argument("--partitions", type=int, default=1, help="split inputs into K parts, then merge")
    tok = p.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer",
                     help="HF tokenizer.json, or a folder holding one")
    tok.add_argument("--tokenizer-type", default=None,
                     help="accepted for Megatron compatibility; the files given decide the tokenizer")
    tok.add_argument("--vocab-file", help="GPT-2 style vocab.json (with --merge-file)")
    tok.add_argument("--merge-file", help="GPT-2 style merges.txt")
    tok.add_argument("--append-eod", action="store_true", help="append the end-of-document token")
    tok.add_argument("--eod-token", default=None, help="end-of-document token (default: found in the vocabulary)")
    filt = p.add_argument_group("FineWeb-Edu filters (apply when the row has the field)")
    filt.add_argument("--min-int-score", type=int, default=None)
    filt.add_argument("--min-score", type=float, default=None)
    filt.add_argument("--language", default=None)
    filt.add_argument("--min-language-score", type=float, default=None)
    run = p.add_argument_group("run")
    run.add_argument("--workers", type=int, default=1, help="tokenizer threads")
    run.add_argument("--strict", action="store_true",
                     help="stop at the first bad document (naming file and line) instead of skipping it")
    run.add_argument("--no-progress", action="store_true")
    return p


def output_prefix(prefix: str, key: str) -> str:
    """Megatron's naming: <output-prefix>_<json-key>_document (the famous _text_document)."""
    return f"{prefix}_{key}_document"


class Stats:
    def __init__(self):
        self.read = self.written = self.tokens = 0
        self.skipped = collections.Counter()

    def skip(self, reason):
        self.skipped[reason] += 1


def _filter_reason(row: dict, args) -> str | None:
    checks = [("int_score", args.min_int_score, lambda v, t: v >= t, "int_score < {}"),
              ("score", args.min_score, lambda v, t: v >= t, "score < {}"),
              ("language", args.language, lambda v, t: v == t, "language != {}"),
              ("language_score", args.min_language_score, lambda v, t: v >= t, "language_score < {}")]
    for field, threshold, keep, why in checks:
        if threshold is not None and row.get(field) is not None and not keep(row[field], threshold):
            return "filtered: " + why.format(threshold)
    return None


def _batches(records, keys, args, stats, out: queue.Queue, stop: threading.Event):
    """Reader thread: validated texts grouped into batches of ~BATCH_CHARS characters."""
    try:
        batch, size = [], 0
        for item in records:
            if stop.is_set():
                return
            stats.read += 1
            reason = None
            if not isinstance(item, Record):
                reason, where = item.reason, (item.source, item.line)
            else:
                where = (item.source, item.line)
                missing = [k for k in keys if k not in item.data]
                bad_type = [k for k in keys if k in item.data and not isinstance(item.data[k], str)]
                if missing:
                    reason = f"missing key '{missing[0]}'"
                elif bad_type:
                    reason = f"key '{bad_type[0]}' is not a string"
                elif all(not item.data[k].strip() for k in keys):
                    reason = "empty document"
                else:
                    reason = _filter_reason(item.data, args)
            if reason is not None:
                if args.strict and not reason.startswith("filtered"):
                    raise PreprocessError(f"{where[0]}:{where[1]}: {reason} (run without --strict "
                                          f"to skip and count such documents)")
                stats.skip(reason)
                continue
            texts = [item.data[k] for k in keys]
            batch.append(texts)
            size += sum(len(t) for t in texts)
            if size >= BATCH_CHARS:
                out.put(batch)
                batch, size = [], 0
        if batch:
            out.put(batch)
        out.put(None)
    except BaseException as err:   # hand the error to the main thread
        out.put(err)


def _encode(tokenizer, texts, eod):
    """One flat id array and the per-document lengths. encode_batch_fast skips the character
    offsets we do not need and releases the GIL while its threads work."""
    ids = [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    if eod is not None:
        flat = np.insert(flat, np.cumsum(lengths), eod)
        lengths += 1
    return flat, lengths


def _write_part(files, prefixes, tokenizer, eod, dtype, args, stats, progress):
    keys = args.json_keys
    writers = [IndexedDatasetWriter(p, dtype) for p in prefixes]
    counters = []
    pending: queue.Queue = queue.Queue(maxsize=4)   # bounded: memory does not grow with input
    stop = threading.Event()
    reader = threading.Thread(target=_batches, daemon=True, args=(
        iter_documents(files, columns=keys, counter=counters), keys, args, stats, pending, stop))
    reader.start()
    try:
        while True:
            batch = pending.get()
            if batch is None:
                break
            if isinstance(batch, BaseException):
                raise batch
            for k, writer in enumerate(writers):
                flat, lengths = _encode(tokenizer, [texts[k] for texts in batch], eod)
                empty = lengths == (0 if eod is None else 1)
                if empty.any():   # text that tokenizes to nothing: skip it like an empty document
                    flat, lengths = flat[np.repeat(~empty, lengths)], lengths[~empty]
                writer.add_many(flat, lengths)
                if k == 0:   # the summary counts documents of the first key
                    if empty.any():
                        stats.skipped["empty after tokenization"] += int(empty.sum())
                    stats.written += len(lengths)
                    stats.tokens += int(lengths.sum())
            progress.update(stats, sum(c.count for c in counters))
        reader.join()
    except BaseException:
        stop.set()
        for w in writers:
            w.abort()
        raise
    for w in writers:
        w.finalize()


def run(args) -> Stats:
    if args.workers < 1:
        raise PreprocessError(f"--workers {args.workers}: must be at least 1.")
    # the tokenizer's thread pool reads this once, at its first parallel call
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    tokenizer = load_tokenizer(args.tokenizer, args.vocab_file, args.merge_file)   # fails before work
    eod = eod_id(tokenizer, args.eod_token) if args.append_eod else None
    files = expand_inputs(args.input)
    dtype = best_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    out_dir = Path(args.output_prefix).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(out_dir, os.W_OK):
        raise PreprocessError(f"cannot write to output folder {out_dir}.")

    stats, start = Stats(), time.time()
    total_bytes = sum(p.stat().st_size for p in files if p.is_file())
    progress = Progress(total_bytes, enabled=not args.no_progress)
    finals = [output_prefix(args.output_prefix, k) for k in args.json_keys]
    parts = max(1, min(args.partitions, len(files)))
    if parts == 1:
        _write_part(files, finals, tokenizer, eod, dtype, args, stats, progress)
    else:
        from .merge import merge_datasets
        groups = [files[i::parts] for i in range(parts)]
        part_prefixes = [[f"{p}_part{i}" for p in finals] for i in range(parts)]
        try:
            for group, prefixes in zip(groups, part_prefixes):
                _write_part(group, prefixes, tokenizer, eod, dtype, args, stats, progress)
            for k, final in enumerate(finals):
                merge_datasets([prefixes[k] for prefixes in part_prefixes], final)
        finally:
            for prefixes in part_prefixes:
                for p in prefixes:
                    for ext in (".bin", ".idx"):
                        Path(p + ext).unlink(missing_ok=True)
    progress.close(stats, total_bytes)
    stats.seconds = time.time() - start
    stats.outputs = finals
    return stats


def summary(stats: Stats) -> str:
    lines = [f"documents read: {stats.read:,}", f"documents written: {stats.written:,}",
             f"tokens written: {stats.tokens:,}",
             f"time: {stats.seconds:.1f} s ({stats.tokens / max(stats.seconds, 1e-9):,.0f} tokens/s)"]
    skipped = sum(stats.skipped.values())
    lines.append(f"documents skipped: {skipped:,}" + ("" if not skipped else ": " + ", ".join(
        f"{n:,} {reason}" for reason, n in stats.skipped.most_common())))
    lines += [f"output: {p}.bin, {p}.idx" for p in stats.outputs]
    return "\n".join(lines)


def main(argv=None, debug: bool = False) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        print(summary(run(args)), file=sys.stderr)
        return 0
    return run_guarded("preprocess", body, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
