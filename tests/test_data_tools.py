"""data_tools: preprocessing into Megatron .bin/.idx, the byte layout, bad input, the CLIs."""
import gzip
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from data_tools import inspect as inspect_tool
from data_tools import merge as merge_tool
from data_tools import train_tokenizer
from data_tools.preprocess import main as preprocess_main
from megatron_id.data.indexed_dataset import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, best_dtype

DATA = ROOT / "tests" / "data"
FINEWEB = DATA / "fineweb-edu-sample-150.jsonl"
GPT2 = DATA / "gpt2-tokenizer.json"
EOD = 50256


def preprocess(tmp_path, inputs, name="out", *extra):
    prefix = tmp_path / name
    code = preprocess_main(["--input", *map(str, inputs), "--tokenizer", str(GPT2),
                            "--output-prefix", str(prefix), "--append-eod", "--no-progress", *extra])
    return code, Path(f"{prefix}_text_document")


def texts_of(path):
    return [json.loads(line)["text"] for line in open(path, encoding="utf-8")]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(GPT2))


def test_fineweb_round_trip_and_worker_independence(tmp_path, tokenizer, capsys):
    code, prefix = preprocess(tmp_path, [FINEWEB], "one", "--workers", "1")
    assert code == 0
    summary = capsys.readouterr().err
    assert "documents read: 150" in summary and "documents written: 150" in summary
    ds = IndexedDataset(prefix)
    assert len(ds) == 150 and ds.dtype == np.uint16
    for text, i in zip(texts_of(FINEWEB), range(len(ds))):
        ids = ds[i].tolist()
        assert ids[-1] == EOD
        assert tokenizer.decode(ids[:-1]) == text
    _, prefix2 = preprocess(tmp_path, [FINEWEB], "two", "--workers", "2")
    for ext in (".bin", ".idx"):
        assert Path(f"{prefix}{ext}").read_bytes() == Path(f"{prefix2}{ext}").read_bytes()


def test_hand_built_file_in_the_documented_layout_reads_back(tmp_path):
    seqs = [[5, 6, 7], [], [65000, 1]]
    lengths = [len(s) for s in seqs]
    pointers = [0, 6, 6]   # byte offsets, uint16
    idx = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, 3, 4)
    idx += struct.pack("<3i", *lengths) + struct.pack("<3q", *pointers) + struct.pack("<4q", 0, 1, 2, 3)
    (tmp_path / "hand.idx").write_bytes(idx)
    (tmp_path / "hand.bin").write_bytes(np.array([5, 6, 7, 65000, 1], dtype="<u2").tobytes())
    ds = IndexedDataset(tmp_path / "hand")
    assert [ds[i].tolist() for i in range(3)] == seqs and ds.dtype == np.uint16
    assert ds.document_index.tolist() == [0, 1, 2, 3] and ds.check() == []


@pytest.mark.parametrize("vocab,code,itemsize", [(50257, 8, 2), (65499, 8, 2), (65500, 4, 4), (128256, 4, 4)])
def test_writer_output_field_by_field(tmp_path, vocab, code, itemsize):
    seqs = [np.array([1, 2, 3]), np.array([4]), np.array([], dtype=np.int64), np.array([vocab - 1, 0])]
    with IndexedDatasetWriter(tmp_path / "w", best_dtype(vocab)) as w:
        for s in seqs:
            w.add(s)
    raw = (tmp_path / "w.idx").read_bytes()
    magic, version, dtype_code, n, n_docs = struct.unpack_from("<9sQBQQ", raw, 0)
    assert (magic, version, dtype_code, n, n_docs) == (b"MMIDIDX\x00\x00", 1, code, 4, 5)
    assert list(struct.unpack_from("<4i", raw, 34)) == [3, 1, 0, 2]
    assert list(struct.unpack_from("<4q", raw, 34 + 16)) == [0, 3 * itemsize, 4 * itemsize, 4 * itemsize]
    assert list(struct.unpack_from("<5q", raw, 34 + 48)) == [0, 1, 2, 3, 4]
    assert len(raw) == 34 + 12 * 4 + 8 * 5
    body = np.frombuffer((tmp_path / "w.bin").read_bytes(), dtype="<u2" if itemsize == 2 else "<i4")
    assert body.tolist() == [1, 2, 3, 4, vocab - 1, 0]


