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

Usually one document is one sequence, so the boundaries are 0..N; Megatron's sentence-level input
(a list of sentences per document) gives documents of several sequences, and its empty
documents (`--keep-empty`) documents of none. The GPT datasets sample sequences, as Megatron's do.
Writers write to temporary names (`.<name>.tmp-<pid>`) and rename at the end: a crash never
leaves a partial file under the final name, and the temporary files of a killed run are removed
by the next run for the same output (`remove_stale_temps`). Readers memory-map both files and
check their sizes against the header.

Beside the pair, writers put a small sidecar `<prefix>.meta.json` (ours; Megatron ignores it):

    {"format": "megatron_id.dataset_meta/1", "dtype": "uint16", "vocab_size": 50257,
     "max_token_id": 50256, "min_token_id": 0, "num_sequences": 150, "num_documents": 150,
     "num_tokens": 89203,
     "tokenizer": "/abs/path/tokenizer.json", "tokenizer_id": "vocab:1a2b3c4d5e6f7a8b",
     "eod_id": 50256, "bin_bytes": 178406,
     "checksum": {"algorithm": "crc32", "chunk_bytes": 16777216, "chunks": [2882382797]}}

`checksum` holds the crc32 of every 16 MiB of the .bin, computed as it was written, so that
`verify_bin` can check a few chunks at every launch (train: data.verify=sample, the default) or
all of them (data.verify=full) and a .bin changed after preprocessing is refused with the bytes
that differ named. Sidecars written before it was recorded lack it (and `bin_bytes`); so does
Megatron-made data, which has no sidecar at all: `python -m data_tools.inspect PREFIX
--write-meta` writes one.

`tokenizer_id` is the tokenizer's identity (megatron_id/data/tokenizer.py: a hash of its id ->
token table); sidecars written before it was recorded lack the key, and read as unknown.

`check_token_ids(prefix, vocab_size)` uses it (or scans the .bin when it is missing or stale)
so that a model whose vocabulary is too small for the data fails before training instead of
training on ids it cannot embed, and so that ids the data's tokenizer cannot produce (at or
above its size: the tokenizer the caller names, else the one the sidecar records) are refused
whatever the model's vocabulary: they are another tokenizer's ids, or damage.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import struct
import sys
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..atomic import write_atomic_text
from ..errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")   # magic, version, dtype code, N, D + 1: 34 bytes
# 6 and 7 are floating types whose meaning differs between projects: never written
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
DOCUMENT_SUFFIX = "_text_document"


META_FORMAT = "megatron_id.dataset_meta/1"
SCAN_CHUNK_TOKENS = 64 * 1024 * 1024   # tokens per memory-mapped slice when scanning a .bin
CHECKSUM_CHUNK_BYTES = 1 << 24         # the .bin's crc32 is recorded per 16 MiB
SAMPLED_CHUNKS = 32                    # data.verify=sample checks about this many chunks per blend


