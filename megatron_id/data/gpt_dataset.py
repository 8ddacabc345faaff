"""GPT training samples from indexed datasets, with Megatron's rules and numpy only.

- `--split 969,30,1`: contiguous ranges of documents for train / valid / test.
- A sample is seq_length + 1 tokens packed across document boundaries (no padding): documents
  are shuffled per epoch and tiled over as many epochs as the requested samples need; sample i
  covers tokens [i * seq_length, (i + 1) * seq_length] of that stream (consecutive samples share
  one token: the last label of one is the first input of the next), and samples are shuffled.
  All from one seeded RandomState.
- The three indices (document order, sample boundaries, sample order) are built vectorised
  (a cumulative sum and a binary search, no C++ helper to compile), saved as .npy files keyed
  by a hash of their description, built once by rank 0 while the others wait, and memory-mapped.
- Blending several prefixes (`w1 p1 w2 p2 ...`): at each step take the dataset furthest behind
  its weight, as Megatron does.
- `PretrainingSampler` resumes from a number of consumed samples: the order after resuming is
  the order without interruption.
- `check_data(data_path, split, seq_length, vocab_size)` is the cheap check the trainer runs
  before starting (no index is built): every prefix exists, every train split can make a sample
  and every token id fits the model's vocabulary. Its errors are DataConfigError, the same on
  every rank.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from ..errors import UserError
from .indexed_dataset import IndexedDataset, IndexedDatasetError, check_token_ids, resolve_prefix

INDEX_VERSION = 1


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


# ---------------------------------------------------------------- cached indices

def _is_rank0_and_sync():
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0, dist.barrier
    except ImportError:
        pass
    return True, lambda: None


def cached_arrays(description: dict, cache_dir, build) -> tuple[dict, bool]:
    """Load the arrays for `description` from cache_dir, building them first if needed (rank 0
    only under torch.distributed; the others wait at a barrier). Returns (arrays, built_here)."""
    cache_dir = Path(cache_dir)
    key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
    meta = cache_dir / f"{key}_description.json"
    is_builder, barrier = _is_rank0_and_sync()
    built = False
    if is_builder and not meta.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        arrays = build()
        for name, array in arrays.items():
            tmp = cache_dir / f".{key}_{name}.npy.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                np.save(f, array)
            os.replace(tmp, cache_dir / f"{key}_{name}.npy")
        tmp = cache_dir / f".{key}_description.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({**description, "arrays": sorted(arrays)}, indent=1, sort_keys=True))
        os.replace(tmp, meta)   # written last: its presence means the arrays are complete
        built = True
    barrier()
    if not meta.is_file():
        raise FileNotFoundError(f"index cache {meta} is missing after rank 0 built it: the cache "
                                f"folder {cache_dir} must be shared by all ranks.")
    names = json.loads(meta.read_text())["arrays"]
    return {n: np.load(cache_dir / f"{key}_{n}.npy", mmap_mode="r") for n in names}, built


def build_sample_index(lengths: np.ndarray, documents: np.ndarray, num_samples: int,
                       seq_length: int, seed: int) -> dict:
    """The three Megatron indices for `num_samples` samples drawn from `documents`."""
    tokens_per_epoch = int(lengths[documents].sum(dtype=np.int64))
    if tokens_per_epoch < 2:
        raise DataConfigError(f"the split holds {tokens_per_epoch} tokens: too few to make samples; "
                              f"give it more documents (data.split) or more data.")
    num_epochs = math.ceil((num_samples * seq_length + 1) / tokens_per_epoch)
    rng = np.random.RandomState(seed)
    doc_idx = np.concatenate([rng.permutation(documents) for _ in range(num_epochs)]).astype(np.int64)
    ends = np.cumsum(lengths[doc_idx], dtype=np.int64)             # stream offset after each doc
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")         # which doc holds each start
    offset = starts - (ends[position] - lengths[doc_idx[position]])
    sample_idx = np.stack([position, offset], axis=1).astype(np.int64)
    shuffle_idx = rng.permutation(num_samples).astype(np.int64)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


class GPTDataset:
    """`num_samples` samples of seq_length + 1 tokens (int64) from `documents` of `indexed`."""

    def __init__(self, indexed: IndexedDataset, documents: tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, cache_dir, name: str = "train"):
        self.indexed, self.seq_length, self.num_samples, self.name = indexed, seq_length, num_samples, name
        start, end = documents
        if end <= start:
            raise DataConfigError(f"{name} split of {indexed.prefix} has no documents "
                                  f"({start}:{end}); change data.split or the data.")
        description = {"class": "GPTDataset", "version": INDEX_VERSION, "name": name,
                       "prefix": str(Path(indexed.prefix).resolve()), "num_documents": len(indexed),
                       "num_tokens": indexed.num_tokens, "documents": [start, end],
                       "num_samples": num_samples, "seq_length": seq_length, "seed": seed}
        arrays, self.built_index = cached_arrays(description, cache_dir, lambda: build_sample_index(
            indexed.lengths, np.arange(start, end, dtype=np.int64), num_samples, seq_length, seed))
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.shuffle_idx[i])
        (first, first_off), (last, last_off) = self.sample_idx[j], self.sample_idx[j + 1]
        if first == last:
            return self.indexed.get(int(self.doc_idx[first]), int(first_off),
                                    int(last_off - first_off + 1)).astype(np.int64)
        parts = [self.indexed.get(int(self.doc_idx[first]), int(first_off))]
        parts += [self.indexed.get(int(self.doc_idx[k])) for k in range(first + 1, last)]
        parts.append(self.indexed.get(int(self.doc_idx[last]), 0, int(last_off) + 1))
        return np.concatenate(parts).astype(np.int64)


def build_blending_index(weights, num_samples: int) -> dict:
    """Megatron's greedy blend: sample i comes from the dataset furthest behind its weight."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    dataset_index = np.empty(num_samples, dtype=np.int16)
    sample_index = np.empty(num_samples, dtype=np.int64)
    for i in range(num_samples):
        best, best_err = 0, -math.inf
        for d, w in enumerate(weights):
            err = w * (i + 1) - counts[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i], sample_index[i] = best, counts[best]
        counts[best] += 1
    return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}


