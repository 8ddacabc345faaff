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
written in input order, so the output bytes do not depend on --workers. A document longer than
100,000 characters is tokenised in pieces cut where the ids are provably unchanged
(data_tools/pieces.py), so memory stays bounded for single huge documents too.

What it refuses, before any work: an output .bin/.idx that already exists (unless --overwrite),
a tokenizer or input that cannot be found, an output folder that is a file. What fails the run,
leaving any old output as it was and no temporary file behind: an input that ends early (a
truncated .gz/.zst), a run that writes no document at all (empty or non-JSON input, no row with
the key, filters that keep nothing), and with --strict any bad document. Outputs (.bin, .idx and
the .meta.json sidecar) are written under temporary names `.<name>.tmp-<pid>` and renamed only
once everything succeeded; temporary files of killed runs are removed at the next start. With
--partitions K the inputs are split into K groups written separately and then merged (the parts
live in a temporary folder that is always removed).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np

from megatron_id.data.indexed_dataset import (IndexedDataset, IndexedDatasetWriter, best_dtype,
                                              remove_stale_temps, temp_path)
from megatron_id.errors import UserError, run_guarded

from .outputs import check_outputs, make_folder, remove_folders, report_stale
from .pieces import PIECE_CHARS, PieceCutter
from .progress import Progress
from .readers import InputError, Record, expand_inputs, iter_documents
from megatron_id.data.tokenizer import TokenizerError, eod_id, load_tokenizer, tokenizer_file

BATCH_CHARS = 4_000_000   # characters per tokenizer call (and per reader batch); ~1M tokens


class PreprocessError(UserError, ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data_tools.preprocess", description=__doc__.splitlines()[0],
                                allow_abbrev=False)   # Megatron's --lang must not become --language
    io_ = p.add_argument_group("input / output")
    io_.add_argument("--input", nargs="+", required=True, help="files, globs or HF dataset folders")
    io_.add_argument("--json-keys", "--jsonl-keys", nargs="+", default=["text"], dest="json_keys",
                     help="fields to tokenize; one dataset per key (default: text)")
    io_.add_argument("--output-prefix", required=True)
    io_.add_argument("--overwrite", action="store_true",
                     help="replace existing outputs (only once the new ones are complete; without "
                          "this flag an existing .bin/.idx stops the run before any work)")
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
    filt = p.add_argument_group(
        "FineWeb-Edu filters",
        "They apply to rows that have the field. Documents they remove are intended: they are "
        "counted in the summary ('filtered: ...'), never an error, and --strict ignores them; "
        "only a run in which they keep no document at all fails (showing the values seen).")
    filt.add_argument("--min-int-score", type=int, default=None)
    filt.add_argument("--min-score", type=float, default=None)
    filt.add_argument("--language", default=None, help="keep rows whose language equals this exactly (e.g. en)")
    filt.add_argument("--min-language-score", type=float, default=None)
    run = p.add_argument_group("run")
    run.add_argument("--workers", type=int, default=1, help="tokenizer threads")
    run.add_argument("--strict", action="store_true",
                     help="fail at the first bad document (malformed, not UTF-8, missing or "
                          "non-string key, empty), naming file and line, instead of skipping and "
                          "counting it; filtered documents are not bad")
    run.add_argument("--no-progress", action="store_true")
    return p


def output_prefix(prefix: str, key: str) -> str:
    """Megatron's naming: <output-prefix>_<json-key>_document (the famous _text_document)."""
    return f"{prefix}_{key}_document"


class Stats:
    def __init__(self):
        self.read = self.written = self.tokens = 0
        self.skipped = collections.Counter()
        self.keys_seen = collections.Counter()   # keys of rows that lacked a --json-keys key
        self.filter_values: dict[str, collections.Counter] = {}   # text values that got rows filtered
        self.filter_max: dict[str, float] = {}   # the highest number that got rows filtered
        self.outputs, self.seconds, self.stale_removed = [], 0.0, []
        self.cut_documents = self.uncut_documents = 0

    def skip(self, reason):
        self.skipped[reason] += 1

    def saw_filtered(self, field, value):
        if isinstance(value, str):
            seen = self.filter_values.setdefault(field, collections.Counter())
            if value in seen or len(seen) < 50:   # a few distinct values are enough to explain
                seen[value] += 1
        else:
            self.filter_max[field] = max(value, self.filter_max.get(field, value))


