"""Tokenize a corpus into Megatron indexed binaries: <output-prefix>_<key>_document.{bin,idx}.

    python -m data_tools.preprocess --input 'fineweb/*.parquet' --tokenizer tokenizer.json \\
        --output-prefix data/fineweb --append-eod --workers 8 --min-int-score 3
    (also: megatron-id preprocess ...)

Megatron-LM's and GPT-NeoX's command lines run unchanged: every flag of their preprocess
scripts is either implemented (--input, --json-keys/--jsonl-keys, --tokenizer-type,
--tokenizer-model, --vocab-file/--vocab/--merge-file, --vocab-size, --append-eod,
--output-prefix, --workers, --partitions, --log-interval, --ftfy, NeoX's comma-separated
--input), or declared in data_tools/compat.py with a note (no effect here, and why) or a
refusal (with the reason). FineWeb-Edu filters apply to rows that have the field.

Documents as Megatron writes them: a text may be a list of sentences (Megatron's split-sentence
JSON): each non-empty sentence becomes one sequence of the document, the end-of-document token
goes after the last. Empty and whitespace-only documents are skipped and counted by default;
with --keep-empty they are written as Megatron's preprocess_data.py writes them (an empty text: a
document of no sequence; whitespace: its tokens), with --keep-empty eod as its
preprocess_data_fast.py does (an empty text: the end-of-document token alone), so the output is
byte-identical to either tool's.

How it runs: one reader thread streams documents in batches (bounded queue, so memory stays
flat whatever the input size) while the main thread tokenizes each batch with the encoder
(gigatoken by default when installed, else `tokenizers`; both release the GIL and spread the
batch over --workers threads); batches are written in input order, so the output bytes do not
depend on --workers. A document longer than
100,000 characters is tokenised in pieces cut where the ids are provably unchanged
(data_tools/pieces.py), so memory stays bounded for single huge documents too.

What it refuses, before any work: an output .bin/.idx that already exists (unless --overwrite),
a tokenizer or input that cannot be found, an output folder that is a file, a --json-keys key
given twice. A file that --input reaches twice (the same path, overlapping globs, a folder and
one of its files) is read once, with a note counting the duplicates; files in input folders or
among a glob's matches that are never documents (.meta.json sidecars, tokenizer.json and model
config files) are skipped with a counted note, so outputs written inside the input folder are
not read back by the next run. A UTF-8 byte order mark opening a file is ignored. What fails the run,
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

from megatron_id.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    remove_stale_temps,
    temp_path,
)
from megatron_id.data.tokenizer import identity_of_loaded, null_tokenizer_identity, tokenizer_identity
from megatron_id.errors import UserError, run_guarded

from .compat import add_compat_flags, check_compat_flags
from .encoders import (
    PROBE_TEXT,
    RENEW_AFTER_BYTES,
    TOKENIZER_TYPES,
    GigatokenEncoder,
    NullEncoder,
    TiktokenEncoder,
    TokenizersEncoder,
    gigatoken_unavailable,
    resolve_tokenizer,
    tiktoken_unavailable,
)
from .outputs import check_outputs, check_prefix, make_folder, remove_folders, report_stale
from .pieces import PIECE_CHARS, PieceCutter
from .progress import Progress
from .readers import Record, Skip, check_input_files, expand_inputs, iter_documents, legacy_advice

# [our choice, measured with gigatoken, 2 workers, Wikipedia JSONL] characters per tokenizer call
# (and per reader batch), ~250K tokens, and batches read ahead: peak RSS 206 / 221 MB at 10 / 100 MB
# of input (4M and 4 ahead: 230 / 299 MB, the same CPU-seconds), so memory is flat from small inputs on
BATCH_CHARS = 1_000_000
PENDING_BATCHES = 2


class PreprocessError(UserError, ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data_tools.preprocess", description=__doc__.splitlines()[0],
                                allow_abbrev=False)   # Megatron's --lang must not become --language
    io_ = p.add_argument_group("input / output")
    io_.add_argument("--input", nargs="+", required=True,
                     help="files, globs or HF dataset folders (NeoX's comma-separated list works too)")
    io_.add_argument("--json-keys", "--jsonl-keys", nargs="+", default=["text"], dest="json_keys",
                     help="fields to tokenize; one dataset per key (default: text). A field may hold a "
                          "string or a list of sentences")
    io_.add_argument("--output-prefix", required=True)
    io_.add_argument("--overwrite", action="store_true",
                     help="replace existing outputs (only once the new ones are complete; without "
                          "this flag an existing .bin/.idx stops the run before any work)")
    io_.add_argument("--partitions", type=int, default=1,
                     help="split the input files into K groups, written one by one and then merged "
                          "(the output is the same for every K; K above the number of files says so)")
    io_.add_argument("--keep-empty", nargs="?", const="empty", default=None, choices=["empty", "eod"],
                     help="write empty and whitespace-only documents instead of skipping and counting them "
                          "(the default): --keep-empty as Megatron-LM's preprocess_data.py writes them (an empty "
                          "text: a document of no sequence; whitespace: its tokens); --keep-empty eod as its "
                          "preprocess_data_fast.py does (an empty text: the end-of-document token alone; needs "
                          "--append-eod). The output is then byte-identical to that tool's")
    tok = p.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer",
                     help="HF tokenizer.json, or a folder holding one")
    tok.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES, metavar="TYPE",
                     help="Megatron-LM's or GPT-NeoX's name, checked against the files given: "
                          "HuggingFaceTokenizer / HFTokenizer (a tokenizer.json), GPT2BPETokenizer / "
                          "HFGPT2Tokenizer (vocab.json + merges.txt), the SentencePiece types with a "
                          "tokenizer.json, NullTokenizer (ids as text, with --vocab-size); the others are "
                          "refused with the reason. Default: the files decide")
    tok.add_argument("--vocab-file", "--vocab", dest="vocab_file",
                     help="GPT-2 style vocab.json (with --merge-file), or NeoX's HFTokenizer tokenizer.json")
    tok.add_argument("--merge-file", help="GPT-2 style merges.txt")
    tok.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary size")
    tok.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                     help="NullTokenizer's end-of-document id (default: vocab size - 1, as Megatron)")
    tok.add_argument("--append-eod", action="store_true", help="append the end-of-document token")
    tok.add_argument("--eod-token", default=None, help="end-of-document token (default: found in the vocabulary)")
    tok.add_argument("--tokenizer-backend", choices=["auto", "gigatoken", "tiktoken", "tokenizers"], default="auto",
                     help="auto (default): gigatoken when it is installed and reads the tokenizer, else "
                          "tokenizers; gigatoken (~30x tokenizers' tokens per CPU-second here) or tiktoken "
                          "(byte-level BPE, several times faster): used only after it gave the reference's ids "
                          "on a probe text and on the first batch of the corpus, else this run falls back to "
                          "tokenizers and says why in one line; tokenizers: the reference")
    tok.add_argument("--tokenizer-cache-mib", type=int, default=RENEW_AFTER_BYTES // 2**20, metavar="MIB",
                     help="gigatoken keeps every distinct word it has encoded: when the process has grown this "
                          "much since its first batch, its tokenizer is loaded anew with an empty cache "
                          "(default %(default)s)")
    tok.add_argument("--ftfy", action="store_true", help="repair mojibake with ftfy.fix_text before "
                     "tokenizing (NeoX's flag; pip install ftfy)")
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
    run.add_argument("--log-interval", type=int, default=None,
                     help="a progress line every N documents (checked once per batch of ~1M characters); "
                          "default: every 10 s in logs, live on a terminal")
    run.add_argument("--strict", action="store_true",
                     help="fail at the first bad document (malformed, not UTF-8, missing or "
                          "non-string key, empty), naming file and line, instead of skipping and "
                          "counting it; filtered documents are not bad")
    run.add_argument("--skip-non-utf8", action="store_true",
                     help="skip (and count) the lines of a file that are documents in another encoding "
                          "(Latin-1, cp1252) however many there are; without it a file with more than 1 such "
                          "line in 1,000 stops the run, with the iconv line that converts it")
    run.add_argument("--no-progress", action="store_true")
    add_compat_flags(p)
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
        self.empty_kept = 0       # --keep-empty: documents written with no sequence (eod: the EOD alone)
        self.eod_alone = False    # --keep-empty eod
        self.notes: list[str] = []   # flags with no effect, inputs dropped, the backend's choice
        self.backend = "tokenizers"

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


def _text_problem(value, key: str) -> str | None:
    """Why a field cannot be tokenized (None: a string, or a list of strings = sentences)."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(v, str) for v in texts):
        return f"key '{key}' is not a string or a list of strings"
    for text in texts:   # JSON may escape half of a surrogate pair ("\ud800"): not Unicode text
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return f"key '{key}' holds a lone surrogate (an escape like \\ud800: not valid Unicode)"
    return None


