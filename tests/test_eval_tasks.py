"""train.eval_tasks (issue 53): `megatron-id eval` run on the model in training at every
validation gives the numbers `megatron-id eval` (and lm_eval on the export) gives on the
checkpoint saved at that step, at TP=2; training with it on loses exactly what it loses with it
off; careless entries are refused in one line before any work."""
from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

import pytest
from conftest import CONFIGS, ROOT
from distributed import run_distributed

from megatron_id.config import ConfigError, load_config
from megatron_id.training.downstream import check_eval_tasks, task_scalars

GPT2 = ROOT / "tests" / "data" / "gpt2-tokenizer.json"
SHAKESPEARE = ROOT / "tests" / "data" / "tinyshakespeare-200k.txt"
SAME = ("name", "checkpoint")   # `eval` adds these per checkpoint (and the mixer, which `eval mqar` reports)


def _parsed_eval(spec: str, checkpoint):
    """`megatron-id eval SPEC --checkpoint CHECKPOINT`'s arguments, by the command's own parser."""
    import argparse

    from megatron_id.commands.eval import add_parser
    from megatron_id.evaluation.run import check_args, check_sources
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", *shlex.split(spec), "--checkpoint", str(checkpoint)])
    check_args(args)
    check_sources(args)
    return args


def _on_checkpoint(spec: str, checkpoint, tokenizer) -> dict:
    from megatron_id.evaluation.run import evaluate
    if spec.startswith("lm-eval"):   # lm_eval's HFLM on the checkpoint's export
        from megatron_id.evaluation.lm_eval_model import export_lm, lm_eval_results
        from megatron_id.hf.export import export_hf
        from megatron_id.training.downstream import _parse
        args = _parse(shlex.split(spec))
        folder = export_hf(checkpoint, checkpoint.parent.parent / f"hf-{checkpoint.name}", tokenizer)
        return lm_eval_results(export_lm(folder, args.batch_size), args.include_path, args.tasks, args.limit)
    result = evaluate(_parsed_eval(spec, checkpoint))[0]
    added = SAME if spec.startswith("mqar") else (*SAME, "mixer")
    return {k: v for k, v in result.items() if k not in added}


def _train_and_evaluate(rank, world, items, save):
    from megatron_id.training.engine import Trainer
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], items)
    trainer = Trainer(cfg)
    losses = trainer.train()
    in_loop = trainer.downstream.last_results
    on_checkpoint = {}
    if rank == 0 and save is not None and in_loop is not None:
        for step in (2, 3):   # step 2: the cheap tasks only (lm_eval loads its tasks for ~10 s)
            folder = save / f"iter_{step:07d}"
            on_checkpoint[step] = {spec: _on_checkpoint(spec, folder, GPT2) for spec in cfg.train.eval_tasks
                                   if step == 3 or not spec.startswith("lm-eval")}
    trainer.close()
    return losses, in_loop, on_checkpoint


