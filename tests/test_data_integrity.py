"""Data that changed after it was made is refused, and data without a sidecar is scanned once
(issue 40): checksums in the .meta.json sidecar checked at start, every batch's token ids checked
as it is read, the scan of Megatron-made data remembered, and `inspect --write-meta`.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from bad_inputs import refused, run_module
from conftest import CONFIGS, ROOT

from megatron_id.data import indexed_dataset
from megatron_id.data.gpt_dataset import (
    BlendedDataset,
    CorruptDataError,
    DataConfigError,
    build_gpt_datasets,
    check_batch_token_ids,
    check_data,
)
from megatron_id.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, meta_path, write_index

GPT2 = ROOT / "tests" / "data" / "gpt2-tokenizer.json"
INSPECT = "data_tools.inspect"
EXTS = (".bin", ".idx", ".meta.json")


def copy_dataset(prefix, folder: Path, name="data", exts=EXTS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for ext in exts:
        shutil.copyfile(f"{prefix}{ext}", folder / f"{name}{ext}")
    return folder / name


def corrupt_every_50th(prefix: Path, value: int = 65000) -> np.ndarray:
    """The issue's damage: every 50th token id of the .bin overwritten (the .idx and sidecar left
    as they were). Returns the positions changed."""
    tokens = np.memmap(f"{prefix}.bin", mode="r+", dtype=np.uint16)
    tokens[::50] = value
    tokens.flush()
    return np.arange(0, len(tokens), 50)


def megatron_made(prefix: Path, lengths, tokens) -> Path:
    """A pair as Megatron's tools write it: .bin and .idx, no sidecar."""
    np.asarray(tokens, dtype=np.uint16).tofile(f"{prefix}.bin")
    write_index(f"{prefix}.idx", np.uint16, np.asarray(lengths))
    return prefix


def test_a_changed_bin_is_refused_at_start_naming_the_bytes(fineweb_prefix, tmp_path):
    prefix = copy_dataset(fineweb_prefix, tmp_path)
    check_data(str(prefix), "969,30,1", 64, 50257)   # intact: fine, sampled or full
    check_data(str(prefix), "969,30,1", 64, 50257, verify="full")
    corrupt_every_50th(prefix)
    size = Path(f"{prefix}.bin").stat().st_size
    for verify in ("sample", "full"):
        with pytest.raises(DataConfigError) as err:
            check_data(str(prefix), "969,30,1", 64, 50257, verify=verify)
        assert re.search(rf"data\.bin: (1 of its 1 chunks of 16,777,216 bytes \(the first: )?bytes 0\.\.{size - 1:,} "
                         rf"\(tokens from 0\)\)? do not match the checksums? .*data\.meta\.json recorded when the file "
                         rf"was written: the \.bin was changed or damaged", str(err.value)), (verify, str(err.value))
    check_data(str(prefix), "969,30,1", 64, 50257, verify="none")   # none: the sidecar's range only
    # a sidecar without checksums (written before they were recorded): said once, not refused
    meta = json.loads(meta_path(prefix).read_text())
    del meta["checksum"]
    meta_path(prefix).write_text(json.dumps(meta))
    with pytest.raises(DataConfigError, match=r"data\.bin holds token ids 0\.\.65000 but .*data\.meta\.json records "
                                              r"0\.\.50256: the \.bin was changed"):
        check_data(str(prefix), "969,30,1", 64, 50257, verify="full")   # full: a scan instead