def write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else line.encode() + b"\n")


BAD_LINES = [
    json.dumps({"text": "A good first document."}),
    "{not json",
    b"\xff\xfe not utf-8\n",
    json.dumps({"body": "no text key"}),
    json.dumps({"text": "   "}),
    json.dumps(["a", "list"]),
    json.dumps({"text": 42}),
    json.dumps({"text": "The last good document."}),
]


def test_bad_lines_are_skipped_and_counted(tmp_path, capsys, tokenizer):
    src = tmp_path / "bad.jsonl"
    write_lines(src, BAD_LINES)
    code, prefix = preprocess(tmp_path, [src])
    assert code == 0
    err = capsys.readouterr().err
    assert "documents read: 8" in err and "documents written: 2" in err and "documents skipped: 6" in err
    for reason in ("malformed JSON", "not UTF-8", "missing key 'text'", "empty document",
                   "not a JSON object", "key 'text' is not a string"):
        assert f"1 {reason}" in err, reason
    ds = IndexedDataset(prefix)
    assert tokenizer.decode(ds[1].tolist()[:-1]) == "The last good document."


def test_strict_names_file_and_line_and_leaves_no_output(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    write_lines(src, BAD_LINES)
    out = tmp_path / "out"
    out.mkdir()
    code = preprocess_main(["--input", str(src), "--tokenizer", str(GPT2), "--output-prefix",
                            str(out / "x"), "--strict", "--no-progress"])
    assert code == 2
    assert f"{src}:2: malformed JSON" in capsys.readouterr().err
    assert list(out.iterdir()) == []   # no partial .bin/.idx, no temporary files


def test_wrong_tokenizer_fails_before_any_work(tmp_path, capsys):
    code = preprocess_main(["--input", str(FINEWEB), "--tokenizer", str(tmp_path / "nope.json"),
                            "--output-prefix", str(tmp_path / "out" / "x")])
    assert code == 2
    assert f"tokenizer file not found: {tmp_path / 'nope.json'}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    code = preprocess_main(["--input", str(tmp_path / "missing-*.jsonl"), "--tokenizer", str(GPT2),
                            "--output-prefix", str(tmp_path / "x")])
    assert code == 2 and "matches no file" in capsys.readouterr().err


def test_fineweb_filters_apply_when_fields_exist(tmp_path, capsys):
    rows = [dict(text="keep: all good", int_score=4, score=3.9, language="en", language_score=0.95),
            dict(text="drop: int score", int_score=2, score=2.2, language="en", language_score=0.95),
            dict(text="drop: score", int_score=3, score=2.9, language="en", language_score=0.95),
            dict(text="drop: language", int_score=4, score=4.0, language="fr", language_score=0.95),
            dict(text="drop: language score", int_score=4, score=4.0, language="en", language_score=0.5),
            dict(text="keep: no fields at all")]
    src = tmp_path / "fw.jsonl"
    write_lines(src, [json.dumps(r) for r in rows])
    code, prefix = preprocess(tmp_path, [src], "f", "--min-int-score", "3", "--min-score", "3.0",
                              "--language", "en", "--min-language-score", "0.9")
    assert code == 0
    err = capsys.readouterr().err
    assert "documents written: 2" in err
    for why in ("int_score < 3", "score < 3.0", "language != en", "language_score < 0.9"):
        assert f"1 filtered: {why}" in err


