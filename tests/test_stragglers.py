"""Slow ranks (issue 53, item 3; training/stragglers.py): each rank's time per step split into
compute, data wait and communication, gathered every train.straggler_interval steps, and a rank
train.straggler_factor x slower than the other ranks' median named with its host and split on
the console, in TensorBoard, the JSONL file and wandb.

The end-to-end test slows rank 1 of 2 from step 5 on (MEGATRON_ID_INJECT_FAULTS, a sleep in its
compute far longer than the tiny model's step) with a window of 4 steps: the window of steps 1-4
names no rank (the control: same ranks, same noise, no fault yet), the window of steps 5-8 names
rank 1 and its host, and the fast rank's wait shows as communication, not compute."""
from __future__ import annotations

import json
import socket

import pytest
from conftest import CONFIGS
from distributed import run_distributed

from megatron_id.config import ConfigError, load_config
from megatron_id.training.stragglers import RankTime, ratios, slow_ranks

TINY = CONFIGS / "model" / "tiny.yaml"
INTERVAL, STEPS, SLOW_FROM, SLEEP = 4, 8, 5, 0.2   # the tiny step: ~0.03 s of compute


def _times(*own, communication=0.0):
    return [RankTime(r, f"h{r}", 100 + r, compute=t, data=0.0, communication=communication)
            for r, t in enumerate(own)]


def test_a_rank_is_compared_with_the_median_of_the_others():
    # four ranks, one at 2x: named; its peers (waiting on it in communication) are not
    named = slow_ranks(_times(0.1, 0.1, 0.21, 0.1, communication=0.1), factor=1.5)
    assert [(t.rank, round(r, 2)) for t, r in named] == [(2, 2.1)]
    # two ranks: the other rank is the median (a median over both would make a 2x rank 1.33x)
    assert [t.rank for t, _ in slow_ranks(_times(0.2, 0.1), factor=1.5)] == [0]
    # noise under the factor, one rank alone, an idle window: nobody
    assert slow_ranks(_times(0.1, 0.12, 0.09, 0.13), factor=1.5) == []
    assert slow_ranks(_times(0.5), factor=1.5) == []
    assert ratios(_times(0.0, 0.0)) == [1.0, 1.0]
    # data wait counts as the rank's own time (a slow disk on its host)
    slow_disk = [RankTime(0, "a", 1, 0.1, 0.0, 0.2), RankTime(1, "b", 2, 0.1, 0.2, 0.0)]
    assert [t.host for t, _ in slow_ranks(slow_disk, factor=1.5)] == ["b"]
    # pipeline stages are not compared with each other (the last one holds the LM head and loss)
    stages = [RankTime(r, "h", r, compute=c, data=0.0, communication=0.0, stage=r // 2)
              for r, c in enumerate((0.1, 0.1, 0.3, 0.3))]
    assert slow_ranks(stages, factor=1.5) == [] and ratios(stages) == [1.0, 1.0, 1.0, 1.0]
    assert ratios(stages[1:3]) == [None, None]   # alone in its stage: not judged


def test_the_keys_are_checked():
    assert load_config([], []).train.straggler_interval == 100
    for item, why in (("train.straggler_interval=-1", "must be >= 0"),
                      ("train.straggler_factor=1", "must be a number above 1")):
        with pytest.raises(ConfigError, match=why):
            load_config([], [item])


def test_the_named_rank_reaches_tensorboard_the_jsonl_file_and_wandb(tmp_path, capsys, monkeypatch):
    """Rank 0's report of one window (the gather itself is the end-to-end test's)."""
    # wandb.init in this process exports its service's address (WANDB_SERVICE): not left behind
    # for later tests' processes, which would then share this service
    monkeypatch.setenv("WANDB_SERVICE", "")
    monkeypatch.delenv("WANDB_SERVICE")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_offline import read_offline_run

    from megatron_id.training.layout import training_layout
    from megatron_id.training.metrics import Metrics
    from megatron_id.training.stragglers import Stragglers
    cfg = load_config([TINY], ["train.wandb.project=slow", "train.wandb.mode=offline",
                               f"train.wandb.dir={tmp_path}", f"train.metrics_file={tmp_path / 'm.jsonl'}",
                               f"train.tensorboard_dir={tmp_path / 'tb'}"])
    metrics = Metrics(cfg, training_layout(cfg, 4), is_logger=True)
    report = Stragglers.__new__(Stragglers)
    report.factor, report.metrics = 1.5, metrics
    report._name(_times(0.1, 0.1, 0.21, 0.1, communication=0.1), 101, 200)
    metrics.end_step(200)
    metrics.close()
    line = ("slow rank 2 (host h2, pid 102): 2.10x the other ranks' compute + data wait in the median step of "
            "steps 101-200")
    assert capsys.readouterr().err.startswith(line)
    text = "rank 2 (host h2, pid 102) 2.10x: compute 0.210 s, data 0.000 s, communication 0.100 s"
    (row,) = map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines())
    assert row["ranks/slow"] == text and row["ranks/slowest_rank"] == 2 and row["ranks/slow_ranks"] == 1
    (run,) = [read_offline_run(f, min_rows=1) for f in (tmp_path / "wandb").glob("offline-run-*")]
    assert run[2][0]["ranks/slow"] == text and run[2][0]["_step"] == 200
    tb = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0}).Reload()
    assert tb.Scalars("ranks/slowest_ratio")[0].value == pytest.approx(2.1)
    assert text in tb.Tensors("ranks/slow/text_summary")[0].tensor_proto.string_val[0].decode()