class BlendedDataset:
    def __init__(self, datasets, weights, num_samples: int, cache_dir, name: str = "train"):
        self.datasets, self.num_samples = datasets, num_samples
        description = {"class": "BlendedDataset", "version": INDEX_VERSION, "name": name,
                       "weights": [float(w) for w in weights], "num_samples": num_samples,
                       "datasets": [len(d) for d in datasets]}
        arrays, self.built_index = cached_arrays(
            description, cache_dir, lambda: build_blending_index(weights, num_samples))
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        for d, ds in enumerate(datasets):
            need = int((np.asarray(self.dataset_index) == d).sum())
            if need > len(ds):
                raise ValueError(f"blend needs {need} samples from dataset {d} but it holds {len(ds)}.")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def build_gpt_datasets(data_path, split: str, num_samples, seq_length: int, seed: int, cache_dir):
    """(train, valid, test) datasets for `num_samples` = (n_train, n_valid, n_test); a split
    with no samples requested (or no documents) is None."""
    blend = parse_data_path(data_path)
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
            parts.append(GPTDataset(indexed, docs, share, seq_length, seed, cache_dir, name))
            weights.append(weight)
        if not parts:
            out.append(None)
        elif len(parts) == 1:
            out.append(parts[0])
        else:
            out.append(BlendedDataset(parts, weights, n, cache_dir, name))
    return tuple(out)


def check_data(data_path, split, seq_length: int, vocab_size: int) -> None:
    """Cheap checks before training (no index is built; a token-id scan only for a prefix
    without its .meta.json sidecar): every prefix of `data_path` exists, the train split of every
    prefix with a positive weight has documents and at least seq_length + 1 tokens, and every
    token id is below `vocab_size`. Raises DataConfigError (same_on_every_rank) naming the
    prefix, the value and the fix."""
    blend = parse_data_path(data_path)
    parse_split(split)
    repeated = repeated_prefixes(data_path)
    if repeated:
        print(f"note: data.data_path names {', '.join(sorted(set(repeated)))} more than once: read as one "
              f"dataset each, with the weights summed (each sample once per epoch, not twice in a row)",
              file=sys.stderr, flush=True)
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
            check_token_ids(indexed.prefix, vocab_size)
        except IndexedDatasetError as err:
            raise DataConfigError(str(err)) from None


def check_valid_set(name: str, data_path, seq_length: int, vocab_size: int) -> None:
    """data.valid_sets.<name> before training: its prefixes exist, each holds a sample
    (seq_length + 1 tokens), and every token id is below `vocab_size`."""
    key = f"data.valid_sets.{name}"
    try:
        blend = parse_data_path(data_path)
    except DataConfigError as err:
        raise DataConfigError(f"{key}: {err}") from None
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
            check_token_ids(indexed.prefix, vocab_size)
        except IndexedDatasetError as err:
            raise DataConfigError(f"{key}: {err}") from None


class PretrainingSampler:
    """Micro-batches of sample indices for one data-parallel rank, starting after
    `consumed_samples` (counted over all ranks), so a resumed run continues the same order."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int = 0, data_parallel_size: int = 1):
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data parallel rank {data_parallel_rank} not in [0, {data_parallel_size}).")
        if consumed_samples > total_samples:
            raise ValueError(f"consumed samples {consumed_samples} exceed the {total_samples} available.")
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.rank, self.size = micro_batch_size, data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mbs * self.size)

    def __iter__(self):
        step = self.mbs * self.size
        for start in range(self.consumed, self.total - step + 1, step):
            first = start + self.rank * self.mbs
            yield list(range(first, first + self.mbs))