def test_every_input_format_gives_the_same_tokens(tmp_path):
    rows = [json.loads(line) for line in open(FINEWEB, encoding="utf-8")][:40]
    jsonl = tmp_path / "a.jsonl"
    write_lines(jsonl, [json.dumps(r) for r in rows])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    import zstandard
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl.read_bytes()))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "e.parquet", row_group_size=7)
    import datasets
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf_folder"))
    outputs = {}
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.json", "e.parquet", "hf_folder"):
        code, prefix = preprocess(tmp_path, [tmp_path / name], "out_" + name.replace(".", "_"))
        assert code == 0, name
        outputs[name] = Path(f"{prefix}.bin").read_bytes()
    assert len(set(outputs.values())) == 1, {k: len(v) for k, v in outputs.items()}


def test_compressed_inputs_read_ahead_on_their_own_thread_lose_nothing(tmp_path):
    """.gz and .zst inputs are inflated by a thread of their own (readers._DecompressAhead) in 1 MiB
    chunks: a file of several chunks reads the same documents as its plain form, in order, and a
    file cut short in its middle is refused with the count of lines read before the cut, as it was
    when the reading thread inflated it itself."""
    import zstandard

    from data_tools.readers import InputError, Record, _DecompressAhead, iter_documents
    rng = np.random.RandomState(0)
    words = np.array([w for line in texts_of(FINEWEB)[:40] for w in line.split()])
    lines = [json.dumps({"text": " ".join(rng.choice(words, 300)), "n": i}) for i in range(2500)]
    plain = tmp_path / "a.jsonl"
    write_lines(plain, lines)
    raw = plain.read_bytes()
    assert len(raw) > 4 * _DecompressAhead.CHUNK   # several chunks, and more than the read-ahead holds
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    expected = [(r.line, r.data) for r in iter_documents([plain])]
    assert len(expected) == 2500
    for name in ("a.jsonl.gz", "a.jsonl.zst"):
        assert [(r.line, r.data) for r in iter_documents([tmp_path / name])] == expected, name
        data = (tmp_path / name).read_bytes()
        cut = tmp_path / ("cut." + name)
        cut.write_bytes(data[: len(data) // 2])
        read = []
        with pytest.raises(InputError, match=rf"{cut.name} is truncated: .* after ([\d,]+) complete lines") as err:
            read.extend(r for r in iter_documents([cut]) if isinstance(r, Record))
        after = int(re.search(r"after ([\d,]+) complete", str(err.value))[1].replace(",", ""))
        assert 500 < len(read) == after < 2500 and [r.data for r in read] == [row for _, row in expected[:after]]


def test_partitions_and_merge(tmp_path, capsys):
    rows = [json.loads(line) for line in open(FINEWEB, encoding="utf-8")]
    for i in range(3):
        write_lines(tmp_path / f"part{i}.jsonl", [json.dumps(r) for r in rows[i * 50:(i + 1) * 50]])
    inputs = [tmp_path / f"part{i}.jsonl" for i in range(3)]
    _, whole = preprocess(tmp_path, inputs, "whole")
    _, parted = preprocess(tmp_path, inputs, "parted", "--partitions", "3")
    a, b = IndexedDataset(whole), IndexedDataset(parted)
    # partitions interleave files round-robin; with 3 files and 3 parts the order is kept
    assert [x.tolist() for x in (a[i] for i in range(len(a)))] == [x.tolist() for x in (b[i] for i in range(len(b)))]
    assert [p.name for p in tmp_path.iterdir() if "_document_part" in p.name] == []   # parts removed
    # merge: concatenation, and a clear error for mixed dtypes
    assert merge_tool.main([str(tmp_path / "merged"), str(whole), str(parted)]) == 0
    m = IndexedDataset(tmp_path / "merged")
    assert len(m) == 300 and m[150].tolist() == a[0].tolist() and m.check() == []
    with IndexedDatasetWriter(tmp_path / "wide", np.int32) as w:
        w.add(np.array([1, 2]))
    assert merge_tool.main([str(tmp_path / "bad"), str(whole), str(tmp_path / "wide")]) == 2
    assert "different dtypes" in capsys.readouterr().err


def test_missing_truncated_and_corrupt_files_are_named(tmp_path, capsys):
    code, prefix = preprocess(tmp_path, [FINEWEB], "c")
    base = str(prefix)[: -len("_text_document")]
    assert IndexedDataset(base).prefix == prefix           # the suffix is optional
    assert IndexedDataset(f"{prefix}.bin").prefix == prefix
    with pytest.raises(IndexedDatasetError) as err:
        IndexedDataset(tmp_path / "nothing")
    assert f"{tmp_path / 'nothing'}.bin + {tmp_path / 'nothing'}.idx" in str(err.value)
    assert f"{tmp_path / 'nothing'}_text_document.bin" in str(err.value)
    binary = Path(f"{prefix}.bin").read_bytes()
    Path(f"{prefix}.bin").write_bytes(binary[:-10])
    with pytest.raises(IndexedDatasetError, match="truncated or mismatched"):
        IndexedDataset(prefix)
    Path(f"{prefix}.bin").write_bytes(binary)
    index = bytearray(Path(f"{prefix}.idx").read_bytes())
    Path(f"{prefix}.idx").write_bytes(index[:100])
    with pytest.raises(IndexedDatasetError, match="truncated or corrupt"):
        IndexedDataset(prefix)
    bad = bytearray(index)
    bad[0:3] = b"XXX"
    Path(f"{prefix}.idx").write_bytes(bad)
    with pytest.raises(IndexedDatasetError, match="not a Megatron index"):
        IndexedDataset(prefix)
    # a pointer that disagrees with the lengths passes the size checks; --check finds it
    bad = bytearray(index)
    struct.pack_into("<q", bad, 34 + 4 * 150 + 8 * 5, 12345)
    Path(f"{prefix}.idx").write_bytes(bad)
    assert inspect_tool.main([str(prefix), "--check"]) == 1
    assert "byte offsets disagree" in capsys.readouterr().err
    Path(f"{prefix}.idx").write_bytes(index)
    assert inspect_tool.main([str(prefix), "--check", "--doc", "3", "--tokenizer", str(GPT2)]) == 0
    out = capsys.readouterr().out
    assert "documents                               150" in out.replace("  ", "  ") or "150" in out
    assert "integrity: ok" in out and texts_of(FINEWEB)[3][:40] in out


def test_train_tokenizer_round_trips(tmp_path):
    out = tmp_path / "tok" / "tokenizer.json"
    assert train_tokenizer.main(["--input", str(DATA / "tinyshakespeare-200k.txt"),
                                 "--vocab-size", "600", "--output", str(out)]) == 0
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out))
    assert tok.get_vocab_size() == 600 and tok.token_to_id("<|endoftext|>") is not None
    text = "To be, or not to be: that is the question. Zebra quux!"
    assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode("the king").ids) < len("the king")   # it learned merges