FILTERS = [("int_score", "min_int_score", "--min-int-score", lambda v, t: v >= t, "int_score < {}"),
           ("score", "min_score", "--min-score", lambda v, t: v >= t, "score < {}"),
           ("language", "language", "--language", lambda v, t: v == t, "language != {}"),
           ("language_score", "min_language_score", "--min-language-score", lambda v, t: v >= t,
            "language_score < {}")]


def _filter_reason(row: dict, args, stats: Stats) -> str | None:
    """None to keep the row; 'filtered: ...' when a filter removes it (intended, only counted);
    another reason when the field cannot be compared (a bad document)."""
    for field, dest, _, keep, why in FILTERS:
        threshold, value = getattr(args, dest), row.get(field)
        if threshold is None or value is None:
            continue
        try:
            kept = keep(value, threshold)
        except TypeError:
            return f"field '{field}' is not a number"
        if not kept:
            stats.saw_filtered(field, value)
            return "filtered: " + why.format(threshold)
    return None


def _batches(records, keys, args, stats, out: queue.Queue, stop: threading.Event):
    """Reader thread: validated texts grouped into batches of ~BATCH_CHARS characters, each
    entry (texts, (source, line))."""
    try:
        batch, size = [], 0
        for item in records:
            if stop.is_set():
                return
            stats.read += 1
            reason = None
            where = (item.source, item.line)
            if not isinstance(item, Record):
                reason = item.reason
            else:
                missing = [k for k in keys if k not in item.data]
                bad_type = [k for k in keys if k in item.data and not isinstance(item.data[k], str)]
                if missing:
                    reason = f"missing key '{missing[0]}'"
                    if stats.skipped[reason] < 1000:   # enough rows to say which keys they have
                        stats.keys_seen.update(item.data.keys())
                elif bad_type:
                    reason = f"key '{bad_type[0]}' is not a string"
                elif all(not item.data[k].strip() for k in keys):
                    reason = "empty document"
                else:
                    reason = _filter_reason(item.data, args, stats)
            if reason is not None:
                if args.strict and not reason.startswith("filtered"):
                    raise PreprocessError(f"{where[0]}:{where[1]}: {reason} (run without --strict "
                                          f"to skip and count such documents)")
                stats.skip(reason)
                continue
            texts = [item.data[k] for k in keys]
            batch.append((texts, where))
            size += sum(len(t) for t in texts)
            if size >= BATCH_CHARS:
                out.put(batch)
                batch, size = [], 0
        if batch:
            out.put(batch)
        out.put(None)
    except BaseException as err:   # hand the error to the main thread
        out.put(err)


def _groups(spans, limit):
    """Consecutive groups of (document, start, end) spans of at most `limit` characters in all
    (a longer span alone)."""
    group, size = [], 0
    for span in spans:
        n = span[2] - span[1]
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append(span)
        size += n
    if group:
        yield group


def _encode(tokenizer, cutter: PieceCutter, texts, eod):
    """One flat id array and the per-document lengths. Long documents are cut into pieces (the
    ids are those of the whole document, see pieces.py), at most BATCH_CHARS characters go to
    one encode call, and each call's ids become a numpy array at once (as Python lists they
    cost ~40 bytes a token). encode_batch_fast skips the character offsets we do not need and
    releases the GIL while its threads work."""
    spans = []
    for d, text in enumerate(texts):
        bounds = cutter.bounds(text)
        spans.extend((d, a, b) for a, b in zip(bounds, bounds[1:]))
    flats = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    for group in _groups(spans, BATCH_CHARS):
        pieces = [texts[d] if b - a == len(texts[d]) else texts[d][a:b] for d, a, b in group]
        ids = [e.ids for e in tokenizer.encode_batch_fast(pieces, add_special_tokens=False)]
        del pieces
        counts = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        np.add.at(lengths, [d for d, _, _ in group], counts)
        # int32 holds any id (vocabularies are far below 2**31) at half the memory of int64
        flats.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32,
                                 count=int(counts.sum())))
        del ids
    flat = flats[0] if len(flats) == 1 else np.concatenate(flats or [np.zeros(0, dtype=np.int32)])
    if eod is not None:
        flat = np.insert(flat, np.cumsum(lengths), eod)
        lengths += 1
    return flat, lengths


