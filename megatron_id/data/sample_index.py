"""The GPT dataset's index arrays, fast, beside the short references they are tested against.

Sample index (one dataset, `num_samples` samples of seq_length + 1 tokens from documents
[start, end)): documents shuffled per epoch and tiled over as many epochs as the samples need;
sample i starts at token i * seq_length of that stream. All from one seeded RandomState:

    doc_idx      the document order (epochs of permutations), cut after the last document a
                 sample reads (the epochs are still drawn whole, so the random stream, and with
                 it every sample, is what it was before the cut)
    sample_idx   [num_samples + 1, 2]: (position in doc_idx, token offset) where each sample starts
    shuffle_idx  the order samples are served in

`build_sample_index` finds the sample starts with one pass over the documents (a sample starting
inside document d is counted by ceil(end_d / seq_length), a difference and a repeat) instead of a
binary search per sample, in chunks of documents so no array the size of an epoch is made twice;
shuffles run in place on the smallest integer type (RandomState draws the same swaps whatever
the type, so the order is the int64 reference's). Arrays are int32 unless a value needs int64
(a corpus or run past 2**31 documents or samples).

Blend index (`w1 p1 w2 p2 ...`): sample i comes from the dataset furthest behind its weight,
as Megatron does; the loop over samples x datasets runs in C (csrc/blend_index.c via native.py),
the Python loop is its reference and the fallback where no compiler is found.

`estimate_seconds` says how long a build will take (measured on a 2-core 2026 x86 VM; a
build that will take long says so before it starts).
"""
from __future__ import annotations

import math
import sys

import numpy as np

from .native import data_helpers

# documents per step of the passes over an epoch: ~3 MB of temporaries, so that a small corpus's
# build takes no more memory than its arrays (1 << 22 took 3x megatron-core's at 0.5B tokens)
DOCUMENT_CHUNK = 1 << 16

# seconds per unit of work, measured on this project's 2-core VM (benchmarks/data_scale.py) and
# rounded up: the estimate is said before a long build, so erring long is the kinder mistake
SECONDS_PER_DOCUMENT = 1.6e-7      # shuffling, gathering lengths and summing one epoch's document
SECONDS_PER_SAMPLE = 1.2e-7        # a sample's start and its place in the shuffled order
SECONDS_PER_BLEND_STEP = {True: 2e-9, False: 1e-7}   # one sample x one dataset, in C / in Python


def index_dtype(largest: int) -> np.dtype:
    """int32 when every value (at most `largest`) fits, else int64."""
    return np.dtype(np.int32 if largest < 2 ** 31 else np.int64)


