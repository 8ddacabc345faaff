"""Distillation in the trainer (train.distill, training/distill.py; issue 43 item 3).

The KL over vocabulary-sharded logits against torch's; the refusals before any work; and one
end-to-end test on gloo ranks: a softmax teacher trained a few steps, a hybrid student (layer 0
interdomain, layer 1 softmax) distilled in stage layers (TP=1, and TP=2 with ZeRO-2: the same
losses within 1e-5, and nothing but the converted mixer moved) and in stage logits (TP=1, and
TP=2 killed with SIGKILL after step 5 then resumed from step 4: the same losses within 1e-5 of
TP=1, and the resumed step 5 bit for bit the killed run's)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import CONFIGS, ROOT
from distributed import RankError, run_distributed

from megatron_id.config import ConfigError, load_config
from megatron_id.parallel.layers import vocab_parallel_kl

GPT2 = ROOT / "tests" / "data" / "gpt2-tokenizer.json"
TINY = CONFIGS / "model" / "tiny.yaml"


@pytest.mark.parametrize("temperature, chunk_rows", [(1.0, None), (2.5, None), (2.5, 2), (1.0, 4)])
def test_the_kl_over_sharded_logits_is_torchs_and_ignores_the_padding(temperature, chunk_rows, monkeypatch):
    """Against torch's kl_div, in one chunk of tokens and in chunks of 2 and 4 of the 6 tokens
    (the last one short): the per-token KL and the student's gradient."""
    from megatron_id.parallel import layers
    if chunk_rows:
        monkeypatch.setattr(layers, "KL_CHUNK_ELEMENTS", chunk_rows * 16)
    torch.manual_seed(0)
    vocab, padded = 11, 16
    student = torch.randn(2, 3, padded, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 3, padded, dtype=torch.float64)
    teacher[..., vocab:] = 50.0   # padding: must not count, however large
    kl = vocab_parallel_kl(student, teacher, None, vocab, temperature)
    reference_student = student[..., :vocab] / temperature
    expected = F.kl_div(F.log_softmax(reference_student, -1), F.log_softmax(teacher[..., :vocab] / temperature, -1),
                        log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(kl, expected.float(), rtol=1e-5, atol=1e-6)   # float32 inside
    weights = torch.rand(2, 3, dtype=torch.float64)
    (kl.double() * weights).sum().backward()
    mine = student.grad.clone()
    student.grad = None
    (expected * weights).sum().backward()
    torch.testing.assert_close(mine, student.grad, rtol=1e-5, atol=1e-7)
    assert torch.all(mine[..., vocab:] == 0)


def _items(prefix, save, *extra):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", f"data.tokenizer={GPT2}", "model.vocab_size=50257",
            f"train.save={save}", "train.precision=fp32", "train.micro_batch_size=1", "train.global_batch_size=2",
            "train.eval_iters=0", "train.log_interval=1", "optimizer.warmup_tokens=0", "optimizer.lr=1e-2",
            "train.check_host_memory=false", *extra]


@pytest.mark.parametrize("setting, mention", [
    ("parallel.pipeline_model_parallel_size=2", "pipeline_model_parallel_size=2: the teacher would need"),
    ("train.zero_stage=3", "train.zero_stage=3: ZeRO-3"),
    ("train.fused_lm_head_loss=true", "fused_lm_head_loss=true: the KL needs"),
    ("parallel.sequence_parallel=true", "sequence_parallel=true: stage layers"),
])
def test_what_cannot_run_beside_a_teacher_is_refused_from_the_config(setting, mention, tmp_path):
    from megatron_id.training.layout import training_layout
    cfg = load_config([TINY], ["model.layer_pattern=IA", "parallel.tensor_model_parallel_size=2",
                               f"train.distill.teacher={tmp_path}", "train.distill.stage=layers",
                               "train.global_batch_size=4", setting])
    with pytest.raises(ConfigError, match=mention):
        training_layout(cfg, 4)