def _write_part(files, writers, tokenizer, cutter, eod, args, stats, progress):
    """Tokenize `files` into `writers` (one per --json-keys key). The caller finalizes or
    aborts the writers."""
    keys = args.json_keys
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
                flat, lengths = _encode(tokenizer, cutter, [texts[k] for texts, _ in batch], eod)
                empty = lengths == (0 if eod is None else 1)
                if empty.any():   # text that tokenizes to nothing: skip it like an empty document
                    if args.strict:
                        source, line = batch[int(np.flatnonzero(empty)[0])][1]
                        raise PreprocessError(f"{source}:{line}: key '{keys[k]}' is empty after "
                                              f"tokenization (run without --strict to skip and "
                                              f"count such documents)")
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
        deadline = time.time() + 10
        while reader.is_alive() and time.time() < deadline:   # it may wait on the full queue
            try:
                pending.get(timeout=0.1)
            except queue.Empty:
                pass
        raise


def _quote(values: collections.Counter) -> str:
    return ", ".join(f"{v!r} ({n:,})" for v, n in values.most_common(5)) + \
        (", ..." if len(values) > 5 else "")


def _nothing_written(stats: Stats, files, args) -> str:
    """Why a run wrote no document, with what to change."""
    where = str(files[0]) if len(files) == 1 else f"{len(files)} inputs ({files[0]}, ...)"
    if stats.read == 0:
        empty = [str(f) for f in files if f.is_file() and f.stat().st_size == 0]
        if len(files) == 1 and empty:
            what = f"{where} is empty (0 bytes)"
        else:
            what = f"{where} holds no documents" + (
                f" ({', '.join(empty[:3])}{', ...' if len(empty) > 3 else ''}: 0 bytes)" if empty else "")
        return f"no document was written: {what}. Check --input: the output would be an empty dataset."
    reasons = ", ".join(f"{n:,} {r}" for r, n in stats.skipped.most_common())
    text = (f"no document was written: all {stats.read:,} documents read from {where} were "
            f"skipped ({reasons}).")
    hints = []
    if any(r.startswith("missing key") for r in stats.skipped) and stats.keys_seen:
        keys = ", ".join(repr(k) for k, _ in stats.keys_seen.most_common(8))
        hints.append(f"The rows have the keys {keys}: name the text field with --json-keys.")
    if stats.skipped["not UTF-8"] + stats.skipped["malformed JSON"] + stats.skipped["not a JSON object"] \
            >= stats.read / 2:
        hints.append("Is it really JSON lines (one JSON object with a text field per line)?")
    for field, dest, flag, _, _ in FILTERS:
        threshold = getattr(args, dest)
        seen = stats.filter_values.get(field)
        if seen:
            shown = f"Every row's {field} is {next(iter(seen))!r}" if len(seen) == 1 else \
                f"The values of {field} seen are {_quote(seen)}"
            hints.append(f"{shown}, and {flag} {threshold!r} keeps only rows whose {field} equals "
                         f"it exactly.")
        elif field in stats.filter_max:
            hints.append(f"The highest {field} filtered out is {stats.filter_max[field]}, below "
                         f"{flag} {threshold}.")
    if any(r.startswith("filtered") for r in stats.skipped):
        hints.append("Filters that keep nothing are an error: change or drop them.")
    return " ".join([text] + hints)


