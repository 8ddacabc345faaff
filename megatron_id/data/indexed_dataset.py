"""Megatron's indexed dataset: `<prefix>.bin` (token ids back to back) + `<prefix>.idx`.

Byte-compatible with Megatron-LM and GPT-NeoX ("MMIDIDX" version 1), little-endian, no padding:

    offset      size      field
    0           9         magic b"MMIDIDX\\x00\\x00"
    9           8         uint64 version = 1
    17          1         uint8 dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)
    18          8         uint64 N, number of sequences
    26          8         uint64 D + 1, number of document boundaries (with the leading 0)
    34          4N        int32 sequence lengths
    34 + 4N     8N        int64 byte offsets of each sequence in .bin
    34 + 12N    8(D+1)    int64 document boundaries, in sequence indices: [0, ..., N]

Here one document is one sequence (no sentence splitting), so the boundaries are 0..N.
Writers write to temporary names and rename at the end: a crash never leaves a partial file
under the final name. Readers memory-map both files and check their sizes against the header.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")   # magic, version, dtype code, N, D + 1: 34 bytes
# 6 and 7 are floating types whose meaning differs between projects: never written
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
DOCUMENT_SUFFIX = "_text_document"


class IndexedDatasetError(UserError, ValueError):
    """A missing, truncated or corrupt .bin/.idx pair, described with the files involved."""


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (Megatron's threshold: vocabulary < 65500), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def resolve_prefix(path: str | os.PathLike) -> Path:
    """Accept `prefix`, `prefix.bin`, `prefix.idx`, or the prefix without `_text_document`;
    return the prefix whose two files exist, or fail naming every pair looked for."""
    text = str(path)
    for ext in (".bin", ".idx"):
        if text.endswith(ext):
            text = text[: -len(ext)]
    candidates = [text] if text.endswith(DOCUMENT_SUFFIX) else [text, text + DOCUMENT_SUFFIX]
    for prefix in candidates:
        if Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file():
            return Path(prefix)
    looked = "; ".join(f"{p}.bin + {p}.idx" for p in candidates)
    found = [f for p in candidates for f in (p + ".bin", p + ".idx") if Path(f).is_file()]
    extra = f" (only {', '.join(found)} exists)" if found else ""
    raise IndexedDatasetError(
        f"no indexed dataset at '{path}': looked for {looked}{extra}. Pass the output prefix of "
        f"preprocessing, e.g. my_corpus_text_document (with or without .bin/.idx).")


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


class IndexedDatasetWriter:
    """Streams sequences into `<prefix>.bin/.idx`, atomically.

        with IndexedDatasetWriter(prefix, dtype) as w:
            w.add(np.array([...]))
    Leaving the block normally renames the temporary files into place; an exception removes
    them. Sequence lengths are kept in memory (4 bytes per document), nothing else is.
    """

    def __init__(self, prefix: str | os.PathLike, dtype):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"dtype {self.dtype} cannot be written (use one of "
                             f"{sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())})")
        self.bin_path, self.idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp, self._idx_tmp = _temp_name(self.bin_path), _temp_name(self.idx_path)
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = np.zeros(1024, dtype=np.int32)
        self.num_sequences = 0

    def add(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < np.iinfo(self.dtype).min or tokens.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids {tokens.min()}..{tokens.max()} do not fit {self.dtype}")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        if self.num_sequences == len(self._lengths):
            self._lengths = np.resize(self._lengths, 2 * len(self._lengths))
        self._lengths[self.num_sequences] = tokens.size
        self.num_sequences += 1

    def add_many(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append several sequences given as one flat array and their lengths (fast path)."""
        self._bin.write(np.asarray(flat).astype(self.dtype, copy=False).tobytes())
        self._extend_lengths(lengths)

    def append(self, other: "IndexedDataset", chunk_tokens: int = 1 << 24) -> None:
        """Append every sequence of another dataset of the same dtype, copying in chunks."""
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"cannot append {other.prefix} ({other.dtype}) to a "
                                      f"{self.dtype} dataset.")
        for start in range(0, other.num_tokens, chunk_tokens):
            self._bin.write(np.asarray(other._bin[start:start + chunk_tokens]).tobytes())
        self._extend_lengths(other.lengths)

    def _extend_lengths(self, lengths) -> None:
        need = self.num_sequences + len(lengths)
        if need > len(self._lengths):
            self._lengths = np.resize(self._lengths, max(need, 2 * len(self._lengths)))
        self._lengths[self.num_sequences:need] = lengths
        self.num_sequences = need

    def finalize(self) -> None:
        self._bin.close()
        write_index(self._idx_tmp, self.dtype, self._lengths[: self.num_sequences])
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)

    def abort(self) -> None:
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if path.exists():
                path.unlink()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
        return False