def _blank(value) -> bool:
    return not value.strip() if isinstance(value, str) else all(not v.strip() for v in value)


# A file with more than 1 line in LEGACY_LINES_PER that is a document in another encoding (not
# UTF-8, but JSON once read as Latin-1/cp1252) is refused [our choice]: such a file is not damaged
# here and there, it is in another encoding, and skipping its lines would drop exactly the
# documents with accented letters (a biased corpus, exit 0). Below the share (a few stray lines
# in a large file) they are skipped and counted, with a note giving the conversion.
LEGACY_LINES_PER = 1000


class EncodingTally:
    """The lines of one input file read so far, and those of them in another encoding."""

    def __init__(self, source: str | None = None):
        self.source, self.read, self.legacy, self.first = source, 0, 0, None

    def see(self, item) -> None:
        self.read += 1
        if isinstance(item, Skip) and item.legacy is not None:
            self.legacy += 1
            self.first = self.first or item

    def close(self, args, stats) -> None:
        """At the end of the file: refuse it, or note what was skipped (LEGACY_LINES_PER)."""
        if not self.legacy:
            return
        many = self.legacy > 1
        what = (f"input {self.source}: {self.legacy:,} of its {self.read:,} lines {'are' if many else 'is'} not UTF-8 "
                f"but {'documents' if many else 'a document'} in another encoding (the first at line "
                f"{self.first.line:,})")
        advice = legacy_advice(Path(self.source), *self.first.legacy)
        if self.legacy * LEGACY_LINES_PER > self.read and not args.skip_non_utf8:
            raise PreprocessError(f"{what}, and skipping them would drop every document with an accented letter: "
                                  f"nothing was written. {advice[0].upper()}{advice[1:]}; or give --skip-non-utf8 "
                                  f"to skip such lines (counted).")
        stats.notes.append(f"{what}: skipped and counted as not UTF-8. To keep {'them' if many else 'it'}: {advice}.")


