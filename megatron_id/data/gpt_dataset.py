"""GPT training samples from indexed datasets, with Megatron's rules and numpy only.

- `--split 969,30,1`: contiguous ranges of documents for train / valid / test.
- A sample is seq_length + 1 tokens packed across document boundaries (no padding): documents
  are shuffled per epoch and tiled over as many epochs as the requested samples need; sample i
  covers tokens [i * seq_length, (i + 1) * seq_length] of that stream (consecutive samples share
  one token: the last label of one is the first input of the next), and samples are shuffled.
  All from one seeded RandomState.
- The three indices (document order, sample boundaries, sample order; sample_index.py) are
  built in linear time with numpy, saved as .npy files keyed by a hash of their description,
  built once by rank 0 while the others wait on its files (index_cache.py), and memory-mapped.
- Blending several prefixes (`w1 p1 w2 p2 ...`): at each step take the dataset furthest behind
  its weight, as Megatron does (a loop in C: csrc/blend_index.c).
- `PretrainingSampler` resumes from a number of consumed samples: the order after resuming is
  the order without interruption.
- `check_data(data_path, split, seq_length, vocab_size, cache_dir, verify, tokenizer)` is the cheap
  check the trainer runs before starting (no index is built): every prefix exists, every train
  split can make a sample, every token id fits the model's vocabulary and the tokenizer that made
  it (data.tokenizer, else the sidecar's; the sidecar's range, or a scan remembered in the cache
  folder for data without one) and the .bin matches the checksums its
  sidecar recorded (a few chunks, or all with verify="full"). Its errors are DataConfigError,
  the same on every rank.
- `check_batch_token_ids` checks every batch as it is read: an id the model cannot embed stops
  the run with the file, sequence and offset named (a .bin damaged after its checks).
"""
from __future__ import annotations

import math
import os
import random
import sys
from enum import Enum
from pathlib import Path

import numpy as np

from ..errors import UserError
from .index_cache import BuildSession, cached_arrays
from .indexed_dataset import (
    SAMPLED_CHUNKS,
    IndexedDataset,
    IndexedDatasetError,
    KnownTokenizer,
    matching_meta,
    resolve_prefix,
    token_id_report,
    verify_bin,
)
from .sample_index import build_blending_index, build_sample_index, epochs_needed, estimate_seconds

# 2: arrays in the smallest integer type, doc_idx cut after the last document read (same values)
INDEX_VERSION = 2


class Verify(str, Enum):
    """data.verify: how much of every .bin is checked against its sidecar's checksums at start."""
    # (not "off": YAML reads an unquoted off as false)
    none = "none"        # nothing beyond the sizes and the token-id range
    sample = "sample"    # a few 16 MiB chunks drawn at random (about 32 for the whole blend)
    full = "full"        # every chunk; for data without checksums, a full token-id scan


class DataConfigError(UserError, ValueError):
    """data.data_path / data.split do not fit the data on disk or the model (a ValueError too,
    as these were before). Every rank finds the same problem, so only rank 0 prints it."""

    same_on_every_rank = True


# ---------------------------------------------------------------- data paths and splits