def _train(rank, world, items, kill_after=None, record=None):
    """Trainer.train() as the CLI runs it; kill_after: rank 0 writes the losses so far to
    `record` and is killed with SIGKILL after that step."""
    import signal

    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    if kill_after:
        step, seen = trainer.train_step, []

        def step_then_die():
            seen.append(step())
            if trainer.step == kill_after and rank == 0:
                Path(record).write_text(json.dumps([float(x).hex() for x in seen]))
                os.kill(os.getpid(), signal.SIGKILL)
            return seen[-1]
        trainer.train_step = step_then_die
    try:
        start = trainer.step
        return start, trainer.train()
    finally:
        trainer.close()


def _close(a, b, rel=1e-5):
    assert len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-9) for x, y in zip(a, b)), (a, b)


@pytest.fixture(scope="module")
def teacher(fineweb_prefix, tmp_path_factory):
    """A tiny softmax model trained 3 steps (its checkpoint folder)."""
    save = tmp_path_factory.mktemp("teacher") / "ckpt"
    run_distributed(_train, 1, (_items(fineweb_prefix, save, "model.mixer=softmax", "train.train_tokens=384"),),
                    timeout=300)
    return save


def test_a_teacher_the_student_cannot_follow_is_refused_before_any_work(teacher, tmp_path):
    from megatron_id.training.distill import check_teacher
    cases = [(["model.layer_pattern=IA", "model.vocab_size=50000"], "has model.vocab_size=50257 and the student 50000"),
             (["model.layer_pattern=IA", "model.make_vocab_size_divisible_by=0"],
              r"pads its vocabulary to 50304 rows at TP=1 \(model.make_vocab_size_divisible_by=128\) and the student "
              r"to 50257 .* set model.make_vocab_size_divisible_by=128 for the student"),
             (["model.layer_pattern=IAA", "model.n_layers=3", "train.distill.stage=layers"],
              r"n_layers=3 \(teacher 2\)"),
             (["model.mixer=softmax", "train.distill.stage=layers"], "there are none"),
             (["model.layer_pattern=IA", f"train.distill.teacher={tmp_path / 'nowhere'}"], "does not exist"),
             (["model.layer_pattern=IA", f"train.distill.teacher={tmp_path}"],
              "neither a training checkpoint nor a transformers folder")]
    for extra, mention in cases:
        cfg = load_config([TINY], [f"train.distill.teacher={teacher}", "model.vocab_size=50257", *extra])
        with pytest.raises(ConfigError, match=mention):
            check_teacher(cfg, 1)


