"""The data tools never lose data or write garbage silently (issue 10).

Every careless command is refused with one line naming the file or value and the fix, and leaves
every file it could have touched byte-identical with nothing added (`refused`, from
tests/bad_inputs.py): the good earlier output beside it stays as it was and no partial or
temporary file is left. Then the positive side: --overwrite replaces atomically, temporary
files of killed runs are cleaned up, and token ids that do not fit the model's vocabulary are
found before training, from the .meta.json sidecar or by scanning the .bin.
"""
import gzip
import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from bad_inputs import refused, run_module
from conftest import ROOT

from megatron_id.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    check_token_ids,
    meta_path,
    scan_token_range,
)
from megatron_id.data.tokenizer import identity_of_file

DATA = ROOT / "tests" / "data"
FINEWEB = DATA / "fineweb-edu-sample-150.jsonl"
GPT2 = DATA / "gpt2-tokenizer.json"
PRE, MERGE, INSPECT, TRAIN_TOK = ("data_tools.preprocess", "data_tools.merge", "data_tools.inspect",
                                  "data_tools.train_tokenizer")
EXTS = (".bin", ".idx", ".meta.json")


def rows(n=20):
    return [json.loads(line) for line in open(FINEWEB, encoding="utf-8")][:n]


def jsonl_bytes(items) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in items)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Bad (and a few good) input files, made once; the commands only read them."""
    folder = tmp_path_factory.mktemp("inputs")
    good = jsonl_bytes(rows())
    (folder / "good.jsonl").write_bytes(good)
    (folder / "empty.jsonl").write_bytes(b"")
    (folder / "garbage.jsonl").write_bytes(np.random.RandomState(0).bytes(20_000))
    (folder / "nokey.jsonl").write_bytes(jsonl_bytes({"body": r["text"], "id": r["id"]} for r in rows()))
    (folder / "trunc.jsonl.gz").write_bytes(gzip.compress(good)[:3000])
    import zstandard
    stream = zstandard.ZstdCompressor().compressobj()
    whole = stream.compress(good * 4) + stream.flush()
    (folder / "trunc.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    (folder / "lang.jsonl").write_bytes(jsonl_bytes({**r, "language": "en"} for r in rows()))
    lines = good.splitlines(keepends=True)
    (folder / "bad.jsonl").write_bytes(lines[0] + b"{not json\n" + b"".join(lines[1:]))
    (folder / "corrupt.parquet").write_bytes(b"PAR1" + np.random.RandomState(1).bytes(500))
    (folder / "tokenizer.json").write_bytes(b'{"mine": "keep me"}')
    return folder


@pytest.fixture(scope="module")
def good_pair(fineweb_prefix):
    """The bundled sample preprocessed once (GPT-2, uint16, with its sidecar)."""
    return Path(fineweb_prefix)


def copy_pair(source: Path, folder: Path, name="out_text_document") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for ext in EXTS:
        shutil.copyfile(f"{source}{ext}", folder / f"{name}{ext}")
    return folder / name


def preprocess(inp, out, *extra):
    return [PRE, "--input", *([inp] if not isinstance(inp, list) else inp), "--tokenizer", GPT2,
            "--output-prefix", out, "--append-eod", "--no-progress", *extra]


def int32_pair(prefix):
    with IndexedDatasetWriter(prefix, np.int32) as w:
        w.add(np.array([1, 2, 3]))
    return prefix


def patch_dtype_code(prefix, code=3):
    """Rewrite byte 17 of the .idx (the dtype code): 3 = int16, over data written as uint16."""
    raw = bytearray(Path(f"{prefix}.idx").read_bytes())
    raw[17] = code
    Path(f"{prefix}.idx").write_bytes(raw)


# Each case: (tmp_path, inputs, good_pair) -> (command, regex for the last stderr line). The
# command's output goes to tmp_path/"data", which holds a good earlier pair `out_text_document`;
# everything under tmp_path (that pair, inputs, anything else) must stay byte-identical.
def case_empty_input(t, i, g):
    return preprocess(i / "empty.jsonl", t / "data/out", "--overwrite"), r"empty\.jsonl is empty \(0 bytes\)"


def case_binary_garbage(t, i, g):
    return preprocess(i / "garbage.jsonl", t / "data/out", "--overwrite"), \
        r"no document was written: all .* skipped \(.*not UTF-8.*JSON lines"


def case_no_row_has_the_key(t, i, g):
    return preprocess(i / "nokey.jsonl", t / "data/out", "--overwrite"), \
        r"20 missing key 'text'.*keys 'body', 'id': name the text field with --json-keys"


def case_truncated_gz(t, i, g):
    return preprocess(i / "trunc.jsonl.gz", t / "data/out", "--overwrite"), \
        r"trunc\.jsonl\.gz is truncated: its compressed stream ends at byte 3,000 of 3,000"


def case_truncated_zst(t, i, g):   # not "1 malformed JSON" for the cut last line
    return preprocess(i / "trunc.jsonl.zst", t / "data/out", "--overwrite"), \
        r"trunc\.jsonl\.zst is truncated: .* after [\d,]+ complete lines"


def case_corrupt_parquet(t, i, g):
    return preprocess(i / "corrupt.parquet", t / "data/out", "--overwrite"), \
        r"corrupt\.parquet is not a readable parquet file"


def case_language_filter_keeps_nothing(t, i, g):
    return preprocess(i / "lang.jsonl", t / "data/out", "--overwrite", "--language", "english"), \
        r"20 filtered: language != english.*Every row's language is 'en'"


def case_existing_output(t, i, g):
    return preprocess(i / "good.jsonl", t / "data/out"), \
        r"out_text_document\.bin, .*out_text_document\.idx already exist: pass --overwrite"


def case_strict_bad_line(t, i, g):
    return preprocess(i / "bad.jsonl", t / "data/out", "--overwrite", "--strict"), \
        r"bad\.jsonl:2: malformed JSON \(run without --strict"


def case_strict_fails_in_second_partition(t, i, g):   # the part files go too
    return preprocess([i / "good.jsonl", i / "bad.jsonl"], t / "data/out", "--overwrite", "--strict",
                      "--partitions", "2"), r"bad\.jsonl:2: malformed JSON"


def case_existing_output_with_partitions(t, i, g):
    return preprocess([i / "good.jsonl", i / "lang.jsonl"], t / "data/out", "--partitions", "2"), \
        r"already exist: pass --overwrite"


def case_negative_workers(t, i, g):
    return preprocess(i / "good.jsonl", t / "data/out", "--overwrite", "--workers", "-2"), \
        r"--workers -2: must be at least 1"


def case_output_prefix_below_a_file(t, i, g):
    (t / "notes.txt").write_text("a file, not a folder")
    return preprocess(i / "good.jsonl", t / "notes.txt" / "out"), r"notes\.txt is a file, not a folder"


def case_merge_into_existing_output(t, i, g):
    return [MERGE, t / "data/out_text_document", g], r"out_text_document\.bin, .* already exist: pass --overwrite"


def case_merge_mismatched_dtypes(t, i, g):
    int32_pair(t / "wide")
    return [MERGE, t / "data/merged", g, t / "wide"], r"different dtypes \(int32, uint16\)"


def case_merge_missing_prefix(t, i, g):
    return [MERGE, t / "data/merged", g, t / "nowhere"], \
        r"no indexed dataset at '.*nowhere': looked for .*nowhere\.bin \+ .*nowhere\.idx"


def case_merge_truncated_input(t, i, g):
    broken = copy_pair(g, t / "broken")
    Path(f"{broken}.bin").write_bytes(Path(f"{broken}.bin").read_bytes()[:-100])
    return [MERGE, t / "data/merged", g, broken], r"broken/out_text_document\.bin has .* truncated or mismatched"


def case_inspect_truncated_idx(t, i, g):
    broken = copy_pair(g, t / "broken")
    Path(f"{broken}.idx").write_bytes(Path(f"{broken}.idx").read_bytes()[:200])
    return [INSPECT, broken], r"out_text_document\.idx has 200 bytes .* truncated or corrupt"


def case_inspect_int16_index_over_uint16_data(t, i, g):
    patch_dtype_code(t / "data/out_text_document")
    return [INSPECT, t / "data/out_text_document", "--check"], r"holds negative token id -\d+ \(read as int16"


def case_inspect_vocab_too_small(t, i, g):
    return [INSPECT, t / "data/out_text_document", "--check", "--vocab-size", "512"], \
        r"holds token id 50256 but --vocab-size=512: set --vocab-size to at least 50257"


def case_train_tokenizer_over_existing_file(t, i, g):
    shutil.copyfile(i / "tokenizer.json", t / "tokenizer.json")
    return [TRAIN_TOK, "--input", DATA / "tinyshakespeare-200k.txt", "--vocab-size", "300",
            "--output", t / "tokenizer.json"], r"tokenizer\.json already exists: pass --overwrite"


def case_train_tokenizer_truncated_input(t, i, g):
    return [TRAIN_TOK, "--input", i / "trunc.jsonl.gz", "--vocab-size", "300", "--output",
            t / "new" / "tokenizer.json"], r"trunc\.jsonl\.gz is truncated"


CASES = {name[len("case_"):]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_refused_and_harmless(name, tmp_path, inputs, good_pair):
    copy_pair(good_pair, tmp_path / "data")
    command, mention = CASES[name](tmp_path, inputs, good_pair)
    refused(command, mention=mention, unchanged=[tmp_path, inputs])


def test_int16_index_is_caught_by_check_token_ids_with_and_without_sidecar(tmp_path, good_pair):
    prefix = copy_pair(good_pair, tmp_path)
    patch_dtype_code(prefix)
    with pytest.raises(IndexedDatasetError, match=r"declares int16 token ids \(dtype code 3\) but .*"
                                                  r"meta\.json records uint16.*set byte 17 of the \.idx to 8"):
        check_token_ids(prefix, 50257)
    meta_path(prefix).unlink()
    with pytest.raises(IndexedDatasetError, match=r"negative token id -\d+ \(read as int16"):
        check_token_ids(prefix, 50257)


def test_check_token_ids_catches_a_vocabulary_too_small_from_sidecar_and_by_scan(tmp_path, good_pair):
    prefix = copy_pair(good_pair, tmp_path)
    info = check_token_ids(prefix, 50257)
    assert (info["min"] >= 0, info["max"], info["source"], info["vocab_size"]) == (True, 50256, "sidecar", 50257)
    with pytest.raises(IndexedDatasetError, match=r"out_text_document\.bin holds token id 50256 but "
                                                  r"model\.vocab_size=512: set model\.vocab_size to at least "
                                                  r"50257 \(the tokenizer's vocabulary, recorded in .*meta\.json\)"):
        check_token_ids(prefix, 512)
    meta_path(prefix).unlink()   # no sidecar (a Megatron-made corpus): the .bin is scanned
    assert check_token_ids(prefix, 50257)["source"] == "scan"
    with pytest.raises(IndexedDatasetError, match=r"holds token id 50256 but model\.vocab_size=50000: .* No tokenizer "
                                                  r"is known .*Set model\.vocab_size to at least 50257 \(the largest "
                                                  r"id in the data \+ 1\) only when"):
        check_token_ids(prefix, 50000)
    # a sidecar of an earlier, different pair is not believed
    stale = json.loads(Path(f"{good_pair}.meta.json").read_text())
    stale.update(num_tokens=stale["num_tokens"] + 1, max_token_id=10)
    meta_path(prefix).write_text(json.dumps(stale))
    assert check_token_ids(prefix, 50257)["source"] == "scan"
    with pytest.raises(IndexedDatasetError, match="holds token id 50256"):
        check_token_ids(prefix, 100)


def test_scan_in_small_chunks_finds_the_range(tmp_path):
    with IndexedDatasetWriter(tmp_path / "d", np.int32) as w:
        for n in range(50):
            w.add(np.arange(n * 7 - 3, n * 7 + 4))
    ds = IndexedDataset(tmp_path / "d")
    assert scan_token_range(ds, chunk_tokens=11) == scan_token_range(ds) == (-3, 49 * 7 + 3)


def test_sidecar_records_what_was_written(tmp_path, good_pair):
    meta = json.loads(Path(f"{good_pair}.meta.json").read_text())
    ds = IndexedDataset(good_pair)
    ids = np.asarray(ds._bin)
    assert meta == {"format": "megatron_id.dataset_meta/1", "dtype": "uint16", "vocab_size": 50257,
                    "max_token_id": int(ids.max()), "min_token_id": int(ids.min()),
                    "num_sequences": 150, "num_documents": 150, "num_tokens": len(ids),
                    "tokenizer": str(GPT2.resolve()), "tokenizer_id": identity_of_file(GPT2),
                    "eod_id": 50256, "bin_bytes": 2 * len(ids), "checksum": crc32_record(f"{good_pair}.bin")}
    # merge: the id range over its inputs, which need no sidecar of their own
    other = tmp_path / "other"
    with IndexedDatasetWriter(other, np.uint16) as w:
        w.add(np.array([7, 60000]))
    meta_path(other).unlink()
    # (60000 is no GPT-2 id: merged only on purpose, and then no vocabulary is recorded, issue 52)
    done = run_module(MERGE, [tmp_path / "merged", good_pair, other, "--allow-tokenizer-mismatch"])
    assert done.returncode == 0, done.stderr
    merged = json.loads(meta_path(tmp_path / "merged").read_text())
    assert (merged["max_token_id"], merged["min_token_id"], merged["vocab_size"]) == (60000, 0, None)
    assert (merged["num_sequences"], merged["num_tokens"]) == (151, len(ids) + 2)
    assert merged["tokenizer"] is None and merged["tokenizer_id"] is None   # one input's tokenizer is unknown
    assert merged["checksum"] == crc32_record(meta_path(tmp_path / "merged").with_suffix("").with_suffix(".bin"))


def crc32_record(path, chunk=1 << 24) -> dict:
    """The sidecar's checksum record of a file, computed here independently of the writer."""
    data = Path(path).read_bytes()
    return {"algorithm": "crc32", "chunk_bytes": chunk,
            "chunks": [zlib.crc32(data[i:i + chunk]) for i in range(0, len(data), chunk)]}