def test_every_bad_id_in_a_batch_is_traced_to_its_file_sequence_and_offset(tmp_path):
    # documents whose tokens are 0, 1, 2, ...: a token's value is its place in the file
    lengths = np.random.RandomState(0).randint(1, 40, size=80)
    megatron_made(tmp_path / "a", lengths, np.arange(lengths.sum()) % 1000)
    megatron_made(tmp_path / "b", lengths, np.arange(lengths.sum()) % 1000)
    train, _, _ = build_gpt_datasets(f"1 {tmp_path / 'a'} 1 {tmp_path / 'b'}", "100,0,0", (40, 0, 0), 16, 0,
                                     tmp_path / "cache")
    assert isinstance(train, BlendedDataset)
    indices = [7, 8, 9]
    batch = np.stack([train[i] for i in indices])
    check_batch_token_ids(train, indices, batch, 1000)   # clean: nothing
    # damage one token of the file that sample 8 reads, then read the batch again
    dataset = train.datasets[int(train.dataset_index[8])]
    path, sequence, offset = dataset.locate(int(train.dataset_sample_index[8]), 5)
    ds = IndexedDataset(str(path)[:-4])
    position = int(ds.pointers[sequence]) // 2 + offset
    assert batch[1][5] == position % 1000   # locate names the token the sample holds
    tokens = np.memmap(path, mode="r+", dtype=np.uint16)
    tokens[position] = 60000
    tokens.flush()
    batch = np.stack([train[i] for i in indices])
    with pytest.raises(CorruptDataError) as err:
        check_batch_token_ids(train, indices, batch, 1000)
    assert re.fullmatch(rf"{re.escape(str(path))}: token id 60000 at sequence {sequence:,}, token {offset:,} of it "
                        rf"\(byte {2 * position:,} of the file\), is >= model\.vocab_size=1000 \(1 such id in this "
                        rf"batch of training sample 8\): the \.bin is damaged, or was not made with this model's "
                        rf"tokenizer\. python -m data_tools\.inspect .* --check lists its token ids; re-create it "
                        rf"with data_tools\.preprocess or restore it from the original copy\.", str(err.value))
    assert not CorruptDataError.same_on_every_rank   # one rank read it: that rank says so


def _train_command(prefix, save, *extra):
    return ["megatron_id.cli", "train", "--config", str(CONFIGS / "model" / "tiny.yaml"),
            f"data.data_path=[{prefix}]", f"data.index_cache_dir={Path(save).parent / 'cache'}", "data.split=100,0,0",
            "model.vocab_size=50257", f"train.save={save}",
            "train.precision=fp32", "train.zero_stage=0", "train.micro_batch_size=2", "train.global_batch_size=2",
            "train.train_tokens=256", "train.eval_iters=0", *extra]


@pytest.mark.slow
def test_training_refuses_the_damaged_bin_at_start_or_at_its_first_batch(fineweb_prefix, tmp_path):
    """The issue's reproduction: every 50th id 65,000 with the .idx and the sidecar intact used to
    train to a gradient norm of 17,537 and save a checkpoint."""
    prefix = copy_dataset(fineweb_prefix, tmp_path / "data")
    corrupt_every_50th(prefix)
    save = tmp_path / "ckpt"
    refused(_train_command(prefix, save), mention=r"data\.bin: bytes 0\.\.[\d,]+ \(tokens from 0\) do not match the "
            r"checksum .*data\.meta\.json recorded", unchanged=[tmp_path / "data"])
    refused(_train_command(prefix, save, "data.verify=none"),
            mention=r"data\.bin: token id 65000 at sequence [\d,]+, token [\d,]+ of it \(byte [\d,]+ of the "
                    r"file\), is >= model\.vocab_size=50257", unchanged=[tmp_path / "data"])
    assert not (save / "latest").exists() and not list(save.glob("iter_*"))   # nothing saved


def test_data_without_a_sidecar_is_scanned_once_not_at_every_launch(tmp_path, monkeypatch):
    lengths = np.full(300, 50)
    megatron_made(tmp_path / "mega_text_document", lengths, np.arange(lengths.sum()) % 50000)
    scans = []
    real_scan = indexed_dataset.scan_token_range
    monkeypatch.setattr(indexed_dataset, "scan_token_range",
                        lambda ds, *a: scans.append(ds.prefix) or real_scan(ds, *a))
    cache = tmp_path / "index-cache"
    for launch in range(2):
        check_data(str(tmp_path / "mega"), "969,30,1", 64, 50257, cache)
    assert len(scans) == 1   # the second launch read the first one's scan
    remembered = json.loads(next(cache.glob("scan-mega_text_document-*.json")).read_text())
    assert (remembered["min"], remembered["max"]) == (0, 14999)
    with pytest.raises(DataConfigError, match=r"mega_text_document\.bin holds token id 14999 but model\.vocab_size"
                                              r"=1000: .*Set model\.vocab_size to at least 15000"):
        check_data(str(tmp_path / "mega"), "969,30,1", 64, 1000, cache)   # the remembered range still checks
    assert len(scans) == 1
    # the .bin changes (its size and time): scanned again, and the new range is the one believed
    tokens = np.memmap(tmp_path / "mega_text_document.bin", mode="r+", dtype=np.uint16)
    tokens[7] = 40000
    tokens.flush()
    del tokens
    with pytest.raises(DataConfigError, match="holds token id 40000 but model.vocab_size=20000"):
        check_data(str(tmp_path / "mega"), "969,30,1", 64, 20000, cache)
    assert len(scans) == 2
    # a cache folder that cannot be written: a note, and the check still works
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would go")
    check_data(str(tmp_path / "mega"), "969,30,1", 64, 50257, blocked)
    assert len(scans) == 3