@pytest.mark.slow
def test_distillation_at_tp2_equals_tp1_trains_only_the_converted_mixer_and_resumes_exactly(
        fineweb_prefix, teacher, tmp_path, capfd):
    """... and the console and the metrics file say what each stage's loss is made of (issue 57):
    stage logits the KL and the next-token loss apart (loss = kl_weight x T^2 x KL + lm_weight x
    LM), its perplexity the next-token loss's (it was exp of the whole objective); stage layers
    the MSE, with no perplexity."""
    from megatron_id.checkpoint.read import read_checkpoint
    from megatron_id.model import LanguageModel
    student = ["model.layer_pattern=IA", f"train.distill.teacher={teacher}", "train.distill.temperature=2",
               "train.train_tokens=640"]   # 5 steps of 2 x 64 tokens

    def run(name, world, *extra, kill_after=None, record=None):
        return run_distributed(_train, world, (_items(fineweb_prefix, tmp_path / name, *student, *extra), kill_after,
                                               record), timeout=300)[0]

    # stage layers: the MSE of layer 0's interdomain mixer against the teacher's attention
    _, layers_1 = run("layers1", 1, "train.distill.stage=layers", f"train.metrics_file={tmp_path / 'layers.jsonl'}")
    row = json.loads((tmp_path / "layers.jsonl").read_text().splitlines()[0])
    assert "train/perplexity" not in row and "train/distill_kl" not in row and row["train/loss"] > 0
    assert f"loss {row['train/loss']:.6f} (mse of the converted mixers) |" in capfd.readouterr().err
    _, layers_2 = run("layers2", 2, "train.distill.stage=layers", "parallel.tensor_model_parallel_size=2",
                      "train.zero_stage=2")
    assert layers_1[-1] < layers_1[0]
    _close(layers_1, layers_2)
    _, _, cfg, trained = read_checkpoint(tmp_path / "layers2")
    initial = LanguageModel(cfg, seed=42).state_dict()
    moved = {name for name, tensor in trained.items() if not torch.equal(tensor, initial[name])}
    assert moved and all(name.startswith("layers.0.mixer.") for name in moved), sorted(moved)

    # stage logits at TP=1; at TP=2 killed after step 5 (checkpoints at 2 and 4), then resumed
    logits = ["train.distill.stage=logits", "train.distill.lm_weight=0.5", "train.save_interval=2",
              "train.train_tokens=768"]   # 6 steps
    _, logits_1 = run("logits1", 1, *logits, f"train.metrics_file={tmp_path / 'logits.jsonl'}")
    err = capfd.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "logits.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        kl, lm = r["train/distill_kl"], r["train/lm_loss"]
        assert kl > 0 and 5 < lm < 15   # the converted student's own next-token loss, in nats
        assert math.isclose(r["train/loss"], 1.0 * 2 ** 2 * kl + 0.5 * lm, rel_tol=1e-5)
        assert math.isclose(r["train/perplexity"], math.exp(lm), rel_tol=1e-9)
        assert f"loss {r['train/loss']:.4f} (kl {kl:.4f}, lm {lm:.4f}) | ppl {math.exp(lm):.1f} |" in err, err
    record = tmp_path / "killed.json"
    with pytest.raises(RankError):
        run("logits2", 2, *logits, "parallel.tensor_model_parallel_size=2", kill_after=5, record=str(record))
    killed = [float.fromhex(x) for x in json.loads(record.read_text())]
    assert (tmp_path / "logits2" / "latest").read_text() == "iter_0000004"
    start, resumed = run("logits2", 2, *logits, "parallel.tensor_model_parallel_size=2",
                         f"train.load={tmp_path / 'logits2'}")
    assert start == 4 and resumed[0] == killed[4]   # step 5, bit for bit
    _close(logits_1, killed[:4] + resumed)
    assert logits_1[-1] < logits_1[0]


def test_finetune_starts_a_new_run_at_step_0_from_another_runs_weights_and_a_bf16_teacher_follows(
        fineweb_prefix, teacher, tmp_path):
    """train.finetune: the teacher's step-3 weights, step 0, the run's own batch size. Distilled
    from itself in bfloat16 (KL alone): the KL is bf16's rounding, not the nats of a random model."""
    from megatron_id.checkpoint.read import read_checkpoint
    save = tmp_path / "ft"
    items = _items(fineweb_prefix, save, "model.mixer=softmax", "train.finetune=true", f"train.load={teacher}",
                   "train.global_batch_size=4", "train.train_tokens=256", "optimizer.lr=1e-9", "optimizer.min_lr=0",
                   f"train.distill.teacher={teacher}", "train.distill.lm_weight=0",
                   "train.distill.teacher_dtype=bfloat16")
    start, losses = run_distributed(_train, 1, (items,), timeout=300)[0]
    assert start == 0 and len(losses) == 1
    assert 0 < losses[0] < 1e-2, losses
    _, client, _, weights = read_checkpoint(save)
    _, _, _, taught = read_checkpoint(teacher)
    assert client.step == 1
    assert max((weights[k] - taught[k]).abs().max().item() for k in taught) < 1e-6   # lr 1e-9: the teacher's

