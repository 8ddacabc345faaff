"""Multi-query associative recall as a training data source (issue 29, data/mqar.py): the
samples are a function of (seed, split, index), the loss counts the answers only, a resumed run
reads the same batches, an oracle scores 100% and a model that ignores the context scores at
chance; `megatron-id eval mqar` scores a trained checkpoint, and settings that cannot work are
refused before any work."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from bad_inputs import refused
from conftest import CONFIGS, ROOT
from distributed import run_distributed

from megatron_id.config import load_config
from megatron_id.data.mqar import MQARConfigError, MQARDataset, MQARTask, score

TINY = CONFIGS / "model" / "tiny.yaml"
TASK = MQARTask(seq_length=64, num_pairs=8, num_queries=6, num_keys=32, num_values=40)


def test_a_sample_is_the_task_and_a_function_of_seed_split_and_index():
    a, b = MQARDataset(TASK, 100, seed=7), MQARDataset(TASK, 100, seed=7)
    for i in (0, 1, 57, 99):
        assert np.array_equal(a[i], b[i])                 # deterministic, any index alone
    assert not np.array_equal(a[3], MQARDataset(TASK, 100, seed=8)[3])
    assert not np.array_equal(a[3], MQARDataset(TASK, 100, seed=7, split="valid")[3])
    with pytest.raises(IndexError):
        a[100]
    for i in range(50):
        tokens = a[i]
        assert tokens.shape == (65,) and tokens.dtype == np.int64
        keys, values = tokens[0:16:2], tokens[1:16:2]
        assert len(set(keys)) == 8 and ((keys >= 1) & (keys <= 32)).all()
        assert len(set(values)) == 8 and ((values >= 33) & (values <= 72)).all()
        answer_of = dict(zip(keys.tolist(), values.tolist()))
        inputs, labels = torch.from_numpy(tokens[:-1]), torch.from_numpy(tokens[1:])
        mask = TASK.answer_mask(inputs[None])[0].bool()
        assert int(mask.sum()) == 6                       # one answer per query, nothing else counts
        asked = inputs[mask].tolist()
        assert len(set(asked)) == 6 and labels[mask].tolist() == [answer_of[k] for k in asked]
        rest = tokens[16:]
        assert set(rest.tolist()) - {0} == set(asked) | {answer_of[k] for k in asked}   # filler elsewhere


class Oracle(torch.nn.Module):
    """Reads the pairs from the context: at each input, the value that followed the same key."""

    def __init__(self, task):
        super().__init__()
        self.task = task

    def forward(self, inputs):
        logits = torch.zeros(*inputs.shape, self.task.vocab_needed)
        for b, row in enumerate(inputs.tolist()):
            pairs = {row[j]: row[j + 1] for j in range(0, 2 * self.task.num_pairs, 2)}
            for t, token in enumerate(row):
                logits[b, t, pairs.get(token, 0)] = 50.0
        return logits


class ContextFree(torch.nn.Module):
    """Logits from the current token alone (a bigram table): whatever it learned, it cannot know
    which value a key was given in this sequence."""

    def __init__(self, task):
        super().__init__()
        self.table = torch.nn.Embedding(task.vocab_needed, task.vocab_needed)
        with torch.no_grad():   # the best a context-free model can do: always some value
            self.table.weight[:, :task.first_value] -= 100.0

    def forward(self, inputs):
        return self.table(inputs)


def test_an_oracle_scores_everything_and_a_context_free_model_scores_chance():
    oracle = score(Oracle(TASK), TASK, seed=3, samples=200, batch_size=50)
    assert oracle["accuracy"] == 1.0 and oracle["answers"] == 200 * 6 and oracle["answer_loss"] < 1e-6
    torch.manual_seed(0)
    blind = score(ContextFree(TASK), TASK, seed=3, samples=3000, batch_size=500)
    n, p = blind["answers"], TASK.chance
    assert p == 1 / 40 and abs(blind["accuracy"] - p) < 5 * (p * (1 - p) / n) ** 0.5, blind


def test_settings_that_cannot_make_a_sequence_are_refused():
    cases = [(dict(num_queries=9), "data.mqar.num_queries=9 is out of range"),
             (dict(num_keys=4), "data.mqar.num_keys=4 is out of range"),
             (dict(num_values=7), "data.mqar.num_values=7 is out of range"),
             (dict(num_pairs=20, num_queries=20), "model.seq_length=64 is too short")]
    for change, message in cases:
        task = {**dict(seq_length=64, num_pairs=8, num_queries=8, num_keys=32, num_values=32), **change}
        with pytest.raises(MQARConfigError, match=message):
            MQARTask(**task).check()
    with pytest.raises(MQARConfigError, match="model.vocab_size=64 is too small .* need 73"):
        TASK.check(64)


def test_a_train_command_that_cannot_work_is_refused_before_any_work(tmp_path):
    base = ["megatron_id.cli", "train", "--config", TINY, "data.source=mqar", f"train.save={tmp_path / 'ckpt'}"]
    for extra, mention in (
            (["data.data_path=[somewhere]"], r"data.source=mqar does not go with data.data_path=\['somewhere'\]"),
            (["data.mqar.num_keys=300", "data.mqar.num_values=300"], r"model.vocab_size=512 is too small"),
            (["data.eod_mask_loss=true"], r"a packed-document switch .*: turn it off")):
        refused(base + extra, mention=mention, unchanged=[tmp_path])
    from types import SimpleNamespace

    from megatron_id.data.mqar import check_mqar_run
    with pytest.raises(MQARConfigError, match=r"pipeline_model_parallel_size=2: use 1"):
        check_mqar_run(load_config([TINY], ["data.source=mqar"]), SimpleNamespace(pipe=2))
    # the window an episode spans is what one forward reads: 96 tokens in 3 windows of 32 hold no
    # 16 pairs, though 96 would (the check used to measure the whole sample)
    across = ["data.source=mqar", "data.mqar.query_window=2", "data.mqar.num_pairs=16", "data.mqar.num_keys=64",
              "data.mqar.num_values=64", "data.carry_state=true", "model.seq_length=96", "train.carry_grad_windows=3"]
    with pytest.raises(MQARConfigError, match=r"query_window=2: the window of 32 tokens"):
        check_mqar_run(load_config([TINY], across), SimpleNamespace(pipe=1))


def _train(rank, world, items, steps_first=None):
    import os
    import signal

    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    if steps_first:   # SIGUSR1 after that step, as a scheduler's warning: save and stop
        step_once = trainer.train_step

        def step_and_signal():
            loss = step_once()
            if trainer.step == steps_first and rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)
            return loss
        trainer.train_step = step_and_signal
    try:
        seen = []
        step = trainer._batch

        def record(dataset, indices):
            batch = step(dataset, indices)
            if dataset is trainer.train_data:   # not the validation's
                seen.append(batch.tolist())
            return batch
        trainer._batch = record
        losses = trainer.train()
        return losses, seen
    finally:
        trainer.close()


def mqar_items(save):
    return ["data.source=mqar", "data.mqar.num_pairs=4", "data.mqar.num_queries=4", "data.mqar.num_keys=16",
            "data.mqar.num_values=16", "train.precision=fp32", "train.zero_stage=1", "train.micro_batch_size=8",
            "train.global_batch_size=16", f"train.train_tokens={8 * 16 * 64}", "train.eval_interval=4",
            "train.eval_iters=1", "train.log_interval=4", f"train.save={save}", "train.save_interval=4",
            "optimizer.lr=3e-3", "optimizer.min_lr=3e-4", "optimizer.warmup_tokens=1024"]


def test_training_resumes_on_the_same_batches_and_eval_scores_the_checkpoint(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    losses, batches = run_distributed(_train, 2, args=(mqar_items(whole),), timeout=300)[0]
    first, seen_first = run_distributed(_train, 2, args=(mqar_items(parts), 4), timeout=300)[0]
    second, seen_second = run_distributed(_train, 2, args=(mqar_items(parts) + [f"train.load={parts}"],),
                                          timeout=300)[0]
    assert len(losses) == 8 and first + second == losses          # bit for bit across the resume
    assert seen_first + seen_second == batches                     # the same samples, in the same order
    # the validation split is its own stream: no validation sequence is a training one
    train = {tuple(row) for b in batches for row in b}
    task = MQARTask(64, 4, 4, 16, 16)
    assert not train & {tuple(task.sample(42, "valid", i).tolist()) for i in range(64)}

    done = subprocess.run([sys.executable, "-m", "megatron_id.cli", "eval", "mqar", "--checkpoint", str(whole),
                           "--samples", "100", "--device", "cpu", "--json"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(done.stdout)["results"]
    assert result["task"] == {"seq_length": 64, "num_pairs": 4, "num_queries": 4, "num_keys": 16, "num_values": 16,
                              "query_window": 0, "window": 0}
    assert result["answers"] == 400 and result["chance"] == 1 / 16 and result["seed"] == 42
    from megatron_id.model.accounting import report
    assert result["state_bytes_fp32"] == 4 * report(load_config([TINY], mqar_items(whole)).model).fixed_state > 0
    # the same score in-process from the checkpoint's weights (the command adds nothing of its own)
    from megatron_id.checkpoint.read import read_checkpoint
    from megatron_id.model.language_model import LanguageModel
    _, _, cfg, weights = read_checkpoint(whole)
    model = LanguageModel(cfg, seed=None)
    model.load_state_dict(weights)
    mine = score(model.eval(), task, seed=42, samples=100, batch_size=8)
    assert mine["accuracy"] == result["accuracy"] and mine["answer_loss"] == pytest.approx(result["answer_loss"])
    refused(["megatron_id.cli", "eval", "mqar", "--checkpoint", str(whole), "--num-pairs", "16", "--num-queries", "16",
             "--seq-length", "60"],
            mention=r"model.seq_length=60 is too short", unchanged=[whole])