def test_write_meta_makes_the_sidecar_preprocessing_would_have_made(tmp_path):
    lengths = np.random.RandomState(1).randint(1, 100, size=200)
    tokens = np.random.RandomState(2).randint(0, 50257, size=lengths.sum())
    with IndexedDatasetWriter(tmp_path / "ours", np.uint16, vocab_size=50257) as w:
        w.add_many(tokens, lengths)
    megatron_made(tmp_path / "theirs", lengths, tokens)
    done = run_module(INSPECT, [tmp_path / "theirs", "--write-meta", "--vocab-size", "50257"])
    assert done.returncode == 0, done.stderr
    assert re.search(r"wrote .*theirs\.meta\.json: token ids \d+\.\.\d+, 1 chunk checksum\(s\), vocabulary 50,257",
                     done.stdout), done.stdout
    ours, theirs = (json.loads(meta_path(tmp_path / n).read_text()) for n in ("ours", "theirs"))
    assert theirs == ours   # the same facts, the same checksums
    assert indexed_dataset.check_token_ids(tmp_path / "theirs", 50257)["source"] == "sidecar"
    # again: nothing to do, nothing touched
    before = meta_path(tmp_path / "theirs").read_bytes()
    again = run_module(INSPECT, [tmp_path / "theirs", "--write-meta"])
    assert again.returncode == 0 and "already describes this pair, checksums included: nothing written" in again.stdout
    assert meta_path(tmp_path / "theirs").read_bytes() == before
    # --check now also compares every chunk with the checksums
    np.memmap(tmp_path / "theirs.bin", mode="r+", dtype=np.uint16)[100] ^= 1
    check = run_module(INSPECT, [tmp_path / "theirs", "--check"])
    assert check.returncode == 1 and "do not match the checksums" in check.stderr
    # a sidecar describing other data, or a file of that name that is not ours: refused, unchanged
    meta_path(tmp_path / "ours").write_text(json.dumps({**ours, "num_tokens": 5}))
    refused([INSPECT, tmp_path / "ours", "--write-meta"], mention=r"ours\.meta\.json describes other data \(5 tokens "
            r"in 200 sequences; the pair holds \d+ in 200\): nothing was written\. .* add --replace-meta",
            unchanged=[tmp_path])
    replaced = run_module(INSPECT, [tmp_path / "ours", "--write-meta", "--replace-meta", "--tokenizer", GPT2])
    assert replaced.returncode == 0, replaced.stderr
    meta = json.loads(meta_path(tmp_path / "ours").read_text())
    assert meta["num_tokens"] == int(lengths.sum()) and meta["vocab_size"] == 50257 and meta["eod_id"] == 50256
    assert meta["checksum"] == ours["checksum"] and meta["tokenizer_id"].startswith("vocab:")
    megatron_made(tmp_path / "notes", [3], [1, 2, 3])
    meta_path(tmp_path / "notes").write_text("my own notes\n")
    refused([INSPECT, tmp_path / "notes", "--write-meta", "--replace-meta"],
            mention=r"notes\.meta\.json exists and is not a megatron_id sidecar: nothing was written",
            unchanged=[tmp_path])
    refused([INSPECT, tmp_path / "notes", "--replace-meta"], mention=r"--replace-meta goes with --write-meta",
            unchanged=[tmp_path])
