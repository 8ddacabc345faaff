"""Input documents from jsonl (plain, .gz, .zst), json, parquet and local Hugging Face dataset
folders, streamed with bounded memory. Every record comes with where it came from, and every
unreadable one comes back as a Skip with its reason instead of being dropped silently. A file
that cannot be read on at all (a truncated or corrupt .gz/.zst, a broken parquet file) raises
InputError naming the file and how far it got: its last line would otherwise pass for one
malformed document and the rest of the file would be lost without a word."""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
import queue
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from megatron_id.errors import UserError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst",
                  ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
PARQUET_BATCH_ROWS = 256   # rows turned into Python objects at a time


@dataclass
class Record:
    source: str
    line: int          # 1-based line (jsonl) or row (parquet, datasets)
    data: dict


@dataclass
class Skip:
    source: str
    line: int
    reason: str
    # a line that is not UTF-8 but reads as a JSON object in an 8-bit encoding: (iconv's name of
    # that encoding, a few words around its first non-ASCII letter read that way)
    legacy: tuple[str, str] | None = None


class InputError(UserError, ValueError):
    pass


TEXT_SUFFIXES = (".txt", ".md", ".raw")


def expand_inputs(patterns, allow_text: bool = False, notes: list | None = None) -> list[Path]:
    """Files, globs and dataset folders, in a stable order; a pattern matching nothing is an error.
    allow_text also admits plain text files (for tokenizer training).

    Each file is listed once, however many patterns reach it (the same path twice, a file and
    its folder, overlapping globs, a symlink): later occurrences are dropped. Inside a folder and
    among a glob's matches, files that are never documents (our .meta.json sidecars, tokenizer
    and model config files, a pretty-printed single JSON object) are skipped, so a run whose
    --output-prefix lies inside its input folder does not read the previous run's outputs. A
    file named on its own is read as asked. `notes` receives one line per kind of file dropped,
    with the count."""
    files, seen, skipped, seen_skipped = [], {}, [], set()
    duplicates: dict[Path, int] = {}
    for pattern in patterns:
        magic = glob.has_magic(str(pattern))
        matches = sorted(glob.glob(str(pattern), recursive=True)) if magic \
            else ([str(pattern)] if os.path.exists(pattern) else [])
        if not matches:
            raise InputError(f"input '{pattern}' matches no file or folder.")
        found, dropped = [], []
        for m in matches:
            path = Path(m)
            if path.is_dir() and not is_hf_dataset_folder(path):
                inner = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p))
                if not inner:
                    raise InputError(f"folder '{path}' holds no .jsonl/.json/.parquet files and is "
                                     f"not a saved Hugging Face dataset.")
                for p in inner:
                    why = not_a_document(p)
                    if why:
                        dropped.append((p, why))
                    else:
                        found.append(p)
            elif path.is_dir() or _kind(path) or (allow_text and path.name.lower().endswith(TEXT_SUFFIXES)):
                why = not_a_document(path) if magic and path.is_file() else None
                if why:
                    dropped.append((path, why))
                else:
                    found.append(path)
            else:
                raise InputError(f"input '{path}' has an unsupported type; use .jsonl, .jsonl.gz, "
                                 f".jsonl.zst, .json, .parquet or a Hugging Face dataset folder.")
        if not found:
            raise InputError(f"input '{pattern}' holds no document file: only {_listed(dropped)}. "
                             f"Name the data files (.jsonl, .json, .parquet) with --input.")
        for path, why in dropped:   # counted once, however many patterns reach it
            if _file_key(path) not in seen_skipped:
                seen_skipped.add(_file_key(path))
                skipped.append((path, why))
        for path in found:
            key = _file_key(path)
            if key in seen:
                duplicates[seen[key]] = duplicates.get(seen[key], 1) + 1
                continue
            seen[key] = path
            files.append(path)
    if notes is not None:
        # Duplicates are dropped with a note rather than refused: overlapping globs and a folder
        # named beside one of its files are ordinary ways to name a set of inputs, and nobody
        # means a file to be tokenised twice (weights belong to the blend, --data-path w1 p1 ...).
        n = sum(duplicates.values()) - len(duplicates)
        if n:
            shown = ", ".join(f"{p} (given {k} times)" for p, k in list(duplicates.items())[:3])
            notes.append(f"{n} duplicate input{'s' if n > 1 else ''} dropped, each file is read once: "
                         f"{shown}{', ...' if len(duplicates) > 3 else ''}.")
        if skipped:
            n = len(skipped)
            notes.append(f"{n} file{'s' if n > 1 else ''} in the input folders or globs skipped, not "
                         f"documents: {_listed(skipped)}.")
    return files