class IndexedDatasetError(UserError, ValueError):
    """A missing, truncated or corrupt .bin/.idx pair, described with the files involved."""


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (Megatron's threshold: vocabulary < 65500), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def resolve_prefix(path: str | os.PathLike) -> Path:
    """Accept `prefix`, `prefix.bin`, `prefix.idx`, or the prefix without `_text_document`;
    return the prefix whose two files exist, or fail naming every pair looked for."""
    text = str(path)
    for ext in (".bin", ".idx", ".meta.json"):   # any of the dataset's own files names it
        if text.endswith(ext):
            text = text[: -len(ext)]
            break
    candidates = [text] if text.endswith(DOCUMENT_SUFFIX) else [text, text + DOCUMENT_SUFFIX]
    for prefix in candidates:
        if Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file():
            return Path(prefix)
    looked = "; ".join(f"{p}.bin + {p}.idx" for p in candidates)
    found = [f for p in candidates for f in (p + ".bin", p + ".idx") if Path(f).is_file()]
    extra = f" (only {', '.join(found)} exists)" if found else ""
    raise IndexedDatasetError(
        f"no indexed dataset at '{path}': looked for {looked}{extra}. {_what_was_given(Path(path))}")


def _what_was_given(path: Path) -> str:
    """The fix for a path that names no dataset: a folder's datasets, the preprocessing of a
    document file given instead of its dataset, else the form of a prefix."""
    if path.is_dir():
        inside = sorted(str(p)[: -len(".idx")] for p in path.glob("*.idx") if p.with_suffix(".bin").is_file())
        if inside:
            shown = ", ".join(inside[:3]) + (f" and {len(inside) - 3} more" if len(inside) > 3 else "")
            return (f"It is a folder: name one of its datasets ({shown}), or blend them with weights "
                    f"(w1 p1 w2 p2 ...).")
        return "It is a folder holding no .bin/.idx pair: pass the output prefix of preprocessing."
    doubled = Path(f"{path}{DOCUMENT_SUFFIX}.bin")
    if str(path).endswith(DOCUMENT_SUFFIX) and doubled.is_file():
        return (f"{doubled} exists: the data was preprocessed with an --output-prefix that already ended in "
                f"{DOCUMENT_SUFFIX}. Pass {str(doubled)[:-4]}, or rename its three files to {path}.*")
    name = path.name.lower()
    if path.is_file() and name.endswith((".jsonl", ".json", ".parquet", ".txt", ".gz", ".zst", ".ndjson")):
        out = path.parent / name.split(".")[0]
        return (f"It is a document file, not a preprocessed dataset: tokenize it first, e.g. python -m "
                f"data_tools.preprocess --input {path} --tokenizer tokenizer.json --output-prefix {out} "
                f"--append-eod, then pass {out}{DOCUMENT_SUFFIX}.")
    return "Pass the output prefix of preprocessing, e.g. my_corpus_text_document (with or without .bin/.idx)."


def meta_path(prefix: str | os.PathLike) -> Path:
    """The sidecar of a dataset prefix: `<prefix>.meta.json`."""
    return Path(f"{prefix}.meta.json")


def output_files(prefix: str | os.PathLike) -> list[Path]:
    """The files a writer creates for `prefix`: .bin, .idx and the .meta.json sidecar."""
    return [Path(f"{prefix}.bin"), Path(f"{prefix}.idx"), meta_path(prefix)]


def temp_path(path: str | os.PathLike, pid: int | None = None) -> Path:
    """Where a writer puts `path` until it is complete: `.<name>.tmp-<pid>` in the same folder
    (same file system, so the final rename is atomic; the pid tells stale ones apart)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid() if pid is None else pid}")


_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    return True


def remove_stale_temps(targets) -> list[Path]:
    """Remove the temporary files (or folders) that killed runs left for the given final paths:
    `.<name>.tmp-<pid>` beside each target whose pid is not a live process on this machine.
    Those of live processes (a run going on now) are left alone. Returns what was removed."""
    by_folder: dict[Path, set[str]] = {}
    for target in map(Path, targets):
        by_folder.setdefault(target.parent, set()).add(target.name)
    removed = []
    for folder, names in by_folder.items():
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            match = _TEMP_NAME.match(entry.name)
            if not match or match["name"] not in names:
                continue
            pid = int(match["pid"])
            if pid == os.getpid() or _pid_alive(pid):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


class ChunkChecksums:
    """crc32 of every `chunk_bytes` of a byte stream, fed in pieces of any size."""

    def __init__(self, chunk_bytes: int = CHECKSUM_CHUNK_BYTES):
        self.chunk_bytes, self.chunks, self._crc, self._filled = chunk_bytes, [], 0, 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.chunk_bytes - self._filled)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self.chunks.append(self._crc)
                self._crc, self._filled = 0, 0

    def record(self) -> dict:
        """The sidecar's `checksum` entry for what was fed so far."""
        chunks = self.chunks + ([self._crc] if self._filled else [])
        return {"algorithm": "crc32", "chunk_bytes": self.chunk_bytes, "chunks": chunks}


def read_meta(prefix: str | os.PathLike) -> dict | None:
    """The sidecar of `prefix` as a dict, or None when it is absent, unreadable or not ours."""
    try:
        meta = json.loads(meta_path(prefix).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == META_FORMAT else None


class IndexedDatasetWriter:
    """Streams sequences into `<prefix>.bin/.idx` (+ the `.meta.json` sidecar), atomically.

        with IndexedDatasetWriter(prefix, dtype) as w:
            w.add(np.array([...]))
    Leaving the block normally renames the temporary files into place; an exception removes
    them. Sequence lengths and document boundaries are kept in memory (4 + 8 bytes per
    sequence), nothing else is. A sequence is its own document unless `add_many` is told how
    many sequences each document holds (Megatron's sentence-level documents, and its empty
    documents: a document of zero sequences).
    `finalize()` is `prepare()` (close and write the index and sidecar, still under temporary
    names) then `commit()` (the renames): a tool writing several outputs prepares all of them
    before committing any, so a failure leaves every old output as it was.
    The writer replaces existing files: refusing to overwrite is the caller's decision.
    `vocab_size`, `tokenizer`, `tokenizer_id` and `eod_id` are recorded in the sidecar (None:
    unknown).
    """

    def __init__(self, prefix: str | os.PathLike, dtype, *, vocab_size: int | None = None,
                 tokenizer: str | None = None, eod_id: int | None = None,
                 tokenizer_id: str | None = None):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"dtype {self.dtype} cannot be written (use one of "
                             f"{sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())})")
        self.vocab_size, self.tokenizer, self.eod_id = vocab_size, tokenizer, eod_id
        self.tokenizer_id = tokenizer_id
        self.bin_path, self.idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
        self.meta_path = meta_path(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp, self._idx_tmp = temp_path(self.bin_path), temp_path(self.idx_path)
        self._meta_tmp = temp_path(self.meta_path)
        self._bin = open(self._bin_tmp, "wb")
        self._checksums = ChunkChecksums()
        self._lengths = np.zeros(1024, dtype=np.int32)
        self._documents = np.zeros(1024, dtype=np.int64)   # [0, end of doc 1, ...] in sequences
        self.num_documents = 0
        self.num_sequences = 0
        self.num_tokens = 0
        self.min_token_id: int | None = None
        self.max_token_id: int | None = None
        self._prepared = False

    def _see(self, low, high) -> None:
        """Track the id range for the sidecar and refuse ids the dtype cannot hold."""
        low, high = int(low), int(high)
        info = np.iinfo(self.dtype)
        if low < info.min or high > info.max:
            raise ValueError(f"token ids {low}..{high} do not fit {self.dtype}")
        self.min_token_id = low if self.min_token_id is None else min(self.min_token_id, low)
        self.max_token_id = high if self.max_token_id is None else max(self.max_token_id, high)

    def add(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        if tokens.size:
            self._see(tokens.min(), tokens.max())
        self._write_bin(tokens.astype(self.dtype, copy=False).tobytes())
        if self.num_sequences == len(self._lengths):
            self._lengths = np.resize(self._lengths, 2 * len(self._lengths))
        self._lengths[self.num_sequences] = tokens.size
        self.num_sequences += 1
        self._end_documents(np.ones(1, dtype=np.int64))
        self.num_tokens += int(tokens.size)

    def add_many(self, flat: np.ndarray, lengths: np.ndarray, sequences_per_document=None) -> None:
        """Append several sequences given as one flat array and their lengths (fast path).
        `sequences_per_document` (default: one each) groups them into documents; a 0 is an
        empty document, as Megatron writes one."""
        flat = np.asarray(flat)
        if flat.size:
            self._see(flat.min(), flat.max())
        self._write_bin(flat.astype(self.dtype, copy=False).tobytes())
        self._extend_lengths(lengths)
        counts = np.ones(len(lengths), dtype=np.int64) if sequences_per_document is None else \
            np.asarray(sequences_per_document, dtype=np.int64)
        if counts.sum() != len(lengths):
            raise ValueError(f"{int(counts.sum())} sequences in documents, {len(lengths)} given")
        self._end_documents(counts)
        self.num_tokens += int(flat.size)

    def append(self, other: "IndexedDataset", chunk_tokens: int = 1 << 24) -> None:
        """Append every sequence of another dataset of the same dtype, copying in chunks (the
        id range is taken from the chunks as they pass, so inputs need no sidecar)."""
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"cannot append {other.prefix} ({other.dtype}) to a "
                                      f"{self.dtype} dataset.")
        for start in range(0, other.num_tokens, chunk_tokens):
            chunk = np.asarray(other._bin[start:start + chunk_tokens])
            self._see(chunk.min(), chunk.max())
            self._write_bin(chunk.tobytes())
        self._extend_lengths(other.lengths)
        self._end_documents(np.diff(other.document_index))   # its documents, as they were
        self.num_tokens += other.num_tokens

    def _write_bin(self, data: bytes) -> None:
        self._bin.write(data)
        self._checksums.update(data)

    def _extend_lengths(self, lengths) -> None:
        need = self.num_sequences + len(lengths)
        if need > len(self._lengths):
            self._lengths = np.resize(self._lengths, max(need, 2 * len(self._lengths)))
        self._lengths[self.num_sequences:need] = lengths
        self.num_sequences = need

    def _end_documents(self, counts: np.ndarray) -> None:
        """Close documents of counts[i] sequences each; the sequences are already added."""
        need = self.num_documents + 1 + len(counts)
        if need > len(self._documents):
            self._documents = np.resize(self._documents, max(need, 2 * len(self._documents)))
        start = self._documents[self.num_documents]
        self._documents[self.num_documents + 1:need] = start + np.cumsum(counts)
        self.num_documents += len(counts)

    def meta(self) -> dict:
        """The sidecar's content for what was written so far."""
        return {"format": META_FORMAT, "dtype": str(self.dtype), "vocab_size": self.vocab_size,
                "max_token_id": self.max_token_id, "min_token_id": self.min_token_id,
                "num_sequences": self.num_sequences, "num_documents": self.num_documents,
                "num_tokens": self.num_tokens,
                "tokenizer": self.tokenizer, "tokenizer_id": self.tokenizer_id, "eod_id": self.eod_id,
                "bin_bytes": self.num_tokens * self.dtype.itemsize, "checksum": self._checksums.record()}

    def prepare(self) -> None:
        """Close the .bin and write the .idx and the sidecar, all still under temporary names."""
        self._bin.close()
        write_index(self._idx_tmp, self.dtype, self._lengths[: self.num_sequences],
                    self._documents[: self.num_documents + 1])
        self._meta_tmp.write_text(json.dumps(self.meta(), indent=1) + "\n")
        self._prepared = True

    def commit(self) -> None:
        """Rename the prepared files into place. The sidecar goes first (it is checked against
        the pair, so a stale one is ignored), the .idx last (readers check the .bin against it:
        a crash between two renames leaves a pair that is refused on opening, never misread)."""
        if not self._prepared:
            self.prepare()
        os.replace(self._meta_tmp, self.meta_path)
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)

    def finalize(self) -> None:
        self.prepare()
        self.commit()

    def abort(self) -> None:
        """Remove the temporary files; the final names are never touched."""
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp, self._meta_tmp):
            path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
        return False