def _batches(records, keys, args, stats, out: queue.Queue, stop: threading.Event):
    """Reader thread: validated texts grouped into batches of ~BATCH_CHARS characters, each
    entry (texts, (source, line)); a text is a string or a list of sentences."""
    try:
        fix = None
        if args.ftfy:
            import ftfy
            fix = ftfy.fix_text
        batch, size = [], 0
        tally = EncodingTally()
        for item in records:
            if stop.is_set():
                return
            if item.source != tally.source:   # a file ends: judged before the next one is read
                tally.close(args, stats)
                tally = EncodingTally(item.source)
            tally.see(item)
            stats.read += 1
            reason = None
            where = (item.source, item.line)
            if not isinstance(item, Record):
                reason = item.reason
            else:
                missing = [k for k in keys if k not in item.data]
                bad_type = [why for k in keys if k in item.data for why in [_text_problem(item.data[k], k)] if why]
                if missing:
                    reason = f"missing key '{missing[0]}'"
                    if stats.skipped[reason] < 1000:   # enough rows to say which keys they have
                        stats.keys_seen.update(item.data.keys())
                elif bad_type:
                    reason = bad_type[0]
                elif not args.keep_empty and all(_blank(item.data[k]) for k in keys):
                    reason = "empty document"
                else:
                    reason = _filter_reason(item.data, args, stats)
            if reason is not None:
                if args.strict and not reason.startswith("filtered"):
                    legacy = getattr(item, "legacy", None)
                    hint = f": {legacy_advice(Path(where[0]), *legacy)}" if legacy else ""
                    raise PreprocessError(f"{where[0]}:{where[1]}: {reason}{hint} (run without --strict "
                                          f"to skip and count such documents)")
                stats.skip(reason)
                continue
            texts = [item.data[k] for k in keys]
            if fix is not None:
                texts = [fix(t) if isinstance(t, str) else [fix(x) for x in t] for t in texts]
            batch.append((texts, where))
            size += sum(len(t) if isinstance(t, str) else sum(map(len, t)) for t in texts)
            if size >= BATCH_CHARS:
                out.put(batch)
                batch, size = [], 0
        tally.close(args, stats)
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


