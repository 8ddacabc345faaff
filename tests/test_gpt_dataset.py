"""GPT samples: packing, epochs, splits, blending, resume and the shared index cache.

The synthetic datasets hold unique token values (token t of the corpus has value t), so every
sample can be traced back to the exact tokens it was made of.
"""
import collections
import os
import re

import numpy as np
import pytest
import torch.distributed as dist
from distributed import run_distributed

from megatron_id.data import index_cache, native, sample_index
from megatron_id.data.gpt_dataset import (
    BlendedDataset,
    DataConfigError,
    GPTDataset,
    PretrainingSampler,
    build_gpt_datasets,
    check_data,
    parse_data_path,
    parse_split,
    split_ranges,
)
from megatron_id.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter

SEQ = 16


def unique_token_corpus(path, n_docs, seed, offset=0):
    """Documents of random lengths (0 to 60 tokens) whose tokens are 0, 1, 2, ... in order."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(0, 61, size=n_docs)
    lengths[3] = 0   # an empty document must not break anything
    with IndexedDatasetWriter(path, np.int32) as w:
        start = offset
        for n in lengths:
            w.add(np.arange(start, start + n))
            start += n
    return IndexedDataset(path)


def test_each_token_appears_once_per_epoch_and_samples_cross_documents(tmp_path):
    ds = unique_token_corpus(tmp_path / "c", 200, seed=0)
    docs = split_ranges(len(ds), "969,30,1")[0]
    split_tokens = set(np.concatenate([ds[i] for i in range(*docs)]).tolist())
    epochs = 3
    n = (epochs * len(split_tokens) - 1) // SEQ
    gpt = GPTDataset(ds, docs, n, SEQ, seed=1, cache_dir=tmp_path / "cache")
    counts = collections.Counter()
    crossing = 0
    ends = np.cumsum(ds.lengths)
    for i in range(len(gpt)):
        sample = gpt[i]
        assert sample.shape == (SEQ + 1,) and sample.dtype == np.int64
        counts.update(sample[:-1].tolist())   # each input position once
        owners = np.searchsorted(ends, sample, side="right")
        crossing += len(set(owners.tolist())) > 1
    assert set(counts) <= split_tokens
    assert all(c <= epochs for c in counts.values())
    short = sum(epochs - counts.get(t, 0) for t in split_tokens)   # only the tail of the last epoch
    assert short == epochs * len(split_tokens) - n * SEQ < SEQ + 1
    assert crossing > len(gpt) // 4   # packing: samples span document boundaries (~46% here)
    # consecutive samples (before shuffling) share exactly one token
    order = np.argsort(gpt.shuffle_idx)
    assert gpt[order[0]][-1] == gpt[order[1]][0]


def test_splits_do_not_overlap_and_cover_the_documents(tmp_path):
    ds = unique_token_corpus(tmp_path / "c", 300, seed=1)
    ranges = split_ranges(len(ds), "969,30,1")
    assert ranges[0][0] == 0 and ranges[-1][1] == 300
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert ranges == [(0, 291), (291, 300), (300, 300)]
    train, valid, _ = build_gpt_datasets(str(tmp_path / "c"), "90,10,0", (200, 20, 0), SEQ, 3,
                                         tmp_path / "cache")
    tokens = [set(np.concatenate([d[i] for i in range(len(d))]).tolist()) for d in (train, valid)]
    assert not tokens[0] & tokens[1]


def test_index_is_cached_and_reused(tmp_path):
    ds = unique_token_corpus(tmp_path / "c", 100, seed=2)
    a = GPTDataset(ds, (0, 100), 50, SEQ, seed=5, cache_dir=tmp_path / "cache")
    b = GPTDataset(ds, (0, 100), 50, SEQ, seed=5, cache_dir=tmp_path / "cache")
    c = GPTDataset(ds, (0, 100), 50, SEQ, seed=6, cache_dir=tmp_path / "cache")
    assert a.built_index and not b.built_index and c.built_index
    assert all(np.array_equal(a[i], b[i]) for i in range(50))
    assert any(not np.array_equal(a[i], c[i]) for i in range(50))


def test_resuming_from_consumed_samples_gives_the_same_order(tmp_path):
    ds = unique_token_corpus(tmp_path / "c", 100, seed=3)
    gpt = GPTDataset(ds, (0, 100), 120, SEQ, seed=0, cache_dir=tmp_path / "cache")
    mbs, dp = 2, 3
    full = {r: list(PretrainingSampler(len(gpt), 0, mbs, r, dp)) for r in range(dp)}
    consumed = 7 * mbs * dp   # stopped after 7 steps
    resumed = {r: list(PretrainingSampler(len(gpt), consumed, mbs, r, dp)) for r in range(dp)}
    for r in range(dp):
        assert resumed[r] == full[r][7:]
        samples_full = [gpt[i].tolist() for batch in full[r][7:] for i in batch]
        reopened = GPTDataset(IndexedDataset(tmp_path / "c"), (0, 100), 120, SEQ, seed=0,
                              cache_dir=tmp_path / "cache")
        assert samples_full == [reopened[i].tolist() for batch in resumed[r] for i in batch]
    seen = [i for r in range(dp) for b in full[r] for i in b]
    assert sorted(seen) == list(range(len(seen)))   # ranks never share a sample


def test_blending_follows_weights(tmp_path):
    unique_token_corpus(tmp_path / "a", 300, seed=4)
    unique_token_corpus(tmp_path / "b", 300, seed=5, offset=10_000_000)
    assert parse_data_path(f"3 {tmp_path / 'a'} 1 {tmp_path / 'b'}") == [(0.75, str(tmp_path / "a")),
                                                                          (0.25, str(tmp_path / "b"))]
    train, _, _ = build_gpt_datasets(f"0.7 {tmp_path / 'a'} 0.3 {tmp_path / 'b'}", "100,0,0",
                                     (10_000, 0, 0), SEQ, 0, tmp_path / "cache")
    assert isinstance(train, BlendedDataset) and len(train) == 10_000
    from_b = sum(int(train[i][0] >= 10_000_000) for i in range(len(train)))
    assert abs(from_b / 10_000 - 0.3) < 0.01
    prefix = np.asarray(train.dataset_index[:1000])
    assert abs((prefix == 1).mean() - 0.3) < 0.01   # the greedy rule keeps every prefix on target
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        parse_data_path(f"0.5 {tmp_path / 'a'} 0.5")


def _build_on_two_ranks(rank, world, prefix, cache):
    ds = IndexedDataset(prefix)
    gpt = GPTDataset(ds, (0, len(ds)), 64, SEQ, seed=9, cache_dir=cache)
    dist.barrier()
    return gpt.built_index, [gpt[i].tolist() for i in range(len(gpt))]


def test_rank0_builds_the_index_while_others_wait(tmp_path):
    unique_token_corpus(tmp_path / "c", 100, seed=6)
    results = run_distributed(_build_on_two_ranks, 2, args=(str(tmp_path / "c"), str(tmp_path / "cache")),
                              timeout=120)
    assert [built for built, _ in results] == [True, False]
    assert results[0][1] == results[1][1]


def test_check_data_refuses_what_cannot_train_before_any_index_is_built(tmp_path):
    unique_token_corpus(tmp_path / "c", 100, seed=7)   # int32, ids up to ~3000, no empty cache
    good = str(tmp_path / "c")
    check_data(good, "969,30,1", SEQ, 10_000_000)
    check_data(f"1 {good} 0 {tmp_path / 'c'}", "100,0,0", SEQ, 10_000_000)
    assert not (tmp_path / "index-cache").exists()
    cases = [
        ((str(tmp_path / "missing"), "969,30,1", SEQ, 10_000_000),
         r"data\.data_path: no indexed dataset at '.*missing': looked for .*missing\.bin"),
        ((good, "0,100,0", SEQ, 10_000_000),
         r"data\.split=0,100,0 leaves no training documents in .*c \(100 documents\): give the train split"),
        ((good, "1,999,0", SEQ, 10_000_000),   # 0.1% of 100 documents rounds to none
         r"data\.split=1,999,0 leaves no training documents"),
        ((good, "969,30,1", 100_000, 10_000_000),
         r"holds [\d,]+ tokens, fewer than model\.seq_length \+ 1 = 100,001 needed for one sample"),
        ((good, "969,30,1", SEQ, 1000),
         r"c\.bin holds token id \d+ but model\.vocab_size=1000: .*Set model\.vocab_size to at least"),
        ((good, "train,valid", SEQ, 10_000_000), r"data\.split='train,valid': give up to three non-negative numbers"),
        ((f"0.5 {good} 0.5", "969,30,1", SEQ, 10_000_000), r"weight/prefix pairs"),
    ]
    for args, message in cases:
        with pytest.raises(DataConfigError, match=message) as err:
            check_data(*args)
        assert err.value.same_on_every_rank and isinstance(err.value, ValueError)
    with pytest.raises(ValueError, match="data.split='-1,2'"):   # still a ValueError for old callers
        parse_split("-1,2")


# ---------------------------------------------------------------- the fast builds against their references

def test_the_linear_time_sample_index_equals_the_reference(monkeypatch):
    """Random corpora (empty documents, one-token documents, many epochs, a split that starts
    inside the corpus, tiny document chunks so the chunk loop runs many times): every value of
    the reference (the code as it was: int64, a binary search per start), doc_idx cut after the
    last document a sample reads, and every array int32."""
    monkeypatch.setattr(sample_index, "DOCUMENT_CHUNK", 7)
    rng = np.random.RandomState(0)
    checked = 0
    for _ in range(300):
        n = rng.randint(1, 60)
        lengths = rng.randint(0, 20, size=n).astype(np.int32)
        lengths[rng.randint(n)] = 3
        start = rng.randint(0, n)
        end = rng.randint(start + 1, n + 1)
        if lengths[start:end].sum() < 2:
            continue
        seq, num, seed = rng.randint(1, 30), rng.randint(1, 200), rng.randint(100)
        want = sample_index.build_sample_index_reference(lengths, (start, end), num, seq, seed)
        got = sample_index.build_sample_index(lengths, (start, end), num, seq, seed)
        assert np.array_equal(got["sample_idx"], want["sample_idx"])
        assert np.array_equal(got["shuffle_idx"], want["shuffle_idx"])
        used = int(want["sample_idx"][-1, 0]) + 1
        assert np.array_equal(got["doc_idx"], want["doc_idx"][:used])
        assert {a.dtype for a in got.values()} == {np.dtype(np.int32)}
        checked += 1
    assert checked > 250
    assert sample_index.index_dtype(2 ** 31 - 1) == np.int32 and sample_index.index_dtype(2 ** 31) == np.int64


def test_the_blend_index_in_c_equals_the_python_reference():
    assert native.data_helpers() is not None, "the C helper did not build here"
    rng = np.random.RandomState(1)
    for trial in range(150):
        d = rng.randint(1, 12)
        weights = np.ones(d) if trial % 3 == 0 else rng.rand(d)   # equal weights: ties on every step
        if trial % 5 == 0 and d > 1:
            weights[0] = 0
        weights = weights / weights.sum()
        num = rng.randint(1, 3000)
        want = sample_index.build_blending_index_reference(weights, num)
        got = sample_index.build_blending_index(weights, num)
        assert np.array_equal(got["dataset_index"], want["dataset_index"])
        assert np.array_equal(got["dataset_sample_index"], want["dataset_sample_index"])
        assert got["dataset_sample_index"].dtype == np.int32
    # the int64 output (runs past 2**31 samples) through the same function
    weights = np.array([0.5, 0.3, 0.2])
    index, wide, counts = np.empty(1000, np.int16), np.empty(1000, np.int64), np.zeros(3, np.int64)
    status = native.data_helpers().megatron_id_blend_index(weights.ctypes.data, 3, 1000, index.ctypes.data,
                                                           wide.ctypes.data, 8, counts.ctypes.data)
    want = sample_index.build_blending_index_reference(weights, 1000)
    assert status == 0 and np.array_equal(index, want["dataset_index"])
    assert np.array_equal(wide, want["dataset_sample_index"]) and counts.tolist() == [500, 300, 200]


def test_without_a_compiler_the_blend_is_built_in_python_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_ID_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.setenv("CC", "false")   # a "compiler" that fails
    monkeypatch.setattr(native, "_compiler", lambda: "false")
    native.data_helpers.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"could not be built \(RuntimeError: false failed.*pure Python"):
            assert native.data_helpers() is None
        got = sample_index.build_blending_index([0.6, 0.4], 500)
    finally:
        native.data_helpers.cache_clear()
    want = sample_index.build_blending_index_reference([0.6, 0.4], 500)
    assert np.array_equal(got["dataset_index"], want["dataset_index"])
    assert not list((tmp_path / "build").glob("*.so"))   # nothing half-built left under the final name


def test_a_long_build_is_announced_with_an_estimate(tmp_path, monkeypatch, capsys):
    unique_token_corpus(tmp_path / "c", 100, seed=8)
    unique_token_corpus(tmp_path / "d", 100, seed=9)
    monkeypatch.setattr(index_cache, "LONG_BUILD_S", 0.0)
    build_gpt_datasets(f"1 {tmp_path / 'c'} 3 {tmp_path / 'd'}.bin", "100,0,0", (500, 0, 0), SEQ, 0, tmp_path / "cache")
    err = capsys.readouterr().err
    assert re.search(r"building the train sample index of .*c \(127 samples from 100 documents x 1 epoch\) "
                     r"\(~\d+ s; once: cached in .*cache\)", err), err
    assert re.search(r"building the train blend index \(500 samples over 2 datasets\) \(~\d+ s; once", err), err


# ---------------------------------------------------------------- waiting on rank 0's files, not on a collective

PATIENCE_S = 1.0   # the process group's collective timeout in the next test
BLEND_SAMPLES = 2_400_000   # x 20 prefixes: ~4 s of the Python blend on a 2-core VM


def _blend_past_the_timeout(rank, world, prefixes, cache):
    import contextlib
    import io
    import os
    import time
    os.environ["MEGATRON_ID_NO_NATIVE_DATA"] = "1"   # the Python blend: seconds of real work on rank 0
    index_cache.REPORT_EVERY_S = 0.5
    stderr = io.StringIO()
    began = time.monotonic()
    with contextlib.redirect_stderr(stderr):
        train, _, _ = build_gpt_datasets(" ".join(f"1 {p}" for p in prefixes), "100,0,0", (BLEND_SAMPLES, 0, 0), SEQ,
                                         0, cache, stale_after_s=60)
    seconds = time.monotonic() - began
    dist.barrier()   # the group still works: a waiting rank did not time out in a collective
    picks = np.asarray(train.dataset_index[::997]).tolist()
    return (seconds, train.built_index, picks, [train[i].tolist() for i in range(0, BLEND_SAMPLES, 100_000)],
            stderr.getvalue())


def test_ranks_wait_for_an_index_that_takes_longer_than_the_collective_timeout(tmp_path):
    """A 2-rank group whose collectives time out after 1 s, and a blend index that takes rank 0
    several seconds: rank 1 waits on rank 0's files, says so, and both then use the same index
    (the barrier, and before this change the wait itself, would have timed out)."""
    unique_token_corpus(tmp_path / "c", 100, seed=9)
    prefixes = []
    for i in range(20):   # twenty prefixes, as a blend of shards (hard links: distinct datasets)
        for ext in (".bin", ".idx"):
            os.link(tmp_path / f"c{ext}", tmp_path / f"shard{i:02d}{ext}")
        prefixes.append(str(tmp_path / f"shard{i:02d}"))
    results = run_distributed(_blend_past_the_timeout, 2, args=(prefixes, str(tmp_path / "cache")), timeout=300,
                              collective_timeout=PATIENCE_S)
    (built0_s, built0, picks0, samples0, err0), (waited_s, built1, picks1, samples1, err1) = results
    assert built0 and not built1
    assert waited_s > 2 * PATIENCE_S, f"the build took {built0_s:.1f} s: too quick to prove anything"
    assert picks0 == picks1 and samples0 == samples1
    assert "rank 1: waiting for rank 0 to build the train" in err1
    assert re.search(r"rank 1: still waiting for rank 0 to build the train blend index \(2,400,000 samples over 20 "
                     r"datasets\) \(\d+ s so far; rank 0: blending 2,400,000 samples over 20 datasets \(in Python\)",
                     err1), err1
    assert "waiting" not in err0


def _waits_that_end(rank, world, good, cache):
    from megatron_id.data.index_cache import IndexWaitError
    messages = []
    # rank 0's build fails: rank 1 stops with its error instead of waiting out the timeout
    import megatron_id.data.gpt_dataset as gpt
    working = gpt.build_sample_index

    def broken(*args, **kwargs):
        raise MemoryError("no memory for the index")
    if rank == 0:
        gpt.build_sample_index = broken
    try:
        build_gpt_datasets(good, "100,0,0", (64, 0, 0), SEQ, 0, cache, stale_after_s=30)
    except (IndexWaitError, MemoryError) as err:
        messages.append(str(err))
    gpt.build_sample_index = working
    # a cache folder that is not shared (each rank sees its own): rank 1 gives up after stale_after_s
    try:
        build_gpt_datasets(good, "100,0,0", (65, 0, 0), SEQ, 0, f"{cache}-rank{rank}", stale_after_s=1.0)
    except IndexWaitError as err:
        messages.append(str(err))
    return messages


def test_a_waiting_rank_stops_when_rank_0_fails_or_its_folder_is_not_shared(tmp_path):
    unique_token_corpus(tmp_path / "c", 100, seed=10)
    (rank0, rank1) = run_distributed(_waits_that_end, 2, args=(str(tmp_path / "c"), str(tmp_path / "cache")),
                                     timeout=120)
    assert rank0 == ["no memory for the index"]
    assert re.fullmatch(r"rank 0 failed while building the train sample index of .*c \(64 samples from 100 "
                        r"documents x \d+ epochs?\): MemoryError: no memory for the index \(rank 0's log has the "
                        r"details\)\.", rank1[0]), rank1[0]
    assert re.search(r"rank 1 waited 0\.0 min for rank 0 to build the train sample index .*, and no status file from "
                     r"rank 0 appeared in .*cache-rank1\. If rank 0 stopped, its log says why\. "
                     r"If .*cache-rank1 is not "
                     r"on a file system every node shares, set data\.index_cache_dir to one that is\. .*raise "
                     r"train\.collective_timeout_minutes", rank1[1]), rank1[1]