def write_index(path, dtype, lengths: np.ndarray, documents: np.ndarray | None = None) -> None:
    """documents: the boundaries [0, ..., len(lengths)] in sequences (default: one sequence
    per document)."""
    lengths = np.asarray(lengths, dtype=np.int32)
    n = len(lengths)
    documents = np.arange(n + 1, dtype=np.int64) if documents is None else np.asarray(documents, dtype=np.int64)
    pointers = np.zeros(n, dtype=np.int64)
    if n:
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, CODE_OF[np.dtype(dtype)], n, len(documents)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(documents.tobytes())


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


# ---------------------------------------------------------------- token ids against a vocabulary

def matching_meta(ds: IndexedDataset) -> dict | None:
    """The sidecar of `ds` when it describes this very pair (same number of tokens and
    sequences; the dtype is compared by token_id_report), else None: a sidecar left from an
    earlier pair is ignored rather than believed."""
    meta = read_meta(ds.prefix)
    if meta is not None and meta.get("num_tokens") == ds.num_tokens and \
            meta.get("num_sequences") == len(ds):
        return meta
    return None


def scan_bin(ds: IndexedDataset, chunk_tokens: int = SCAN_CHUNK_TOKENS, checksum: bool = False) -> dict:
    """One pass over the .bin in memory-mapped slices of `chunk_tokens`, unmapped one after the
    other (memory stays bounded whatever the file size): {"min", "max"} token id (None when
    empty) and, with `checksum`, the sidecar's "checksum" record."""
    total = ds.num_tokens
    low = high = None
    sums = ChunkChecksums() if checksum else None
    for start in range(0, total, chunk_tokens):
        count = min(chunk_tokens, total - start)
        part = np.memmap(ds.bin_path, mode="r", dtype=ds.dtype, offset=start * ds.dtype.itemsize,
                         shape=(count,))
        lo, hi = int(part.min()), int(part.max())
        if sums is not None:
            sums.update(part)
        del part
        low = lo if low is None else min(low, lo)
        high = hi if high is None else max(high, hi)
    return {"min": low, "max": high, **({"checksum": sums.record()} if sums is not None else {})}