class Encoded:
    """One batch of documents of one key: `flat` ids, the length of each sequence, and how
    many sequences each document has (0: empty, as Megatron writes an empty text)."""

    def __init__(self, flat: np.ndarray, lengths: np.ndarray, per_document: np.ndarray):
        self.flat, self.lengths, self.per_document = flat, lengths, per_document
        self.eod_alone = 0   # empty documents written as the end-of-document token alone (--keep-empty eod)

    def keep(self, documents: np.ndarray) -> "Encoded":
        """Only the documents where `documents` (bool) is True."""
        sequences = np.repeat(documents, self.per_document)
        return Encoded(self.flat[np.repeat(sequences, self.lengths)], self.lengths[sequences],
                       self.per_document[documents])


def _encode(encoder, cutter: PieceCutter, docs, eod, eod_alone: bool = False) -> Encoded:
    """Megatron's Encoder.encode for a batch: each document is a text or a list of sentences;
    every sentence with ids becomes a sequence, and the end-of-document id goes after the last
    one (a document without ids gets none). Long sentences are cut into pieces (the ids are
    those of the whole text, see pieces.py), at most BATCH_CHARS characters go to one encode
    call, and each call's ids become a numpy array at once (as Python lists they cost ~40
    bytes a token)."""
    sentences, owner = [], []
    for d, doc in enumerate(docs):
        for text in ([doc] if isinstance(doc, str) else doc):
            sentences.append(text)
            owner.append(d)
    spans = []
    for i, text in enumerate(sentences):
        bounds = cutter.bounds(text)
        spans.extend((i, a, b) for a, b in zip(bounds, bounds[1:]))
    flats = []
    lengths = np.zeros(len(sentences), dtype=np.int64)
    for group in _groups(spans, BATCH_CHARS):
        pieces = [sentences[i] if b - a == len(sentences[i]) else sentences[i][a:b] for i, a, b in group]
        flat_form = getattr(encoder, "encode_flat", None)
        arrays = getattr(encoder, "encode_arrays", None)
        if flat_form:
            ids, counts = flat_form(pieces)
        else:
            ids = arrays(pieces) if arrays else encoder.encode_many(pieces)
            counts = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        del pieces
        np.add.at(lengths, [i for i, _, _ in group], counts)
        # int32 holds any id (vocabularies are far below 2**31) at half the memory of int64
        if flat_form:
            flats.append(ids.astype(np.int32))
        elif arrays:
            flats.append(np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, dtype=np.int32))
        else:
            flats.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32,
                                     count=int(counts.sum())))
        del ids
    flat = flats[0] if len(flats) == 1 else np.concatenate(flats or [np.zeros(0, dtype=np.int32)])
    real = lengths > 0
    per_document = np.bincount(np.asarray(owner, dtype=np.int64)[real], minlength=len(docs))
    lengths = lengths[real]
    if eod is not None and len(lengths):
        last = np.cumsum(per_document)[per_document > 0] - 1   # each document's last sequence
        flat = np.insert(flat, np.cumsum(lengths)[last], eod)
        lengths[last] += 1
    filled = 0
    if eod_alone and eod is not None:   # --keep-empty eod: a document without ids is the EOD alone
        empty = np.flatnonzero(per_document == 0)
        filled = len(empty)
        if filled:
            before = (np.cumsum(per_document) - per_document)[empty]   # sequences ahead of each
            starts = np.concatenate([[0], np.cumsum(lengths)])[before]
            flat = np.insert(flat, starts, eod)
            lengths = np.insert(lengths, before, 1)
            per_document[empty] = 1
    encoded = Encoded(flat, lengths, per_document)
    encoded.eod_alone = filled
    return encoded