def epochs_needed(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    return math.ceil((num_samples * seq_length + 1) / tokens_per_epoch)


def build_sample_index_reference(lengths: np.ndarray, documents: tuple[int, int], num_samples: int,
                                 seq_length: int, seed: int) -> dict:
    """The three indices, written plainly (int64, a binary search per sample start). Returns
    doc_idx whole (every epoch); build_sample_index's is cut after the last document read."""
    documents = np.arange(*documents, dtype=np.int64)
    tokens_per_epoch = int(lengths[documents].sum(dtype=np.int64))
    rng = np.random.RandomState(seed)
    num_epochs = epochs_needed(tokens_per_epoch, num_samples, seq_length)
    doc_idx = np.concatenate([rng.permutation(documents) for _ in range(num_epochs)]).astype(np.int64)
    ends = np.cumsum(lengths[doc_idx], dtype=np.int64)             # stream offset after each doc
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")         # which doc holds each start
    offset = starts - (ends[position] - lengths[doc_idx[position]])
    sample_idx = np.stack([position, offset], axis=1).astype(np.int64)
    shuffle_idx = rng.permutation(num_samples).astype(np.int64)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def build_sample_index(lengths: np.ndarray, documents: tuple[int, int], num_samples: int, seq_length: int,
                       seed: int, progress=lambda text: None) -> dict:
    """build_sample_index_reference's arrays (the same values; doc_idx cut after the last
    document a sample reads), in linear time and about a third of its memory. The caller has
    checked that the documents hold at least 2 tokens."""
    start, end = documents
    tokens_per_epoch = int(lengths[start:end].sum(dtype=np.int64))
    num_documents = end - start
    rng = np.random.RandomState(seed)
    num_epochs = epochs_needed(tokens_per_epoch, num_samples, seq_length)

    progress(f"shuffling {num_epochs} epoch(s) of {num_documents:,} documents")
    doc_idx = np.empty(num_epochs * num_documents, dtype=index_dtype(end))
    for epoch in range(num_epochs):
        order = doc_idx[epoch * num_documents:(epoch + 1) * num_documents]
        for first in range(0, num_documents, DOCUMENT_CHUNK):   # (no epoch-sized temporary)
            piece = order[first:first + DOCUMENT_CHUNK]
            piece[:] = np.arange(start + first, start + first + len(piece), dtype=doc_idx.dtype)
        rng.shuffle(order)   # in place: the draws of rng.permutation(documents)

    progress(f"finding the starts of {num_samples:,} samples")
    sample_idx = np.empty((num_samples + 1, 2), dtype=index_dtype(len(doc_idx)))
    stream_end, found = 0, 0          # tokens before this chunk; sample starts placed so far
    for first in range(0, len(doc_idx), DOCUMENT_CHUNK):
        chunk_lengths = lengths[doc_idx[first:first + DOCUMENT_CHUNK]].astype(np.int64)
        ends = stream_end + np.cumsum(chunk_lengths)
        # sample starts below each document's end: k * seq_length < end for k < ceil(end / seq)
        below = np.minimum(-(-ends // seq_length), num_samples + 1)
        per_document = np.diff(below, prepend=found)   # the starts that fall inside each document
        count = int(below[-1]) - found
        if count:
            rows = sample_idx[found:found + count]
            rows[:, 0] = np.repeat(np.arange(first, first + len(ends), dtype=np.int64), per_document)
            document_start = np.repeat(ends - chunk_lengths, per_document)
            rows[:, 1] = np.arange(found, found + count, dtype=np.int64) * seq_length - document_start
        found, stream_end = int(below[-1]), int(ends[-1])
        if found == num_samples + 1:
            break
    doc_idx = doc_idx[:int(sample_idx[-1, 0]) + 1]   # what the samples read; the rest is never used

    progress(f"shuffling {num_samples:,} samples")
    shuffle_idx = np.arange(num_samples, dtype=index_dtype(num_samples))
    rng.shuffle(shuffle_idx)   # the draws of rng.permutation(num_samples)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def build_blending_index_reference(weights, num_samples: int) -> dict:
    """Megatron's greedy blend, plainly: sample i comes from the dataset furthest behind its
    weight (the first on a tie)."""
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


def build_blending_index(weights, num_samples: int, progress=lambda text: None) -> dict:
    """build_blending_index_reference's values (dataset_sample_index as int32 where it fits), in C."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    if len(weights) > np.iinfo(np.int16).max:
        raise ValueError(f"a blend of {len(weights)} datasets: at most {np.iinfo(np.int16).max} are supported.")
    library = data_helpers()
    if library is None:
        progress(f"blending {num_samples:,} samples over {len(weights)} datasets (in Python)")
        return build_blending_index_reference(weights, num_samples)
    progress(f"blending {num_samples:,} samples over {len(weights)} datasets")
    dataset_index = np.empty(num_samples, dtype=np.int16)
    sample_index = np.empty(num_samples, dtype=index_dtype(num_samples))
    counts = np.zeros(len(weights), dtype=np.int64)
    status = library.megatron_id_blend_index(weights.ctypes.data, len(weights), num_samples, dataset_index.ctypes.data,
                                             sample_index.ctypes.data, sample_index.itemsize, counts.ctypes.data)
    if status != 0:
        raise RuntimeError(f"the blend helper refused its arguments (status {status})")
    return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}


def estimate_seconds(*, documents: int = 0, epochs: int = 1, samples: int = 0, blend_datasets: int = 0) -> float:
    """Roughly how long a sample index (`documents` x `epochs`, `samples`) or a blend index
    (`samples` over `blend_datasets`) takes to build on one core."""
    if blend_datasets:
        native = data_helpers() is not None
        return samples * blend_datasets * SECONDS_PER_BLEND_STEP[native] + samples * 2e-9
    return documents * epochs * SECONDS_PER_DOCUMENT + samples * SECONDS_PER_SAMPLE


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