def scan_token_range(ds: IndexedDataset, chunk_tokens: int = SCAN_CHUNK_TOKENS) -> tuple[int | None, int | None]:
    """(min, max) token id of the .bin (scan_bin without the checksum)."""
    found = scan_bin(ds, chunk_tokens)
    return found["min"], found["max"]


# ---------------------------------------------------------------- a scan remembered (data without sidecar)

SCAN_CACHE_FORMAT = "megatron_id.scan_cache/1"


def _file_identity(path: Path) -> list[int]:
    """What tells a file changed without reading it: its size and modification time (ns)."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def scan_cache_path(ds: IndexedDataset, cache_dir) -> Path:
    """Where the scan of a dataset without sidecar is remembered: one small JSON file per
    dataset in the index cache folder, named by a hash of its absolute prefix."""
    digest = hashlib.md5(str(Path(ds.prefix).resolve()).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"scan-{Path(ds.prefix).name}-{digest}.json"


def cached_scan(ds: IndexedDataset, cache_dir) -> dict | None:
    """The remembered {"min", "max"} of `ds`, or None when there is none or the .bin/.idx have
    changed since (size or modification time)."""
    try:
        record = json.loads(scan_cache_path(ds, cache_dir).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != SCAN_CACHE_FORMAT or \
            record.get("bin") != _file_identity(ds.bin_path) or record.get("idx") != _file_identity(ds.idx_path):
        return None
    return {"min": record.get("min"), "max": record.get("max")}


def remember_scan(ds: IndexedDataset, cache_dir, found: dict) -> Path | None:
    """Write the scan's facts for the next launch (atomically); None, with a note, where the
    cache folder cannot be written (the next launch scans again)."""
    path = scan_cache_path(ds, cache_dir)
    record = {"format": SCAN_CACHE_FORMAT, "prefix": str(Path(ds.prefix).resolve()), "dtype": str(ds.dtype),
              "num_tokens": ds.num_tokens, "num_sequences": len(ds), "min": found["min"], "max": found["max"],
              "bin": _file_identity(ds.bin_path), "idx": _file_identity(ds.idx_path)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic_text(path, json.dumps(record, indent=1) + "\n", temp=temp_path(path))
        return path
    except OSError as err:
        print(f"note: could not remember the token-id scan of {ds.prefix} in {path.parent} ({err.strerror or err}): "
              f"the next launch scans it again; python -m data_tools.inspect {ds.prefix} --write-meta writes its "
              f"sidecar once", file=sys.stderr, flush=True)
        return None


# ---------------------------------------------------------------- the .bin against its recorded checksums

def verify_bin(ds: IndexedDataset, full: bool = False, chunks: int = 1, rng: random.Random | None = None) -> list[str]:
    """Check the .bin against the crc32 its sidecar recorded when it was written: every chunk
    (`full`) or `chunks` chunks drawn at random. Returns the problems ([] also when the sidecar
    records no checksum: callers say so)."""
    meta = matching_meta(ds)
    record = (meta or {}).get("checksum")
    if not isinstance(record, dict):
        return []
    meta_file = meta_path(ds.prefix)
    size = ds.bin_path.stat().st_size
    chunk_bytes, sums = record.get("chunk_bytes"), record.get("chunks")
    if record.get("algorithm") != "crc32" or not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or \
            not isinstance(sums, list) or len(sums) != -(-size // chunk_bytes):
        return [f"{meta_file} has a checksum record that does not describe {ds.bin_path} ({size:,} bytes): "
                f"the sidecar is damaged. Re-create it with python -m data_tools.inspect {ds.prefix} --write-meta "
                f"--replace-meta, if the .bin is known to be good."]
    rng = rng or random.Random()
    picked = range(len(sums)) if full else sorted(rng.sample(range(len(sums)), min(chunks, len(sums))))
    bad = []
    with open(ds.bin_path, "rb") as f:
        for i in picked:
            f.seek(i * chunk_bytes)
            if zlib.crc32(f.read(chunk_bytes)) != sums[i]:
                bad.append(i)
                if not full:
                    break
    if not bad:
        return []
    i = bad[0]
    end = min((i + 1) * chunk_bytes, size)
    span = f"bytes {i * chunk_bytes:,}..{end - 1:,} (tokens from {i * chunk_bytes // ds.dtype.itemsize:,})"
    what = (f"{len(bad):,} of its {len(sums):,} chunks of {chunk_bytes:,} bytes (the first: {span}) do not match the "
            f"checksums" if full else f"{span} do not match the checksum")
    return [f"{ds.bin_path}: {what} {meta_file} recorded when the file was written: the .bin was changed or "
            f"damaged after it was made. python -m data_tools.inspect {ds.prefix} --check shows its token ids; "
            f"re-create it with data_tools.preprocess, or restore it from the original copy."]


class KnownTokenizer(NamedTuple):
    """The tokenizer the data must have been made with, as the caller knows it: `label` names it
    as the user gave it ("data.tokenizer=gpt2/tokenizer.json"), `size` is its number of tokens
    (added tokens included), `path` its file when known. An id at or above `size` cannot come
    from any text it encodes."""
    label: str
    size: int
    path: str | None = None


def ids_at_or_above(ds: IndexedDataset, limit: int, chunk_tokens: int = SCAN_CHUNK_TOKENS) -> dict:
    """Where the ids >= `limit` of a dataset are, for an error message (one bounded-memory pass):
    {"count", "values" (up to 4 distinct, sorted), "document", "sequence", "offset" (of the
    first one), "per" (tokens per such id, rounded)}."""
    count, values, first = 0, set(), None
    for start in range(0, ds.num_tokens, chunk_tokens):
        n = min(chunk_tokens, ds.num_tokens - start)
        part = np.memmap(ds.bin_path, mode="r", dtype=ds.dtype, offset=start * ds.dtype.itemsize, shape=(n,))
        where = np.flatnonzero(part >= limit)
        if where.size:
            count += int(where.size)
            if first is None:
                first = start + int(where[0])
            if len(values) < 4:
                values.update(int(v) for v in np.unique(part[where[:100_000]])[:4])
        del part
    out = {"count": count, "values": sorted(values)[:4], "document": None, "sequence": None, "offset": None,
           "per": round(ds.num_tokens / count) if count else None}
    if first is not None:
        ends = np.cumsum(ds.lengths, dtype=np.int64)
        sequence = int(np.searchsorted(ends, first, side="right"))
        out.update(sequence=sequence, offset=first - (int(ends[sequence - 1]) if sequence else 0),
                   document=int(np.searchsorted(ds.document_index, sequence, side="right")) - 1)
    return out


def _describe_ids_at_or_above(ds: IndexedDataset, limit: int) -> str:
    """'3,567 of its 178,330 ids (1 in 50; values 60,000 only) are 50,257 or more, the first in
    document 0 (token 12)'."""
    found = ids_at_or_above(ds, limit)
    if not found["count"]:
        return ""
    shown = ", ".join(f"{v:,}" for v in found["values"])
    values = f"values {shown} only" if len(found["values"]) < 4 else f"values such as {shown}"
    where = f"document {found['document']:,}" if len(ds.document_index) - 1 == len(ds) else \
        f"document {found['document']:,} (sequence {found['sequence']:,})"
    verb = "are" if found["count"] > 1 else "is"
    return (f"{found['count']:,} of its {ds.num_tokens:,} ids (1 in {found['per']:,}; {values}) {verb} "
            f"{limit:,} or more, the first in {where}, token {found['offset']:,}")