def test_overwrite_replaces_the_pair_atomically(tmp_path, good_pair, inputs):
    prefix = copy_pair(good_pair, tmp_path / "data")
    fresh = run_module(PRE, preprocess(inputs / "good.jsonl", tmp_path / "fresh" / "out")[1:])
    assert fresh.returncode == 0, fresh.stderr
    done = run_module(PRE, preprocess(inputs / "good.jsonl", tmp_path / "data" / "out", "--overwrite")[1:])
    assert done.returncode == 0, done.stderr
    for ext in EXTS:   # exactly what a fresh run writes (the sidecar too), nothing else
        assert Path(f"{prefix}{ext}").read_bytes() == (tmp_path / "fresh" / f"out_text_document{ext}").read_bytes()
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [f"out_text_document{e}" for e in EXTS]
    # merge --overwrite too (an output that is one of its inputs is refused: test_careless_data_tools.py)
    merged = tmp_path / "data" / "merged"
    assert run_module(MERGE, [merged, prefix]).returncode == 0
    done = run_module(MERGE, [merged, prefix, tmp_path / "fresh" / "out_text_document", "--overwrite"])
    assert done.returncode == 0, done.stderr
    assert len(IndexedDataset(merged)) == 40
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == \
        sorted(f"{name}{e}" for name in ("merged", "out_text_document") for e in EXTS)


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_temporary_files_of_killed_runs_are_removed_and_live_ones_kept(tmp_path, inputs):
    dead = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = tmp_path / "data"
        folder.mkdir()
        stale = [folder / f".out_text_document{ext}.tmp-{dead}" for ext in (".bin", ".idx")]
        stale.append(folder / f".out_text_document.parts.tmp-{dead}")
        stale[-1].mkdir()
        (stale[-1] / "part0_key0.bin").write_bytes(b"x")
        kept = [folder / f".out_text_document.bin.tmp-{live.pid}", folder / f".other.bin.tmp-{dead}",
                folder / "my-notes.txt"]
        for path in stale[:2] + kept:
            path.write_bytes(b"partial")
        done = run_module(PRE, preprocess(inputs / "good.jsonl", folder / "out")[1:])
        assert done.returncode == 0, done.stderr
        assert "removed 3 stale temporary files left by killed runs" in done.stderr
        assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
        # merge cleans up after itself the same way
        (folder / f".merged.idx.tmp-{dead}").write_bytes(b"partial")
        done = run_module(MERGE, [folder / "merged", folder / "out"])
        assert done.returncode == 0 and "removed 1 stale temporary file " in done.stderr, done.stderr
        assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == sorted(p.name for p in kept[:2])
    finally:
        live.kill()
        live.wait()


def test_a_failed_run_removes_the_folders_it_created(tmp_path, inputs):
    refused(preprocess(inputs / "empty.jsonl", tmp_path / "new" / "deeper" / "out"),
            mention="is empty", unchanged=[tmp_path])
    assert not (tmp_path / "new").exists()


def test_filtered_documents_are_only_counted_and_strict_ignores_them(tmp_path, inputs):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(jsonl_bytes([{"text": "keep me", "language": "en"},
                                   {"text": "drop me", "language": "fr"}]))
    done = run_module(PRE, preprocess(mixed, tmp_path / "out", "--language", "en", "--strict")[1:])
    assert done.returncode == 0, done.stderr
    assert "documents written: 1" in done.stderr and "1 filtered: language != en" in done.stderr
    assert "intended" in run_module(PRE, ["--help"]).stdout