def test_megatron_id_preprocess_entry_point_and_progress(tmp_path, capsys):
    from megatron_id.cli import main as cli_main
    code = cli_main(["preprocess", "--input", str(FINEWEB), "--tokenizer", str(GPT2),
                     "--output-prefix", str(tmp_path / "cli")])
    assert code == 0 and len(IndexedDataset(tmp_path / "cli_text_document")) == 150
    import io

    from data_tools.preprocess import Stats
    from data_tools.progress import Progress
    stream = io.StringIO()
    progress = Progress(total_bytes=1000, stream=stream)
    progress.every = 0
    stats = Stats()
    stats.written, stats.tokens = 10, 5000
    progress.update(stats, done_bytes=250)
    line = stream.getvalue()
    assert "10 docs (" in line and "5,000 tokens (" in line and "25.0% of input" in line and "ETA" in line


# ---------------------------------------------------------------- huge documents, in pieces

TRICKY = ("It's  two  spaces, a\ttab, ünïcödé, 日本語のテキスト, numbers 123 4567, <|endoftext|> inside, "
          "trailing   \n\n  indented lines\r\nand 'quotes' they'll've  ...  \u00a0nbsp end ")


def test_pieces_give_exactly_the_ids_of_the_whole_text(tokenizer):
    from data_tools.pieces import PieceCutter
    full = TRICKY.join(texts_of(FINEWEB)) + TRICKY
    whole_ids = {}
    for piece_chars, text in ((7, full[:30_000]), (1000, full), (20_000, full)):   # 7: nearly every word
        if len(text) not in whole_ids:
            whole_ids[len(text)] = tokenizer.encode(text, add_special_tokens=False).ids
        whole = whole_ids[len(text)]
        cutter = PieceCutter(tokenizer, piece_chars)
        pieces = cutter.split(text)
        assert "".join(pieces) == text
        assert len(pieces) > len(text) // (piece_chars * 2)
        assert piece_chars < 1000 or max(map(len, pieces)) <= piece_chars
        ids = [i for e in tokenizer.encode_batch_fast(pieces, add_special_tokens=False) for i in e.ids]
        assert ids == whole, piece_chars