def _file_key(path: Path):
    """What tells two names of one file apart from two files: (device, inode) when it exists."""
    try:
        st = path.stat()
        return st.st_dev, st.st_ino
    except OSError:
        return str(path.resolve())


def _listed(dropped) -> str:
    return ", ".join(f"{p} ({why})" for p, why in dropped[:3]) + (", ..." if len(dropped) > 3 else "")


# Files that sit beside datasets and models and are never documents
NOT_DOCUMENT_NAMES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                      "added_tokens.json", "config.json", "generation_config.json"}
BOM = b"\xef\xbb\xbf"   # a UTF-8 byte order mark (Windows editors write one): not part of the text


def not_a_document(path: Path) -> str | None:
    """Why a file found in an input folder or by a glob is not a document file (None: it may be)."""
    name = path.name.lower()
    if name.endswith(".meta.json"):
        try:
            if path.stat().st_size < 1 << 20 and \
                    str(json.loads(path.read_bytes()).get("format", "")).startswith("megatron_id.dataset_meta"):
                return "a dataset sidecar"
        except (OSError, ValueError, AttributeError):
            pass
    if name in NOT_DOCUMENT_NAMES:
        return "a tokenizer or model config file"
    if name.endswith(".json"):
        try:
            with open(path, "rb") as f:
                head = f.read(4096)
        except OSError:
            return None
        head = head.removeprefix(BOM).lstrip()
        if head.startswith(b"{") and head.split(b"\n", 1)[0].strip() == b"{":
            return "one pretty-printed JSON object, not JSON lines"
    return None


# ---------------------------------------------------------------- encodings other than UTF-8

LEGACY_NAMES = {"latin1": "Latin-1 (ISO-8859-1)", "cp1252": "Windows-1252 (cp1252, Latin-1 with quotes and dashes)"}


def legacy_encoding(raw: bytes, array: bool = False) -> tuple[str, str] | None:
    """(iconv name, excerpt) when bytes that are not UTF-8 read as a JSON object (`array`: a
    JSON array) in an 8-bit Latin encoding: JSON's own characters are ASCII, so a document written
    in Latin-1 or cp1252 fails only on its accented letters. cp1252 when the bytes use 0x80-0x9f,
    which it gives quotes, dashes and the euro sign (in Latin-1 they are control codes), else
    Latin-1 (the two agree on every other byte). None for bytes that do not read as JSON either
    (damage, binary): those stay ordinary bad lines."""
    c1 = any(0x80 <= b <= 0x9f for b in raw)
    encoding = "cp1252" if c1 else "latin1"
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError:   # bytes cp1252 leaves undefined (0x81, 0x8d, ...): Latin-1's control codes
        encoding, text = "latin1", raw.decode("latin1")
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list if array else dict):
        return None
    return encoding, _excerpt(value) or _excerpt(text)


def _excerpt(value) -> str | None:
    """A few words around the first non-ASCII character of the first string in `value` (a
    string, or the strings of a JSON value) that has one."""
    if isinstance(value, str):
        at = next((k for k, ch in enumerate(value) if ord(ch) > 127), None)
        if at is None:
            return None
        start = value.rfind(" ", 0, max(0, at - 20)) + 1
        return " ".join(value[start:start + 60].split())
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((found for item in items for found in [_excerpt(item)] if found), None)


def converted_name(path: Path) -> Path:
    """a.jsonl -> a.utf8.jsonl, b.jsonl.gz -> b.utf8.jsonl.gz: where the converted copy goes."""
    name = path.name
    suffix = next((s for s in sorted(JSONL_SUFFIXES, key=len, reverse=True) if name.lower().endswith(s)), "")
    stem = name[: len(name) - len(suffix)] if suffix else name
    return path.with_name(f"{stem}.utf8{suffix or '.jsonl'}")