def token_id_report(ds: IndexedDataset, vocab_size: int | None = None, *, scan: bool = False,
                    what: str = "model.vocab_size", scan_cache=None, tokenizer: KnownTokenizer | None = None,
                    tokenizer_option: str = "data.tokenizer") -> tuple[dict, list[str]]:
    """The token-id range of a dataset and the problems found with it.

    Uses the sidecar when it matches the pair (same dtype, number of tokens and sequences) and
    `scan` is False, else scans the .bin; without a sidecar and with a `scan_cache` folder, the
    scan is remembered there (keyed by the files' size and modification time) and a later call
    reads it instead of scanning again (source "scan cache"). Problems: the sidecar's dtype differs from the .idx
    dtype code (the index was written or patched with the wrong code, e.g. int16 over uint16
    data, whose ids above 32767 then read as negative), a negative id, an id at or above the
    size of the tokenizer the data was made with (`tokenizer`, given by the caller as
    `tokenizer_option` names it, else the vocabulary its sidecar records), an id at or above
    `vocab_size` (named `what` in the message), and a scanned range that contradicts the
    sidecar. Returns ({"min", "max", "source", "vocab_size", "meta"}, problems).

    An id the tokenizer cannot produce is refused whatever `vocab_size` is: a model.vocab_size
    padded above the tokenizer (50304 for GPT-2's 50257) leaves room for such ids, and raising it
    would only train on damage. The advice puts the likely causes first (data of another
    tokenizer, a damaged .bin); raising `what` is offered only where no tokenizer is known."""
    problems = []
    meta = matching_meta(ds)
    meta_file = meta_path(ds.prefix)
    matches = meta is not None
    if matches and meta.get("dtype") != str(ds.dtype):
        recorded = meta.get("dtype")
        code = {str(np.dtype(t)): c for c, t in DTYPE_CODES.items()}.get(recorded, "?")
        problems.append(
            f"{ds.idx_path} declares {ds.dtype} token ids (dtype code {CODE_OF[ds.dtype]}) but "
            f"{meta_file} records {recorded}, as the data was written: the .idx has the wrong "
            f"dtype code, so ids read back wrong (an int16 index over uint16 data turns ids above "
            f"32767 negative). Re-create the pair with data_tools.preprocess, or set byte 17 of "
            f"the .idx to {code} ({recorded}).")
    use_meta = matches and not problems and not scan
    remembered = cached_scan(ds, scan_cache) if scan_cache is not None and not matches and not scan else None
    if use_meta:
        low, high, source = meta.get("min_token_id"), meta.get("max_token_id"), "sidecar"
    elif remembered is not None:
        low, high, source = remembered["min"], remembered["max"], "scan cache"
    else:
        (low, high), source = scan_token_range(ds), "scan"
        if scan_cache is not None and not matches:
            remember_scan(ds, scan_cache, {"min": low, "max": high})
        if matches and not problems and (low, high) != (meta.get("min_token_id"), meta.get("max_token_id")):
            problems.append(f"{ds.bin_path} holds token ids {low}..{high} but {meta_file} records "
                            f"{meta.get('min_token_id')}..{meta.get('max_token_id')}: the .bin was "
                            f"changed after it was written. Re-create the pair with data_tools.preprocess.")
    known_vocab = meta.get("vocab_size") if matches else None
    if low is not None and low < 0:
        problems.append(f"{ds.bin_path} holds negative token id {low} (read as {ds.dtype}, the "
                        f"dtype code in {ds.idx_path}): the .idx dtype code is wrong (an int16 "
                        f"index over uint16 data?) or the file is corrupt. Re-create the pair with "
                        f"data_tools.preprocess.")
    recorded = None   # the tokenizer the sidecar records, as the user can find it
    if isinstance(known_vocab, int) and known_vocab > 0:
        path = meta.get("tokenizer")
        recorded = KnownTokenizer(f"the tokenizer{f' ({path})' if path else ''} recorded in {meta_file}",
                                  known_vocab, path)
    known = tokenizer or recorded
    if known is not None and high is not None and high >= known.size:
        problems.append(_impossible_ids(ds, high, known, recorded if tokenizer else None, tokenizer_option, what))
    elif vocab_size is not None and high is not None and high >= vocab_size:
        if known is not None:   # a real id of the tokenizer: the model's table is too small
            why = ("the tokenizer's vocabulary, recorded in " + str(meta_file)) if known is recorded else \
                f"the vocabulary of {known.label}"
            problems.append(f"{ds.bin_path} holds token id {high} but {what}={vocab_size}: set {what} to at "
                            f"least {known.size} ({why}), or preprocess the data with the tokenizer the model "
                            f"is meant for.")
        else:
            problems.append(_unexplained_ids(ds, high, vocab_size, what, tokenizer_option))
    info = {"min": low, "max": high, "source": source, "vocab_size": known_vocab,
            "meta": meta if matches else None}
    return info, problems