def run(args) -> Stats:
    if args.workers < 1:
        raise PreprocessError(f"--workers {args.workers}: must be at least 1.")
    if args.partitions < 1:
        raise PreprocessError(f"--partitions {args.partitions}: must be at least 1.")
    tokenizer = load_tokenizer(args.tokenizer, args.vocab_file, args.merge_file)   # fails before work
    eod = eod_id(tokenizer, args.eod_token) if args.append_eod else None
    files = expand_inputs(args.input)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = best_dtype(vocab_size)
    finals = [output_prefix(args.output_prefix, k) for k in args.json_keys]
    check_outputs([Path(f"{p}{ext}") for p in finals for ext in (".bin", ".idx")], "--output-prefix",
                  args.output_prefix, args.overwrite)

    # the tokenizer's thread pool reads this once, at its first parallel call
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    created = make_folder(Path(finals[0]).parent)
    stats, start = Stats(), time.time()
    stats.stale_removed = remove_stale_temps(
        [f for p in finals for f in (Path(f"{p}.bin"), Path(f"{p}.idx"), Path(f"{p}.meta.json"),
                                     Path(f"{p}.parts"))])
    report_stale("preprocess", stats.stale_removed)
    total_bytes = sum(p.stat().st_size for p in files if p.is_file())
    progress = Progress(total_bytes, enabled=not args.no_progress)
    cutter = PieceCutter(tokenizer, PIECE_CHARS)
    recorded = tokenizer_file(args.tokenizer)
    writers = []
    try:
        for p in finals:   # one by one: a failure aborts those already opened
            writers.append(IndexedDatasetWriter(p, dtype, vocab_size=vocab_size, eod_id=eod,
                                                tokenizer=None if recorded is None else str(recorded)))
        parts = max(1, min(args.partitions, len(files)))
        if parts == 1:
            _write_part(files, writers, tokenizer, cutter, eod, args, stats, progress)
        else:
            _write_partitions(files, parts, writers, tokenizer, cutter, eod, dtype, args, stats,
                              progress, temp_path(f"{finals[0]}.parts"))
        if stats.written == 0:
            raise PreprocessError(_nothing_written(stats, files, args))
        for w in writers:   # every output complete under its temporary name ...
            w.prepare()
        for w in writers:   # ... before any old one is replaced
            w.commit()
    except BaseException:
        for w in writers:
            w.abort()
        remove_folders(created)
        raise
    progress.close(stats, total_bytes)
    stats.cut_documents, stats.uncut_documents = cutter.cut_documents, cutter.uncut_documents
    stats.seconds = time.time() - start
    stats.outputs = finals
    return stats


def _write_partitions(files, parts, writers, tokenizer, cutter, eod, dtype, args, stats, progress,
                      folder: Path):
    """--partitions: the files split round-robin into `parts` groups, each written to its own
    dataset in a private temporary folder, then appended to the outputs in order. The folder
    (named like our temporary files, so a killed run's is removed at the next start) never
    collides with user files and is always removed."""
    folder.mkdir()
    try:
        groups = [files[i::parts] for i in range(parts)]
        for i, group in enumerate(groups):
            part_writers = [IndexedDatasetWriter(folder / f"part{i}_key{k}", dtype)
                            for k in range(len(writers))]
            try:
                _write_part(group, part_writers, tokenizer, cutter, eod, args, stats, progress)
            except BaseException:
                for w in part_writers:
                    w.abort()
                raise
            for w in part_writers:
                w.finalize()
        for k, writer in enumerate(writers):
            for i in range(parts):
                writer.append(IndexedDataset(folder / f"part{i}_key{k}"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def summary(stats: Stats) -> str:
    lines = [f"documents read: {stats.read:,}", f"documents written: {stats.written:,}",
             f"tokens written: {stats.tokens:,}",
             f"time: {stats.seconds:.1f} s ({stats.tokens / max(stats.seconds, 1e-9):,.0f} tokens/s)"]
    skipped = sum(stats.skipped.values())
    lines.append(f"documents skipped: {skipped:,}" + ("" if not skipped else ": " + ", ".join(
        f"{n:,} {reason}" for reason, n in stats.skipped.most_common())))
    if stats.cut_documents or stats.uncut_documents:
        lines.append(f"documents longer than {PIECE_CHARS:,} characters, tokenised in pieces: "
                     f"{stats.cut_documents:,}" + (f" ({stats.uncut_documents:,} kept a part above that "
                                                   f"size: no safe cut found)" if stats.uncut_documents else ""))
    lines += [f"output: {p}.bin, {p}.idx, {p}.meta.json" for p in stats.outputs]
    return "\n".join(lines)


def main(argv=None, debug: bool = False) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        print(summary(run(args)), file=sys.stderr)
        return 0
    return run_guarded("preprocess", body, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