def _jsonl(path) -> dict:
    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_eval_tasks_equal_megatron_id_eval_on_the_saved_checkpoint(fineweb_prefix, tmp_path):
    pytest.importorskip("lm_eval", reason="lm_eval is in the test extra: pip install -e '.[test]'")
    from megatron_id.evaluation.lm_eval_tasks import write_tasks
    text = tmp_path / "val.txt"
    text.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    write_tasks([text.read_text()], tmp_path / "tasks", count=3, documents=1)
    tasks = ["recall --task passkey mqar --factors 1 --depths 0.5 --samples 2 --pairs 4",
             f"length --text {text} --factors 0.5 1 2 --max-tokens 256 --batch-size 2",
             f"lm-eval --include-path {tmp_path / 'tasks'} --tasks megatron_id_lastword megatron_id_rolling "
             f"--limit 2 --batch-size 2"]
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    items = [f"data.data_path=[{fineweb_prefix}]", "data.split=90,10,0", f"data.tokenizer={GPT2}",
             "model.vocab_size=50257", "parallel.tensor_model_parallel_size=2", "train.micro_batch_size=2",
             "train.global_batch_size=2", f"train.train_tokens={3 * 2 * 64}", "train.eval_iters=1",
             "train.eval_interval=3", "train.save_interval=2", f"train.save={save}", f"train.metrics_file={metrics}",
             "optimizer.lr=1e-2", "optimizer.warmup_tokens=0", f"train.eval_tasks=[{','.join(map(repr, tasks))}]"]
    _, in_loop, on_checkpoint = run_distributed(_train_and_evaluate, 2, timeout=300, args=(items, save))[0]
    # the last evaluation (step 3, the end), whole results: equal, not close
    assert set(in_loop) == set(tasks)
    for spec in tasks:
        assert in_loop[spec] == on_checkpoint[3][spec], spec
    # every logged scalar of the evaluation (step 3, the run's end) is that of `eval` on its checkpoint
    rows = _jsonl(metrics)
    for spec in tasks:
        args = SimpleNamespace(evaluation=shlex.split(spec)[0])
        for name, value in task_scalars(args, on_checkpoint[3][spec]).items():
            assert rows[3][name] == value, name
    assert "valid/loss" in rows[3] and "eval/passkey/accuracy" in rows[3] and "eval/length/loss_1x" in rows[3]
    assert "eval/megatron_id_rolling/bits_per_byte" in rows[3]
    assert not any(key.startswith("eval/") for key in rows[2])   # (train.eval_interval=3)
    # the comparison can fail: the step-2 checkpoint, one update earlier, scores otherwise
    length = tasks[1]
    assert on_checkpoint[2][length] != on_checkpoint[3][length] and in_loop[length] != on_checkpoint[2][length]


MQAR = ["data.source=mqar", "model.vocab_size=136", "train.micro_batch_size=2", "train.global_batch_size=2",
        f"train.train_tokens={4 * 2 * 64}", "train.eval_iters=1", "train.eval_interval=1",
        "optimizer.warmup_tokens=0"]


def test_training_is_the_same_with_eval_tasks_on_and_mqar_equals_eval_mqar(tmp_path):
    save = tmp_path / "ckpt"
    with_tasks = MQAR + ["train.eval_tasks=['mqar --samples 16 --batch-size 8']", f"train.save={save}",
                         "train.save_interval=2"]
    off, _, _ = run_distributed(_train_and_evaluate, 1, timeout=300, args=(MQAR, None))[0]
    on, in_loop, _ = run_distributed(_train_and_evaluate, 1, timeout=300, args=(with_tasks, None))[0]
    assert len(on) == 4 and on == off   # bit for bit: RNG, modes and data position untouched
    result = _on_checkpoint("mqar --samples 16 --batch-size 8", save / "iter_0000004", None)
    assert in_loop["mqar --samples 16 --batch-size 8"] == result


@pytest.mark.parametrize("entry, layout, message", [
    ("perplexity", {}, r"train\.eval_tasks\[0\]='perplexity' is not a task: each entry is one of recall, length, "
                       r"mqar, lm-eval"),
    ("recall --task nope", {}, r"train\.eval_tasks\[0\]='recall --task nope': argument --task: invalid choice"),
    ("recall --checkpoint x", {}, r"--checkpoint is set by the run"),
    ("mqar", {}, r"scores the generated task of data\.source=mqar"),
    ("recall", {"pipe": 2}, r"pipeline_model_parallel_size=2: the in-loop evaluations run at PP=1 only"),
    ("length --text /no/such.txt", {}, r"--text /no/such\.txt is not a file"),
    ("lm-eval --include-path /no/dir --tasks x", {}, r"--include-path /no/dir is not a folder"),
])
def test_careless_eval_tasks_are_refused_at_start(entry, layout, message):
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], [f"data.tokenizer={GPT2}"])
    cfg.train.eval_tasks = [entry]
    with pytest.raises(ConfigError, match=message) as error:
        check_eval_tasks(cfg, SimpleNamespace(**{"pipe": 1, **layout}))
    assert "\n" not in str(error.value)