def _impossible_ids(ds: IndexedDataset, high: int, known: KnownTokenizer, recorded: KnownTokenizer | None,
                    option: str, what: str) -> str:
    """Ids at or above the tokenizer's size: no text it encodes gives them."""
    found = _describe_ids_at_or_above(ds, known.size)
    other = (f" (its sidecar records {recorded.path or 'a tokenizer'} of {recorded.size:,} tokens)"
             if recorded is not None and recorded.size != known.size else "")
    remake = f"data_tools.preprocess --tokenizer {known.path}" if known.path else "data_tools.preprocess"
    # (said to training, not to inspect --check, which is that command)
    inspect = "" if option.startswith("--") else f" (python -m data_tools.inspect {ds.prefix} --check shows its ids)"
    return (f"{ds.bin_path} holds token ids that {known.label} cannot produce: it has {known.size:,} tokens "
            f"(ids 0..{known.size - 1:,}), and {found or f'the largest id is {high:,}'}. Either the data was made "
            f"with another tokenizer{other}: set {option} to the tokenizer that made it, or preprocess the text "
            f"again with this one ({remake}); or the .bin is damaged: re-create it, or restore it from the "
            f"original copy{inspect}. A larger {what} would not help: it would train on ids no text makes with "
            f"this tokenizer.")