def iconv_command(path: Path, encoding: str) -> str:
    """The shell line that writes a UTF-8 copy of `path` (compressed inputs through their tool)."""
    out = converted_name(path)
    convert = f"iconv -f {encoding} -t utf-8"
    name = path.name.lower()
    if name.endswith(".gz"):
        return f"gzip -dc {path} | {convert} | gzip > {out}"
    if name.endswith(".zst"):
        return f"zstd -dc {path} | {convert} | zstd > {out}"
    return f"{convert} {path} > {out}"


def legacy_advice(path: Path, encoding: str, excerpt: str) -> str:
    """What a file in an 8-bit Latin encoding reads as, and the conversion."""
    return (f"it reads as {LEGACY_NAMES[encoding]} text ('{excerpt}' read that way). Convert it: "
            f"{iconv_command(Path(path), encoding)}, and give {converted_name(Path(path))} to --input (if the "
            f"excerpt reads wrong, the file is in another encoding: name that one to iconv -f)")


UTF16_MARKS = [(b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
               (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16")]
COMPRESSION_MAGIC = {".gz": (b"\x1f\x8b", "gzip"), ".zst": (b"\x28\xb5\x2f\xfd", "zstd")}


def check_input_files(files) -> None:
    """Before any work, refuse JSON-lines inputs that could not yield one document: a .gz/.zst
    that is not compressed that way, and UTF-16/UTF-32 text (every line would be skipped as
    malformed; with other inputs the run would end with exit 0 and the file's documents gone).
    Each is one InputError naming the file and the conversion. Costs one small read per file."""
    for path in map(Path, files):
        if not path.is_file() or _kind(path) != "jsonl":
            continue
        name = path.name.lower()
        for suffix, (magic, tool) in COMPRESSION_MAGIC.items():
            if name.endswith(suffix):
                with open(path, "rb") as f:
                    head = f.read(len(magic))
                if head and head != magic:
                    plain = head.lstrip()[:1] in (b"{", b"[")
                    raise InputError(
                        f"input {path} is named {suffix} but is not {tool}-compressed (it starts with {head!r}"
                        f"{': plain JSON text' if plain else ''}). Rename it to what it is"
                        f"{f' (e.g. {path.name[: -len(suffix)]})' if plain else ''}, or compress it with {tool}.")
        counter: list = []
        try:
            with _open_binary(path, counter) as f:
                head = f.read(64)
        except _stream_errors():
            continue   # read again in the run, which names how far it got
        for mark, encoding in UTF16_MARKS:
            if head.startswith(mark):
                raise InputError(f"input {path} is {encoding.upper()} text (it starts with a byte-order mark), not "
                                 f"UTF-8: no line of it can be read. Convert it: {iconv_command(path, encoding)}, "
                                 f"and give {converted_name(path)} to --input.")
        if b"\x00" in head:   # ASCII in UTF-16 without a mark: every other byte is zero
            encoding = "utf-16le" if head[1::2].count(0) > len(head) // 4 else "utf-16be"
            raise InputError(f"input {path} holds zero bytes (UTF-16 text without a byte-order mark?), not UTF-8 "
                             f"JSON lines: no line of it can be read. If it is UTF-16, convert it: "
                             f"{iconv_command(path, encoding)}, and give {converted_name(path)} to --input.")


def is_hf_dataset_folder(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() \
        or (path / "state.json").is_file()


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


class _CountingReader(io.RawIOBase):
    """Wraps a binary file and counts bytes read from the disk (for progress on compressed input)."""

    def __init__(self, f):
        self.f, self.count = f, 0

    def readable(self):
        return True

    def readinto(self, b):
        n = self.f.readinto(b)
        self.count += n or 0
        return n


class TruncatedInput(EOFError):
    """A compressed stream that ends inside a frame."""


class _ZstdReader(io.RawIOBase):
    """Decompresses one or more concatenated zstd frames and, unlike zstandard's stream_reader
    (which just stops), raises TruncatedInput when the file ends inside a frame."""

    def __init__(self, f):
        import zstandard
        self.f, self._zstd = f, zstandard
        self._frame = None          # the decompressor of the frame being read, None between frames
        self._out, self._pos = b"", 0

    def readable(self):
        return True

    def _fill(self) -> bool:
        while self._pos >= len(self._out):
            data = self.f.read(1 << 16)
            if not data:
                if self._frame is not None:
                    raise TruncatedInput("the zstd stream ends inside a frame")
                return False
            chunks = []
            while data:
                if self._frame is None:
                    self._frame = self._zstd.ZstdDecompressor().decompressobj()
                chunks.append(self._frame.decompress(data))
                if self._frame.eof:   # a frame ended: what follows starts the next frame
                    data, self._frame = self._frame.unused_data, None
                else:
                    data = b""
            self._out, self._pos = b"".join(chunks), 0
        return True

    def readinto(self, b):
        if not self._fill():
            return 0
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n


class _DecompressAhead(io.RawIOBase):
    """Reads a decompressing stream on a thread of its own, DECOMPRESS_AHEAD chunks ahead: zlib
    and zstd release the GIL while they inflate, so decompression overlaps the JSON parsing of
    the reader's thread instead of taking turns with it (measured 2026-12-08 on 100 MB of
    Wikipedia JSONL: gzip's inflate alone is 0.48 s, zstd's 0.20 s, json.loads 0.57 s). The
    stream's errors (a truncated or corrupt file) are raised here, in the reading thread."""

    CHUNK = 1 << 20

    def __init__(self, stream):
        self.stream = stream
        self._chunks = queue.Queue(maxsize=DECOMPRESS_AHEAD)
        self._stop = threading.Event()
        self._out, self._pos, self._done = b"", 0, False
        self._thread = threading.Thread(target=self._run, daemon=True, name="decompress")
        self._thread.start()

    def _run(self):
        try:
            while not self._stop.is_set():
                data = self.stream.read(self.CHUNK)
                if not self._hand(data or None) or not data:
                    return
        except BaseException as err:   # raised by readinto, in the reading thread
            self._hand(err)

    def _hand(self, item) -> bool:
        """Queue one item; False once the reader has closed the stream."""
        while not self._stop.is_set():
            try:
                self._chunks.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def readable(self):
        return True

    def readinto(self, b):
        while self._pos >= len(self._out):
            if self._done:
                return 0
            item = self._chunks.get()
            if item is None:
                self._done = True
                return 0
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._out, self._pos = item, 0
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self):
        if not self.closed:
            self._stop.set()
            self._thread.join(timeout=5)
            self.stream.close()
        super().close()


DECOMPRESS_AHEAD = 4   # decompressed chunks (1 MiB each) held ahead of the parser


def _open_binary(path: Path, counter: list):
    raw = _CountingReader(open(path, "rb"))
    counter.append(raw)
    name = path.name.lower()
    if name.endswith(".gz"):
        return io.BufferedReader(_DecompressAhead(gzip.GzipFile(fileobj=io.BufferedReader(raw))))
    if name.endswith(".zst"):
        return io.BufferedReader(_DecompressAhead(io.BufferedReader(_ZstdReader(io.BufferedReader(raw)))))
    return io.BufferedReader(raw)


def _stream_errors():
    """The exceptions of a compressed stream that cannot be read on."""
    errors = [EOFError, zlib.error, gzip.BadGzipFile]
    try:
        import zstandard
        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def _unreadable(path: Path, counter: list, lines: int, err: Exception) -> InputError:
    size = path.stat().st_size
    reached = counter[-1].count if counter else 0
    if isinstance(err, EOFError):
        what = (f"is truncated: its compressed stream ends at byte {reached:,} of {size:,} before "
                f"its end marker ({err})")
        fix = "Re-download or re-create the file (compare its checksum)."
    else:
        what = f"cannot be decompressed at compressed byte {reached:,} of {size:,} ({err})"
        fix = "Check that it is a complete file of the type its name says."
    return InputError(f"input {path} {what}, after {lines:,} complete line{'' if lines == 1 else 's'}. {fix}")


def _iter_jsonl(path: Path, counter: list):
    lines = [0]
    try:
        yield from _iter_jsonl_lines(path, counter, lines)
    except _stream_errors() as err:
        raise _unreadable(path, counter, lines[0], err) from None


def _iter_jsonl_lines(path: Path, counter: list, lines: list):
    with _open_binary(path, counter) as f:
        first = f.peek(64)[:64].removeprefix(BOM).lstrip() if hasattr(f, "peek") else b""
        if first.startswith(b"["):   # a JSON array file: loaded whole (jsonl streams)
            # one unreadable array loses every document of the file: an error, not one skipped line
            data = f.read().removeprefix(BOM)
            try:
                rows = json.loads(data.decode("utf-8"))
            except UnicodeDecodeError as err:
                legacy = legacy_encoding(data, array=True)
                raise InputError(f"input {path} is a JSON array that is not UTF-8 ({err}), so none of its documents "
                                 f"can be read" + (f": {legacy_advice(path, *legacy)}" if legacy else
                                                   ". Save it as UTF-8 (iconv -f <its encoding> -t utf-8).")) from None
            except json.JSONDecodeError as err:
                raise InputError(f"input {path} starts a JSON array but is not valid JSON ({err}), so none of its "
                                 f"documents can be read: the file is cut short or damaged. Re-create it, or write "
                                 f"it as JSON lines (one object per line: a bad line then costs one document).") \
                    from None
            for i, row in enumerate(rows, start=1):
                yield Record(str(path), i, row) if isinstance(row, dict) else \
                    Skip(str(path), i, "not a JSON object")
            return
        for i, raw in enumerate(f, start=1):
            lines[0] = i
            # every line, not only the first: files saved by Windows editors and joined with cat
            # keep their marks at the start of the lines where each file began
            raw = raw.removeprefix(BOM)
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield Skip(str(path), i, "not UTF-8", legacy_encoding(raw))
                continue
            del raw   # one huge line: keep only one copy of it alive at a time
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                yield Skip(str(path), i, "malformed JSON")
                continue
            del line
            yield Record(str(path), i, row) if isinstance(row, dict) else \
                Skip(str(path), i, "not a JSON object")


def _iter_parquet(path: Path, counter: list, columns):
    import pyarrow as pa
    try:
        yield from _iter_parquet_rows(path, counter, columns)
    except pa.ArrowException as err:
        raise InputError(f"input {path} is not a readable parquet file ({err}). Check that it is "
                         f"complete (re-download it) or convert it to jsonl.") from None


def _iter_parquet_rows(path: Path, counter: list, columns):
    import pyarrow as pa
    import pyarrow.parquet as pq
    # Measured 2026-12-08, preprocessing a 100 MB Wikipedia parquet file (1,000-row groups):
    # - pages read as they are decoded (pre_buffer off, a 1 MiB read buffer), in batches of
    #   PARQUET_BATCH_ROWS rows: whole row groups, pre-buffered, peaked at 427 MiB, now 355;
    # - Arrow's buffers from the system allocator: its default pool (mimalloc) kept what the
    #   decoded batches had freed: 313 MiB and 2.6 s instead of 355 MiB and 3.3 s.
    # (pyarrow's import alone is ~57 MiB; the same corpus as JSONL peaks at 231 MiB)
    pa.set_memory_pool(pa.system_memory_pool())
    f = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    names = set(f.schema_arrow.names)
    wanted = [c for c in columns if c in names] or None
    raw = _CountingReader(open(path, "rb"))   # parquet reads the file itself; counted by rows read
    counter.append(raw)
    row, total = 0, max(1, f.metadata.num_rows)
    size = path.stat().st_size
    for batch in f.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=wanted, use_threads=False):
        for item in batch.to_pylist():
            row += 1
            yield Record(str(path), row, item)
        raw.count = int(size * row / total)


def _iter_hf_folder(path: Path, counter: list):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets
    loaded = datasets.load_from_disk(str(path))
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    for split, ds in splits:
        source = f"{path}[{split}]" if split else str(path)
        for i, item in enumerate(ds, start=1):
            yield Record(source, i, item)


def iter_documents(files, columns=("text",), counter: list | None = None):
    """Records and Skips from every input in order. `counter` collects byte counters for progress."""
    counter = counter if counter is not None else []
    for path in files:
        path = Path(path)
        if path.is_dir():
            yield from _iter_hf_folder(path, counter)
        elif _kind(path) == "parquet":
            yield from _iter_parquet(path, counter, columns)
        else:
            yield from _iter_jsonl(path, counter)