def write_index(path, dtype, lengths: np.ndarray) -> None:
    lengths = np.asarray(lengths, dtype=np.int32)
    n = len(lengths)
    pointers = np.zeros(n, dtype=np.int64)
    if n:
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, CODE_OF[np.dtype(dtype)], n, n + 1))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(n + 1, dtype=np.int64).tobytes())


class IndexedDataset:
    """Memory-mapped reader. ds[i] -> np.ndarray of sequence i; ds.get(i, offset, length)."""

    def __init__(self, path: str | os.PathLike):
        self.prefix = resolve_prefix(path)
        self.bin_path, self.idx_path = Path(f"{self.prefix}.bin"), Path(f"{self.prefix}.idx")
        idx_size = self.idx_path.stat().st_size
        if idx_size < HEADER.size:
            raise IndexedDatasetError(f"{self.idx_path} is truncated: {idx_size} bytes, shorter "
                                      f"than the {HEADER.size}-byte header.")
        with open(self.idx_path, "rb") as f:
            magic, version, code, n, n_docs = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise IndexedDatasetError(f"{self.idx_path} is not a Megatron index (magic {magic!r}, "
                                      f"expected {MAGIC!r}).")
        if version != VERSION or code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{self.idx_path}: unsupported version {version} or dtype "
                                      f"code {code} (supported: version 1, codes {sorted(DTYPE_CODES)}).")
        expected = HEADER.size + 12 * n + 8 * n_docs
        if idx_size != expected:
            raise IndexedDatasetError(f"{self.idx_path} has {idx_size} bytes but its header "
                                      f"({n} sequences, {n_docs} document boundaries) needs "
                                      f"{expected}: the file is truncated or corrupt.")
        self.dtype = np.dtype(DTYPE_CODES[code])
        index = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        self.lengths = np.frombuffer(index, dtype=np.int32, count=n, offset=HEADER.size)
        self.pointers = np.frombuffer(index, dtype=np.int64, count=n, offset=HEADER.size + 4 * n)
        self.document_index = np.frombuffer(index, dtype=np.int64, count=n_docs,
                                            offset=HEADER.size + 12 * n)
        total = int(self.lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        bin_size = self.bin_path.stat().st_size
        if bin_size != total:
            raise IndexedDatasetError(f"{self.bin_path} has {bin_size} bytes but {self.idx_path} "
                                      f"describes {total}: the pair is truncated or mismatched.")
        self._bin = np.memmap(self.bin_path, mode="r", dtype=self.dtype) if total else \
            np.zeros(0, dtype=self.dtype)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        n = int(self.lengths[i]) - offset if length is None else length
        return np.asarray(self._bin[start:start + n])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def check(self) -> list[str]:
        """Integrity problems beyond the header checks done on opening (empty list: healthy)."""
        problems = []
        if (self.lengths < 0).any():
            problems.append(f"{int((self.lengths < 0).sum())} negative sequence lengths")
        expected = np.zeros(len(self), dtype=np.int64)
        if len(self):
            np.cumsum(self.lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=expected[1:])
        bad = np.flatnonzero(self.pointers != expected)
        if bad.size:
            problems.append(f"{bad.size} byte offsets disagree with the lengths (first at "
                            f"sequence {bad[0]}: {self.pointers[bad[0]]} != {expected[bad[0]]})")
        d = self.document_index
        if len(d) == 0 or d[0] != 0 or d[-1] != len(self) or (np.diff(d) < 0).any():
            problems.append("the document index is not an increasing list from 0 to the number "
                            "of sequences")
        return problems