def _unexplained_ids(ds: IndexedDataset, high: int, vocab_size: int, what: str, option: str) -> str:
    """Ids at or above the model's vocabulary, with no tokenizer known to tell real ids from damage."""
    found = _describe_ids_at_or_above(ds, vocab_size)
    return (f"{ds.bin_path} holds token id {high} but {what}={vocab_size}: {found or 'it is the largest'}. No "
            f"tokenizer is known to tell whether such ids are real ({option} is not given, and "
            f"{meta_path(ds.prefix)} does not exist or records none): either the data was made with a tokenizer "
            f"of more than {vocab_size:,} tokens, then set {option} to it (its size is checked against the ids "
            f"and {what}); or the .bin is damaged, then re-create it with data_tools.preprocess or restore it "
            f"from the original copy. Set {what} to at least {high + 1} (the largest id in the data + 1) only "
            f"when the tokenizer that made the data has that many tokens: otherwise the model trains on ids no "
            f"text makes.")


def check_token_ids(prefix, vocab_size: int, scan_cache=None, tokenizer: KnownTokenizer | None = None) -> dict:
    """Make sure every token id of the dataset at `prefix` fits a model vocabulary of
    `vocab_size` and the tokenizer that made it (`tokenizer`, else the one its sidecar records),
    and none is negative, before training on it; cheap when the `.meta.json`
    sidecar matches the pair, else one bounded-memory scan of the .bin (remembered in
    `scan_cache` for the next launch). Raises IndexedDatasetError naming the file, the value and
    the fix; returns {"min", "max", "source" ("sidecar", "scan" or "scan cache"), "vocab_size"
    (recorded, or None), "meta"}."""
    ds = IndexedDataset(prefix)
    info, problems = token_id_report(ds, vocab_size, scan_cache=scan_cache, tokenizer=tokenizer)
    if problems:
        raise IndexedDatasetError(problems[0])
    return info