def test_a_cut_that_would_change_the_ids_is_not_used(tokenizer):
    """A normalizer that prepends to every input makes every cut unsafe: the verification
    rejects them all and the text is tokenised whole."""
    from tokenizers import Tokenizer, normalizers

    from data_tools.pieces import PieceCutter
    prepending = Tokenizer.from_str(tokenizer.to_str())
    prepending.normalizer = normalizers.Prepend("Q")
    text = " ".join(texts_of(FINEWEB)[:5])
    cutter = PieceCutter(prepending, 500)
    assert cutter.split(text) == [text] and cutter.uncut_documents == 1
    plain = PieceCutter(tokenizer, 500)
    assert len(plain.split(text)) > 10 and plain.uncut_documents == 0


def test_preprocessing_in_pieces_writes_the_same_bytes(tmp_path, fineweb_prefix, monkeypatch, capsys):
    import data_tools.preprocess as pre
    monkeypatch.setattr(pre, "PIECE_CHARS", 300)   # every sample document is cut, many times
    monkeypatch.setattr(pre, "BATCH_CHARS", 5_000)   # and its pieces spread over encode calls
    code, prefix = preprocess(tmp_path, [FINEWEB], "pieces")
    assert code == 0
    assert "documents longer than 300 characters, tokenised in pieces: 150" in capsys.readouterr().err
    for ext in (".bin", ".idx"):
        assert Path(f"{prefix}{ext}").read_bytes() == Path(f"{fineweb_prefix}{ext}").read_bytes()


# Peak RSS from /proc (VmHWM): getrusage's ru_maxrss survives exec, so a child started from
# this big pytest process would report at least the parent's size.
MEASURE = """
import re, sys
sys.path.insert(0, {root!r})
from data_tools.preprocess import main
code = main({argv!r})
status = open("/proc/self/status").read()
print(code, int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024)
"""


def test_one_huge_document_keeps_memory_bounded(tmp_path, tokenizer):
    """An 8 MB single document: tokenised whole it takes ~1 GB inside `tokenizers` (5 GB at
    50 MB, see benchmarks/huge_document.py); in pieces the whole run stays under 450 MB."""
    import subprocess
    import sys
    text = "\n\n".join(texts_of(FINEWEB))
    text = (text * (8_000_000 // len(text) + 1))[:8_000_000]
    src = tmp_path / "huge.jsonl"
    src.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    argv = ["--input", str(src), "--tokenizer", str(GPT2), "--output-prefix", str(tmp_path / "huge"),
            "--no-progress", "--workers", "2"]
    done = subprocess.run([sys.executable, "-c", MEASURE.format(root=str(ROOT), argv=argv)],
                          capture_output=True, text=True, timeout=300)
    code, peak = map(int, done.stdout.split())
    assert code == 0, done.stderr
    assert peak < 450 * 2**20, f"peak RSS {peak / 2**20:.0f} MiB"
    ds = IndexedDataset(tmp_path / "huge")
    assert len(ds) == 1 and tokenizer.decode(ds[0].tolist()) == text