def _write_part(files, writers, encoder, cutter, eod, args, stats, progress):
    """Tokenize `files` into `writers` (one per --json-keys key). The caller finalizes or
    aborts the writers. The datasets of several keys stay aligned: a row whose text of one key
    has no ids is skipped in all of them (or, with --keep-empty, written empty in that one)."""
    keys = args.json_keys
    counters = []
    pending: queue.Queue = queue.Queue(maxsize=PENDING_BATCHES)   # bounded: memory does not grow with input
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
            encoded = [_encode(encoder, cutter, [texts[k] for texts, _ in batch], eod, args.keep_empty == "eod")
                       for k in range(len(writers))]
            encoded = encoder.checked(encoded, batch, cutter, eod)
            empty = np.stack([e.per_document == 0 for e in encoded]).any(axis=0)
            if empty.any() and not args.keep_empty:   # text without ids: skip it like an empty document
                first = int(np.flatnonzero(empty)[0])
                if args.strict:
                    source, line = batch[first][1]
                    k = next(k for k, e in enumerate(encoded) if e.per_document[first] == 0)
                    raise PreprocessError(f"{source}:{line}: key '{keys[k]}' is empty after "
                                          f"tokenization (run without --strict to skip and "
                                          f"count such documents)")
                encoded = [e.keep(~empty) for e in encoded]
                stats.skipped["empty after tokenization"] += int(empty.sum())
            for writer, e in zip(writers, encoded):
                writer.add_many(e.flat, e.lengths, e.per_document)
            # the summary counts documents and tokens of the first key
            stats.written += len(encoded[0].per_document)
            stats.tokens += int(encoded[0].lengths.sum())
            if args.keep_empty:
                stats.empty_kept += int((encoded[0].per_document == 0).sum()) + encoded[0].eod_alone
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


CHECK_CHARS = 1_000_000   # characters of the first batch also encoded by the reference (a fast backend's check)