def _items(run, *extra):
    return [*extra, "data.source=mqar", "data.mqar.num_pairs=4", "data.mqar.num_queries=4", "data.mqar.num_keys=16",
            "data.mqar.num_values=16", "train.precision=fp32", "train.zero_stage=0", "train.micro_batch_size=2",
            "train.global_batch_size=4", f"train.train_tokens={STEPS * 4 * 64}", "train.eval_iters=0",
            "train.log_interval=100", "optimizer.warmup_tokens=0", f"train.straggler_interval={INTERVAL}",
            f"train.metrics_file={run / 'metrics.jsonl'}", f"train.tensorboard_dir={run / 'tb'}"]


def _train(rank, world, items):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    try:
        return len(trainer.train())
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_rank_slowed_2x_is_named_within_the_interval(tmp_path, capfd, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    monkeypatch.setenv("MEGATRON_ID_INJECT_FAULTS", f"slow:rank=1:seconds={SLEEP}:from={SLOW_FROM}")
    assert run_distributed(_train, 2, args=(_items(tmp_path),), timeout=240) == [STEPS, STEPS]
    err = capfd.readouterr().err
    named = [line for line in err.splitlines() if line.startswith("slow rank")]
    host = socket.gethostname()
    assert len(named) == 1, err[-3000:]
    assert named[0].startswith(f"slow rank 1 (host {host}, pid ")
    assert f"median step of steps {SLOW_FROM}-{STEPS}" in named[0]
    rows = {row["step"]: row for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    first, second = rows[INTERVAL], rows[STEPS]
    assert first["ranks/slow_ranks"] == 0 and "ranks/slow" not in first and first["ranks/slowest_ratio"] < 1.5
    assert second["ranks/slow_ranks"] == 1 and second["ranks/slowest_rank"] == 1
    assert second["ranks/slowest_ratio"] >= 2 and second["ranks/slowest_compute_s"] >= SLEEP
    assert second["ranks/slow"].startswith(f"rank 1 (host {host}, pid ")
    assert not any("ranks/slow_ranks" in row for step, row in rows.items() if step % INTERVAL)
    # the fast rank waited for the slow one in the gradient reduction: communication, not compute
    median = named[0].split("(median rank 0: compute ")[1]
    assert float(median.split(" s, ")[0]) < SLEEP / 2 and float(median.split("communication ")[1][:5]) >= SLEEP / 2
    tb = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [(e.step, e.value) for e in tb.Scalars("ranks/slow_ranks")] == [(INTERVAL, 0.0), (STEPS, 1.0)]
    assert tb.Scalars("ranks/slowest_rank")[-1].value == 1.0


@pytest.mark.slow
def test_under_pipelining_a_slow_rank_is_compared_with_its_stage(fineweb_prefix, tmp_path, capfd, monkeypatch):
    """PP=2 x DP=2 on 4 ranks: the waits in the schedule's sends, receives and gradient
    reduction are communication, and the slow rank is named against its data-parallel peer (the
    last stage, slower by design with the LM head and the loss, is not named). Four ranks share
    this machine's 2 cores, so their compute is noisier (up to 1.5x between peers seen): the
    factor here is 2, the slowed rank is at 3.5-4.7x."""
    monkeypatch.setenv("MEGATRON_ID_INJECT_FAULTS", f"slow:rank=1:seconds={SLEEP}:from={SLOW_FROM}")
    items = [x for x in _items(tmp_path) if not x.startswith("data.")]
    items += [f"data.data_path=[{fineweb_prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
              "parallel.pipeline_model_parallel_size=2", "train.straggler_factor=2"]
    assert run_distributed(_train, 4, args=(items,), timeout=240) == [STEPS] * 4
    named = [line for line in capfd.readouterr().err.splitlines() if line.startswith("slow rank")]
    assert len(named) == 1 and named[0].startswith("slow rank 1 (host ") and f"steps {SLOW_FROM}-{STEPS}" in named[0]
    rows = {row["step"]: row for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert rows[INTERVAL]["ranks/slow_ranks"] == 0 and rows[STEPS]["ranks/slowest_rank"] == 1
