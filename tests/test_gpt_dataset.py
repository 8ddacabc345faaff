"""GPT samples: packing, epochs, splits, blending, resume and the shared index cache.

The synthetic datasets hold unique token values (token t of the corpus has value t), so every
sample can be traced back to the exact tokens it was made of.
"""
import collections

import numpy as np
import pytest
import torch.distributed as dist

from distributed import run_distributed
from megatron_id.data.gpt_dataset import (BlendedDataset, DataConfigError, GPTDataset,
                                          PretrainingSampler, build_gpt_datasets, check_data,
                                          parse_data_path, parse_split, split_ranges)
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
    a = unique_token_corpus(tmp_path / "a", 300, seed=4)
    b = unique_token_corpus(tmp_path / "b", 300, seed=5, offset=10_000_000)
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
         r"c\.bin holds token id \d+ but model\.vocab_size=1000: set model\.vocab_size to at least"),
        ((good, "train,valid", SEQ, 10_000_000), r"data\.split='train,valid': give up to three non-negative numbers"),
        ((f"0.5 {good} 0.5", "969,30,1", SEQ, 10_000_000), r"weight/prefix pairs"),
    ]
    for args, message in cases:
        with pytest.raises(DataConfigError, match=message) as err:
            check_data(*args)
        assert err.value.same_on_every_rank and isinstance(err.value, ValueError)
    with pytest.raises(ValueError, match="data.split='-1,2'"):   # still a ValueError for old callers
        parse_split("-1,2")