class Backend:
    """The encoder in use. A fast backend (gigatoken, tiktoken) must first give the reference's
    (tokenizers') ids on a probe text (at start), then on the corpus itself: the first ~1M
    characters of the first batch are encoded by both (documents whole, pieces included). Any
    difference falls back to the reference for the whole run, the first batch included, with a
    note saying why; so does a fast backend that is missing or cannot read the tokenizer. auto:
    gigatoken, silently tokenizers when gigatoken is not installed."""

    def __init__(self, spec, args, stats: Stats):
        self.stats, self.unchecked, self.fast_name = stats, False, None
        self.eod_alone = args.keep_empty == "eod"
        if spec.kind == "null":
            self.current = NullEncoder(spec.vocab_size)
            self.reference = self.current
            stats.backend = "NullTokenizer"
            return
        self.reference = self.current = TokenizersEncoder(spec.tokenizer)
        wanted = args.tokenizer_backend
        if wanted == "tokenizers":
            return
        self.fast_name = "gigatoken" if wanted == "auto" else wanted
        if self.fast_name == "gigatoken":
            why, loaded = gigatoken_unavailable(spec.tokenizer)
            if why is not None and wanted == "auto" and loaded is None and "not installed" in why:
                self.fast_name = None   # auto without gigatoken: the reference, as before gigatoken existed
                return
            make = lambda: GigatokenEncoder(loaded, spec.tokenizer.to_str(),   # noqa: E731
                                            args.tokenizer_cache_mib * 2**20)
        else:
            why = tiktoken_unavailable(spec.tokenizer)
            make = lambda: TiktokenEncoder(spec.tokenizer, args.workers)   # noqa: E731
        if why is None:
            fast = make()
            probe = [PROBE_TEXT, PROBE_TEXT[::-1], PROBE_TEXT.upper()]
            if fast.encode_many(probe) == self.reference.encode_many(probe):
                self.current, self.unchecked = fast, True
            else:
                why = "it gave other ids than tokenizers on the probe text"
        if why is not None:
            self._fall_back(why)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return self.current.encode_many(texts)

    @property
    def encode_arrays(self):
        """The current encoder's array form, None when it has none (then encode_many is used)."""
        return getattr(self.current, "encode_arrays", None)

    @property
    def encode_flat(self):
        """The current encoder's flat form (ids and counts), None when it has none."""
        return getattr(self.current, "encode_flat", None)

    def _fall_back(self, why: str) -> None:
        self.current, self.unchecked = self.reference, False
        note = (f"--tokenizer-backend {self.fast_name} not used: {why}; this run uses tokenizers (the same ids, "
                f"slower).")
        self.stats.notes.append(note)
        print(f"preprocess: note: {note}", file=sys.stderr)

    def checked(self, encoded: list, batch, cutter, eod) -> list:
        """The first batch's encodings (by the fast backend), compared with the reference on its first
        CHECK_CHARS characters; returns what to write (the reference's, after a difference)."""
        if not self.unchecked:
            return encoded
        self.unchecked = False
        docs = [texts for texts, _ in batch]
        sizes = np.cumsum([sum(len(t) if isinstance(t, str) else sum(map(len, t)) for t in texts) for texts in docs])
        n = max(1, int(np.searchsorted(sizes, CHECK_CHARS, side="right")))
        first = np.arange(len(docs)) < n
        fast = self.current
        self.current = self.reference   # what the piece cutter verifies its cuts with, meanwhile
        # (the cutter counts the documents it cuts: the batch's were counted once already)
        counted = cutter.cut_documents, cutter.uncut_documents
        for k, mine in enumerate(encoded):
            theirs = _encode(self.reference, cutter, [texts[k] for texts in docs[:n]], eod, self.eod_alone)
            cutter.cut_documents, cutter.uncut_documents = counted
            head = mine.keep(first)
            if not (np.array_equal(head.flat, theirs.flat) and np.array_equal(head.lengths, theirs.lengths)
                    and np.array_equal(head.per_document, theirs.per_document)):
                self._fall_back("it gave other ids than tokenizers on the first batch of the corpus")
                again = [_encode(self.reference, cutter, [texts[j] for texts in docs], eod, self.eod_alone)
                         for j in range(len(encoded))]
                cutter.cut_documents, cutter.uncut_documents = counted
                return again
        self.current = fast
        self.stats.backend = (f"{self.fast_name} (checked against tokenizers on a probe text and the first "
                              f"{int(sizes[n - 1]):,} characters of the corpus)")
        return encoded


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


def split_neox_inputs(patterns) -> list[str]:
    """GPT-NeoX takes --input a.jsonl,b.jsonl: an item that is not a path and holds commas is
    that list (a path with a comma in its name still works)."""
    out = []
    for pattern in patterns:
        if "," in pattern and not os.path.exists(pattern):
            out.extend(p for p in pattern.split(",") if p)
        else:
            out.append(pattern)
    return out