def parse_data_path(items) -> list[tuple[float, str]]:
    """`prefix` or `w1 p1 w2 p2 ...` -> [(normalised weight, prefix)]."""
    items = [str(x) for x in (items.split() if isinstance(items, str) else items)]
    if not items:
        raise DataConfigError("data path is empty: give a preprocessed dataset prefix, e.g. "
                              "data.data_path=[data/my_corpus_text_document].")
    if len(items) == 1:
        return [(1.0, items[0])]
    if len(items) % 2:
        raise DataConfigError(f"data path {' '.join(items)!r}: give one prefix, or weight/prefix "
                              f"pairs (w1 p1 w2 p2 ...).")
    pairs = []
    for w, p in zip(items[::2], items[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise DataConfigError(f"data path: '{w}' should be a weight before prefix '{p}' "
                                  f"(w1 p1 w2 p2 ...).") from None
        if not weight >= 0 or math.isinf(weight):
            raise DataConfigError(f"data path: weight {w} for '{p}' must be a finite number >= 0.")
        pairs.append((weight, p))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise DataConfigError(f"data path {' '.join(items)!r}: the weights sum to zero; give at "
                              f"least one prefix a positive weight.")
    return [(w / total, p) for w, p in _merge_repeated(pairs)]


def _same_prefix_key(prefix: str) -> str:
    """One key per dataset, however its prefix is spelled (with or without _text_document,
    .bin or .idx, relative or absolute)."""
    try:
        return str(resolve_prefix(prefix).resolve())
    except IndexedDatasetError:   # missing: named by check_data; compare the spelling meanwhile
        return os.path.abspath(prefix)


def _merge_repeated(pairs: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """A prefix named twice in a blend is one dataset with the summed weight. Two copies would
    be two GPT datasets with the same seed, hence the same sample order, and the blend would
    serve every sample twice in a row (0, 0, 2, 2, ...); summed, each sample comes once per
    epoch at the weight asked for. Said once in the log (`repeated_prefixes`)."""
    merged: dict[str, list] = {}
    for weight, prefix in pairs:
        merged.setdefault(_same_prefix_key(prefix), [0.0, prefix])[0] += weight
    return [(w, p) for w, p in merged.values()]


def repeated_prefixes(items) -> list[str]:
    """The blend's prefixes named more than once, for the log line."""
    items = [str(x) for x in (items.split() if isinstance(items, str) else items)]
    prefixes = items[1::2] if len(items) > 1 else items
    keys = [_same_prefix_key(p) for p in prefixes]
    return [p for i, p in enumerate(prefixes) if keys.index(keys[i]) != i]


def parse_split(split: str) -> list[float]:
    """'969,30,1' (or '969/30/1') -> normalised train/valid/test weights."""
    usage = (f"data.split={split!r}: give up to three non-negative numbers, the train, valid and "
             f"test shares of the documents, e.g. 969,30,1.")
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise DataConfigError(usage) from None
    if not 1 <= len(parts) <= 3 or any(not 0 <= x < math.inf for x in parts) or sum(parts) <= 0:
        raise DataConfigError(usage)
    parts += [0.0] * (3 - len(parts))
    return [x / sum(parts) for x in parts]


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Contiguous [start, end) document ranges per split (Megatron's rounding)."""
    bounds = [0]
    for w in parse_split(split):
        bounds.append(bounds[-1] + int(round(w * num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


# ---------------------------------------------------------------- the datasets

class CorruptDataError(UserError, ValueError):
    """A token id that the model cannot embed, found in a batch being read: the message names the
    .bin, the sequence and the offset. Found by the rank that read it (not by every rank)."""


def _index_description(kind: str, **fields) -> dict:
    return {"class": kind, "version": INDEX_VERSION, **fields}


class GPTDataset:
    """`num_samples` samples of seq_length + 1 tokens (int64) from `documents` of `indexed`.
    The index arrays (sample_index.py) are built once by rank 0 into `cache_dir` and
    memory-mapped by every rank (index_cache.py)."""

    def __init__(self, indexed: IndexedDataset, documents: tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, cache_dir, name: str = "train", session: BuildSession | None = None):
        self.indexed, self.seq_length, self.num_samples, self.name = indexed, seq_length, num_samples, name
        start, end = documents
        if end <= start:
            raise DataConfigError(f"{name} split of {indexed.prefix} has no documents "
                                  f"({start}:{end}); change data.split or the data.")
        tokens = int(indexed.lengths[start:end].sum(dtype=np.int64))
        if tokens < 2:
            raise DataConfigError(f"the {name} split of {indexed.prefix} holds {tokens} tokens: too few to make "
                                  f"samples; give it more documents (data.split) or more data.")
        description = _index_description(
            "GPTDataset", name=name, prefix=str(Path(indexed.prefix).resolve()), num_documents=len(indexed),
            num_tokens=indexed.num_tokens, documents=[start, end], num_samples=num_samples,
            seq_length=seq_length, seed=seed)
        epochs = epochs_needed(tokens, num_samples, seq_length)
        what = (f"the {name} sample index of {indexed.prefix} ({num_samples:,} samples from {end - start:,} "
                f"documents x {epochs} epoch{'s' if epochs > 1 else ''})")
        arrays, self.built_index = cached_arrays(
            description, cache_dir, lambda progress: build_sample_index(
                indexed.lengths, (start, end), num_samples, seq_length, seed, progress),
            session=session, what=what,
            estimate_s=estimate_seconds(documents=end - start, epochs=epochs, samples=num_samples))
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        return self.in_stream_order(int(self.shuffle_idx[i]))

    def in_stream_order(self, j: int) -> np.ndarray:
        """Sample j of the unshuffled order: tokens [j x seq_length, (j + 1) x seq_length] of the
        shuffled documents' stream (StreamOrder reads consecutive ones)."""
        (first, first_off), (last, last_off) = self.sample_idx[j], self.sample_idx[j + 1]
        if first == last:
            return self.indexed.get(int(self.doc_idx[first]), int(first_off),
                                    int(last_off - first_off + 1)).astype(np.int64)
        parts = [self.indexed.get(int(self.doc_idx[first]), int(first_off))]
        parts += [self.indexed.get(int(self.doc_idx[k])) for k in range(first + 1, last)]
        parts.append(self.indexed.get(int(self.doc_idx[last]), 0, int(last_off) + 1))
        return np.concatenate(parts).astype(np.int64)

    def locate(self, i: int, k: int) -> tuple[Path, int, int]:
        """Where token k of sample i comes from: (.bin path, sequence, offset in the sequence)."""
        return self.locate_in_stream_order(int(self.shuffle_idx[i]), k)

    def locate_in_stream_order(self, j: int, k: int) -> tuple[Path, int, int]:
        position, offset = int(self.sample_idx[j][0]), int(self.sample_idx[j][1])
        while True:
            sequence = int(self.doc_idx[position])
            left = int(self.indexed.lengths[sequence]) - offset
            if k < left:
                return self.indexed.bin_path, sequence, offset + k
            k, position, offset = k - left, position + 1, 0


class StreamOrder:
    """data.carry_state's order of a GPTDataset (training/carry.py): row r of every global batch
    of `rows` reads stream r, the unshuffled samples r x S, r x S + 1, ... (S = samples // rows):
    consecutive windows of the same documents, step after step. The documents are shuffled as
    always; the samples are not (a shuffle would break the streams). Index i is what
    PretrainingSampler hands out: step i // rows, row i % rows."""

    def __init__(self, dataset: GPTDataset, rows: int):
        self.dataset, self.rows = dataset, rows
        self.steps = len(dataset) // rows

    def __len__(self) -> int:
        return self.steps * self.rows

    def _unshuffled(self, i: int) -> int:
        step, row = divmod(i, self.rows)
        return row * self.steps + step

    def __getitem__(self, i: int) -> np.ndarray:
        return self.dataset.in_stream_order(self._unshuffled(i))

    def locate(self, i: int, k: int) -> tuple[Path, int, int]:
        return self.dataset.locate_in_stream_order(self._unshuffled(i), k)


class BlendedDataset:
    def __init__(self, datasets, weights, num_samples: int, cache_dir, name: str = "train",
                 session: BuildSession | None = None):
        self.datasets, self.num_samples = datasets, num_samples
        description = _index_description("BlendedDataset", name=name, weights=[float(w) for w in weights],
                                         num_samples=num_samples, datasets=[len(d) for d in datasets])
        what = f"the {name} blend index ({num_samples:,} samples over {len(datasets)} datasets)"
        arrays, self.built_index = cached_arrays(
            description, cache_dir, lambda progress: build_blending_index(weights, num_samples, progress),
            session=session, what=what, estimate_s=estimate_seconds(samples=num_samples, blend_datasets=len(datasets)))
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        needs = np.bincount(np.asarray(self.dataset_index), minlength=len(datasets))
        for d, (need, ds) in enumerate(zip(needs, datasets)):
            if need > len(ds):
                raise ValueError(f"blend needs {need} samples from dataset {d} but it holds {len(ds)}.")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def locate(self, i: int, k: int) -> tuple[Path, int, int]:
        return self.datasets[int(self.dataset_index[i])].locate(int(self.dataset_sample_index[i]), k)


def check_batch_token_ids(dataset, indices, batch, vocab_size: int, what: str = "model.vocab_size") -> None:
    """Stop on a token id the model cannot embed (>= vocab_size, or negative) in a batch just
    read from `dataset` (GPTDataset or BlendedDataset; `batch[r]` is sample `indices[r]`):
    CorruptDataError naming the .bin, the sequence, the offset and the fix. Callers test the
    batch's min and max first (cheap); this finds where the first bad id came from."""
    bad = np.argwhere((np.asarray(batch) >= vocab_size) | (np.asarray(batch) < 0))
    if not len(bad):
        return
    row, k = (int(x) for x in bad[0])
    value = int(batch[row][k])
    path, sequence, offset = dataset.locate(int(indices[row]), k)
    byte = int(IndexedDataset(path).pointers[sequence]) + offset * np.dtype(IndexedDataset(path).dtype).itemsize
    problem = "is negative" if value < 0 else f"is >= {what}={vocab_size}"
    raise CorruptDataError(
        f"{path}: token id {value} at sequence {sequence:,}, token {offset:,} of it (byte {byte:,} of the file), "
        f"{problem} ({len(bad):,} such id{'s' if len(bad) > 1 else ''} in this batch of training sample "
        f"{int(indices[row]):,}): the .bin is damaged, or was not made with this model's tokenizer. python -m "
        f"data_tools.inspect {str(path)[:-4]} --check lists its token ids; re-create it with data_tools.preprocess "
        f"or restore it from the original copy.")


def default_cache_dir(data_path) -> Path:
    """data.index_cache_dir when unset: `index-cache` beside the first prefix of the data path."""
    return Path(parse_data_path(data_path)[0][1]).parent / "index-cache"


def build_gpt_datasets(data_path, split: str, num_samples, seq_length: int, seed: int, cache_dir,
                       stale_after_s: float | None = None):
    """(train, valid, test) datasets for `num_samples` = (n_train, n_valid, n_test); a split
    with no samples requested (or no documents) is None. Every rank calls it together; rank 0
    builds missing indices, the others wait for its files (index_cache.py; they give up after
    `stale_after_s` without a sign of life from rank 0)."""
    blend = parse_data_path(data_path)
    with BuildSession(cache_dir, stale_after_s) as session:
        return _build_gpt_datasets(blend, split, num_samples, seq_length, seed, cache_dir, session)


def _build_gpt_datasets(blend, split, num_samples, seq_length, seed, cache_dir, session):
    out = []
    for s, (name, n) in enumerate(zip(("train", "valid", "test"), num_samples)):
        if n <= 0:
            out.append(None)
            continue
        parts, weights = [], []
        for weight, prefix in blend:
            indexed = IndexedDataset(prefix)
            docs = split_ranges(len(indexed), split)[s]
            if docs[1] <= docs[0]:
                continue
            share = n if len(blend) == 1 else int(math.ceil(weight * n * 1.005)) + 1
            parts.append(GPTDataset(indexed, docs, share, seq_length, seed, cache_dir, name, session))
            weights.append(weight)
        if not parts:
            out.append(None)
        elif len(parts) == 1:
            out.append(parts[0])
        else:
            out.append(BlendedDataset(parts, weights, n, cache_dir, name, session))
    return tuple(out)


def data_tokenizer(path) -> KnownTokenizer | None:
    """data.tokenizer as the data checks know it: its name as set and its number of tokens
    (None when unset). A missing or broken file is one error line naming it."""
    if not path:
        return None
    from .tokenizer import TokenizerError, size_of_file, tokenizer_file
    try:
        size = size_of_file(path)
    except TokenizerError as err:   # its words name the command-line flag: say which setting it is
        raise TokenizerError(f"data.tokenizer={path}: " + str(err).replace("(--tokenizer)", "(data.tokenizer)")) \
            from None
    return KnownTokenizer(f"data.tokenizer={path}", size, str(tokenizer_file(path)))


def check_contents(prefix, vocab_size: int, cache_dir=None, verify: Verify | str = Verify.sample, chunks: int = 1,
                   what: str = "", tokenizer: KnownTokenizer | None = None) -> bool:
    """The contents of one dataset before training: every token id below `vocab_size` and below
    the size of the tokenizer that made it (`tokenizer`: data.tokenizer, else the one its
    sidecar records; indexed_dataset.token_id_report) (the sidecar's range; without a sidecar a
    scan, remembered in `cache_dir` so the next launch does not scan again) and, per `verify`,
    the .bin against its sidecar's checksums (`chunks` random chunks, or all). Raises
    DataConfigError (`what` first, naming the setting); returns whether the sidecar holds
    checksums."""
    verify = Verify(verify)
    ds = IndexedDataset(prefix)
    full = verify == Verify.full
    summed = isinstance((matching_meta(ds) or {}).get("checksum"), dict)
    problems = verify_bin(ds, full=full, chunks=chunks, rng=random.Random()) if summed and verify != Verify.none else []
    if not problems:   # (bytes that match their checksums hold the sidecar's id range: no scan needed)
        _, problems = token_id_report(ds, vocab_size, scan=full and not summed, scan_cache=cache_dir,
                                      tokenizer=tokenizer)
    if problems:
        raise DataConfigError(what + problems[0])
    return summed


def _say_unchecked(prefixes: list[str], verify: Verify) -> None:
    if prefixes and verify != Verify.none:
        checked = "their token-id range was scanned instead" if verify == Verify.full else "they were not"
        print(f"note: {len(prefixes)} dataset(s) record no checksums ({', '.join(prefixes[:3])}"
              f"{', ...' if len(prefixes) > 3 else ''}; made before checksums were recorded, or by another tool): "
              f"data.verify={verify.value} could not check their .bin, {checked}. python -m data_tools.inspect "
              f"PREFIX --write-meta records them once.", file=sys.stderr, flush=True)


def check_data(data_path, split, seq_length: int, vocab_size: int, cache_dir=None,
               verify: Verify | str = Verify.sample, tokenizer: str | None = None) -> None:
    """Cheap checks before training (no index is built): every prefix of `data_path` exists,
    the train split of every prefix with a positive weight has documents and at least
    seq_length + 1 tokens, every token id is below `vocab_size` and below the size of the
    tokenizer (data.tokenizer's file `tokenizer`, else the one each sidecar records), and the
    .bin files match their sidecars' checksums (check_contents; about SAMPLED_CHUNKS chunks in
    all with verify="sample"). Raises DataConfigError (same_on_every_rank) naming the prefix,
    the value and the fix."""
    verify = Verify(verify)
    known = data_tokenizer(tokenizer)
    blend = parse_data_path(data_path)
    parse_split(split)
    repeated = repeated_prefixes(data_path)
    if repeated:
        print(f"note: data.data_path names {', '.join(sorted(set(repeated)))} more than once: read as one "
              f"dataset each, with the weights summed (each sample once per epoch, not twice in a row)",
              file=sys.stderr, flush=True)
    unchecked = []
    for weight, prefix in blend:
        try:
            indexed = IndexedDataset(prefix)
        except IndexedDatasetError as err:
            raise DataConfigError(f"data.data_path: {err}") from None
        if weight > 0:
            start, end = split_ranges(len(indexed), split)[0]
            docs = f"{len(indexed):,} document{'s' if len(indexed) != 1 else ''}"
            if end <= start:
                raise DataConfigError(
                    f"data.split={split} leaves no training documents in {indexed.prefix} ({docs}): "
                    f"give the train split a larger share (e.g. data.split=969,30,1) or use more data.")
            tokens = int(indexed.lengths[start:end].sum(dtype=np.int64))
            if tokens < seq_length + 1:
                raise DataConfigError(
                    f"the train split of {indexed.prefix} (documents {start}..{end - 1} of {docs}, "
                    f"data.split={split}) holds {tokens:,} tokens, fewer than model.seq_length + 1 = "
                    f"{seq_length + 1:,} needed for one sample: use more data, a larger train share "
                    f"or a smaller model.seq_length.")
        try:
            if not check_contents(indexed.prefix, vocab_size, cache_dir, verify, max(1, SAMPLED_CHUNKS // len(blend)),
                                  tokenizer=known):
                unchecked.append(str(indexed.prefix))
        except IndexedDatasetError as err:
            raise DataConfigError(str(err)) from None
    _say_unchecked(unchecked, verify)


def check_valid_set(name: str, data_path, seq_length: int, vocab_size: int, cache_dir=None,
                    verify: Verify | str = Verify.sample, tokenizer: str | None = None) -> None:
    """data.valid_sets.<name> before training: its prefixes exist, each holds a sample
    (seq_length + 1 tokens), every token id is below `vocab_size` and the tokenizer's size (as
    check_data) and the .bin files match their checksums (check_contents)."""
    verify = Verify(verify)
    known = data_tokenizer(tokenizer)
    key = f"data.valid_sets.{name}"
    try:
        blend = parse_data_path(data_path)
    except DataConfigError as err:
        raise DataConfigError(f"{key}: {err}") from None
    unchecked = []
    for _, prefix in blend:
        try:
            indexed = IndexedDataset(prefix)
        except IndexedDatasetError as err:
            raise DataConfigError(f"{key}: {err}") from None
        tokens = int(indexed.lengths.sum(dtype=np.int64))
        if tokens < seq_length + 1:
            raise DataConfigError(f"{key}: {indexed.prefix} holds {tokens:,} tokens, fewer than model.seq_length + 1 "
                                  f"= {seq_length + 1:,} needed for one sample: give a larger held-out set.")
        try:
            if not check_contents(indexed.prefix, vocab_size, cache_dir, verify, max(1, SAMPLED_CHUNKS // len(blend)),
                                  what=f"{key}: ", tokenizer=known):
                unchecked.append(str(indexed.prefix))
        except IndexedDatasetError as err:
            raise DataConfigError(f"{key}: {err}") from None
    _say_unchecked(unchecked, verify)


def stream_positions(start: int, count: int, skipped=()) -> list[int]:
    """Positions start..start+count-1 of the data order with the sample ranges `skipped` ([first,
    end) pairs, sorted, disjoint) left out: the indices of the order without skips they fall on
    (training/spikes.py; past the data's end they go on, and index % len(data) is the sample)."""
    if not skipped:
        return list(range(start, start + count))
    out, index, ranges = [], start, list(skipped)
    for first, end in ranges:   # where position `start` falls
        if first <= index:
            index += end - first
    while len(out) < count:
        inside = next((end for first, end in ranges if first <= index < end), None)
        if inside is not None:
            index = inside
            continue
        out.append(index)
        index += 1
    return out


class PretrainingSampler:
    """Micro-batches of sample indices for one data-parallel rank, starting after
    `consumed_samples` (counted over all ranks), so a resumed run continues the same order.
    skipped: sample ranges left out of the order (loss spikes rolled back, training/spikes.py);
    with any, an index may run past the data's end and wraps to its start."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int = 0, data_parallel_size: int = 1, skipped=()):
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data parallel rank {data_parallel_rank} not in [0, {data_parallel_size}).")
        if consumed_samples > total_samples:
            raise ValueError(f"consumed samples {consumed_samples} exceed the {total_samples} available.")
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.rank, self.size = micro_batch_size, data_parallel_rank, data_parallel_size
        self.skipped = sorted(tuple(r) for r in skipped)

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mbs * self.size)

    def __iter__(self):
        step = self.mbs * self.size
        for start in range(self.consumed, self.total - step + 1, step):
            first = start + self.rank * self.mbs
            if not self.skipped:
                yield list(range(first, first + self.mbs))
                continue
            yield [i % self.total for i in stream_positions(first, self.mbs, self.skipped)]