def check_document_suffix(prefix: str, keys) -> None:
    """A prefix that already ends in _<key>_document (the name of the dataset to be, copied from
    the training config) would write <that>_text_document_text_document.bin, which training then
    does not find under the name given: refused before any work with the prefix meant."""
    stem = prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix
    for key in keys:
        if stem.endswith(f"_{key}_document") and len(stem) > len(f"_{key}_document"):
            meant = stem[: -len(f"_{key}_document")]
            raise PreprocessError(f"--output-prefix {prefix!r} ends in _{key}_document, which preprocessing appends "
                                  f"(one dataset per --json-keys key): it would write "
                                  f"{stem}_{key}_document.bin/.idx. Give --output-prefix {meant}: it writes "
                                  f"{meant}_{key}_document.bin/.idx, the name training is given.")


def run(args) -> Stats:
    check_document_suffix(args.output_prefix, args.json_keys)
    check_prefix(args.output_prefix, "--output-prefix", "fineweb", "{}_" + args.json_keys[0] + "_document.bin/.idx")
    if args.workers < 1:
        raise PreprocessError(f"--workers {args.workers}: must be at least 1.")
    if args.tokenizer_cache_mib < 0:
        raise PreprocessError(f"--tokenizer-cache-mib {args.tokenizer_cache_mib}: must be 0 or more (MiB the process "
                              f"may grow by before gigatoken's tokenizer is loaded anew; default "
                              f"{RENEW_AFTER_BYTES // 2**20}).")
    if args.partitions < 1:
        raise PreprocessError(f"--partitions {args.partitions}: must be at least 1.")
    if args.log_interval is not None and args.log_interval < 1:
        raise PreprocessError(f"--log-interval {args.log_interval}: must be at least 1 (documents).")
    if args.keep_empty == "eod" and not args.append_eod:
        raise PreprocessError("--keep-empty eod writes an empty text as the end-of-document token alone, as Megatron's "
                              "preprocess_data_fast.py does with --append-eod: give --append-eod too (without it "
                              "that tool writes an empty document, which --keep-empty alone does).")
    repeated = sorted({k for k in args.json_keys if args.json_keys.count(k) > 1})
    if repeated:   # two writers of one <prefix>_<key>_document: refused before any work
        raise PreprocessError(f"--json-keys {' '.join(args.json_keys)}: the key '{repeated[0]}' is given "
                              f"{args.json_keys.count(repeated[0])} times, but each key makes its own dataset "
                              f"({output_prefix(args.output_prefix, repeated[0])}): name each key once.")
    try:
        notes = check_compat_flags(args)
    except ValueError as err:
        raise PreprocessError(str(err)) from None
    if args.ftfy:
        try:
            import ftfy  # noqa: F401
        except ImportError:
            raise PreprocessError("--ftfy needs the ftfy package: pip install ftfy.") from None
    spec = resolve_tokenizer(args)   # fails before work
    if args.vocab_size is not None and spec.kind != "null":
        notes.append(f"--vocab-size {args.vocab_size} has no effect here: the vocabulary size comes from the "
                     f"tokenizer ({spec.vocab_size:,}); only NullTokenizer takes it.")
    if args.null_tokenizer_eod_id is not None and spec.kind != "null":
        notes.append("--null-tokenizer-eod-id has no effect here: it belongs to --tokenizer-type NullTokenizer.")
    eod = spec.eod(args.eod_token, args.null_tokenizer_eod_id) if args.append_eod else None
    if eod is not None and not 0 <= eod < spec.vocab_size:
        raise PreprocessError(f"--null-tokenizer-eod-id {eod}: must be below --vocab-size {spec.vocab_size}.")
    files = expand_inputs(split_neox_inputs(args.input), notes=notes)
    check_input_files(files)   # a .gz that is not gzip, UTF-16 text: refused before any work
    vocab_size = spec.vocab_size
    dtype = best_dtype(vocab_size)
    finals = [output_prefix(args.output_prefix, k) for k in args.json_keys]
    check_outputs([Path(f"{p}{ext}") for p in finals for ext in (".bin", ".idx")], "--output-prefix",
                  args.output_prefix, args.overwrite)
    parts = max(1, min(args.partitions, len(files)))
    if args.partitions > parts:
        notes.append(f"--partitions {args.partitions}: {len(files)} input file{'s' if len(files) > 1 else ''}, so "
                     f"{parts} partition{'s' if parts > 1 else ''} (partitions group input files; the output is "
                     f"the same for any number; --workers sets the parallelism).")

    # the tokenizer's thread pool reads this once, at its first parallel call
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    stats, start = Stats(), time.time()
    stats.eod_alone = args.keep_empty == "eod"
    stats.notes = notes
    for note in notes:   # said before the work, so that a long run does not hide them
        print(f"preprocess: note: {note}", file=sys.stderr)
    backend = Backend(spec, args, stats)
    created = make_folder(Path(finals[0]).parent)
    stats.stale_removed = remove_stale_temps(
        [f for p in finals for f in (Path(f"{p}.bin"), Path(f"{p}.idx"), Path(f"{p}.meta.json"),
                                     Path(f"{p}.parts"))])
    report_stale("preprocess", stats.stale_removed)
    total_bytes = sum(p.stat().st_size for p in files if p.is_file())
    progress = Progress(total_bytes, enabled=not args.no_progress, log_interval=args.log_interval)
    cutter = PieceCutter(backend, PIECE_CHARS)
    recorded = spec.file
    identity = null_tokenizer_identity(vocab_size) if spec.kind == "null" else \
        identity_of_loaded(spec.tokenizer, spec.file) if spec.file else tokenizer_identity(spec.tokenizer)
    writers = []
    try:
        for p in finals:   # one by one: a failure aborts those already opened
            writers.append(IndexedDatasetWriter(p, dtype, vocab_size=vocab_size, eod_id=eod,
                                                tokenizer=None if recorded is None else str(recorded),
                                                tokenizer_id=identity))
        if parts == 1:
            _write_part(files, writers, backend, cutter, eod, args, stats, progress)
        else:
            _write_partitions(files, parts, writers, backend, cutter, eod, dtype, args, stats,
                              progress, temp_path(f"{finals[0]}.parts"))
        if stats.written == 0:
            raise PreprocessError(_nothing_written(stats, files, args))
        if stats.written == stats.empty_kept:
            raise PreprocessError(f"no token was written: all {stats.written:,} documents kept by --keep-empty "
                                  f"are empty. Check --input and --json-keys: the output would be an empty dataset.")
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


def _write_partitions(files, parts, writers, encoder, cutter, eod, dtype, args, stats, progress,
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
                _write_part(group, part_writers, encoder, cutter, eod, args, stats, progress)
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
    if stats.empty_kept:
        lines.append(f"empty documents written (--keep-empty{' eod' if stats.eod_alone else ''}, as Megatron's "
                     f"{'preprocess_data_fast.py' if stats.eod_alone else 'preprocess_data.py'} writes them): "
                     f"{stats.empty_kept:,}")
    if stats.backend != "tokenizers":
        lines.append(f"encoder: {stats.backend}")
    skipped = sum(stats.skipped.values())
    lines.append(f"documents skipped: {skipped:,}" + ("" if not skipped else ": " + ", ".join(
        f"{n:,} {reason}" for reason, n in stats.skipped.most_common())))
    if stats.cut_documents or stats.uncut_documents:
        lines.append(f"documents longer than {PIECE_CHARS:,} characters, tokenised in pieces: "
                     f"{stats.cut_documents:,}" + (f" ({stats.uncut_documents:,} kept a part above that "
                                                   f"size: no safe cut found)" if stats.uncut_documents else ""))
    lines += [f"output: {p}.bin, {p}.idx, {p}.meta.json" for p in stats.outputs]
    lines += [f"note: {n}" for n in stats.notes]   # again at the end, where a user looks
    return "\n".join(lines)


def main(argv=None, debug: bool = False) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        print(summary(run(args)), file=sys.stderr)
        return 0
    return run_guarded("preprocess", body, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
