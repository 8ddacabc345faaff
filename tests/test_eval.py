"""megatron-id eval (issue 14): perplexity equal to the trainer's own validation loss, from a
checkpoint saved at TP=2; identical JSON for the same seed and checkpoint; the length sweep of
a trained softmax model rises past its training length while the interdomain model's runs at
8x; the recall generators' documented formats; careless options refused."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bad_inputs import refused
from conftest import CONFIGS, ROOT
from distributed import run_distributed

from megatron_id.config import load_config
from megatron_id.data.tokenizer import load_tokenizer
from megatron_id.evaluation.recall import (
    FILLER,
    KEY_WORDS,
    NEEDLE,
    QUESTION,
    mqar,
    mqar_correct,
    passkey,
    passkey_correct,
)

GPT2 = ROOT / "tests" / "data" / "gpt2-tokenizer.json"
SHAKESPEARE = ROOT / "tests" / "data" / "tinyshakespeare-200k.txt"


def eval_cli(*args, timeout=600):
    done = subprocess.run([sys.executable, "-m", "megatron_id.cli", "eval", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _train_validate_save(rank, world, items, ckpt):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
    for _ in range(2):
        trainer.train_step()
    loss = trainer.evaluate()        # the trainer's first validation round: samples 0..7
    trainer.save_checkpoint(ckpt)
    return loss


@pytest.mark.slow
def test_perplexity_equals_the_trainers_validation_loss(fineweb_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    items = [f"data.data_path=[{fineweb_prefix}]", "data.split=90,10,0", f"data.tokenizer={GPT2}",
             "model.vocab_size=50257", "parallel.tensor_model_parallel_size=2", "train.precision=fp32",
             "train.micro_batch_size=2", "train.global_batch_size=4", f"train.train_tokens={4 * 4 * 64}",
             "train.eval_iters=2", f"train.save={ckpt}", "optimizer.lr=1e-2", "optimizer.warmup_tokens=256"]
    validation = run_distributed(_train_validate_save, 2, timeout=300, args=(items, ckpt))[0]
    done = eval_cli("perplexity", "--checkpoint", ckpt, "--json", "--batch-size", "3", "--chunk-size", "24")
    result = json.loads(done.stdout)["results"][0]
    assert result["count"] == 8 and result["split_name"] == "valid" and result["seq_length"] == 64
    assert abs(result["loss"] - validation) / validation < 1e-5, (result["loss"], validation)
    assert result["perplexity"] == pytest.approx(torch.tensor(validation).exp().item(), rel=1e-5)
    assert 0 < result["bits_per_byte"] < 20 and result["bytes"] > result["tokens"]
    # a range of the same samples: the first half alone differs from the whole
    half = json.loads(eval_cli("perplexity", "--checkpoint", ckpt, "--json", "--count", "4").stdout)["results"][0]
    assert half["count"] == 4 and half["loss"] != result["loss"]


@pytest.fixture(scope="module")
def trained_pair(tmp_path_factory):
    """A softmax and an interdomain tiny model (tiny.yaml: seq_length 64) with a 512-token BPE
    trained on the first 150,000 characters of Tiny Shakespeare, trained on 64-token windows of
    them (softmax 300 steps, interdomain 30: it only has to run at 8x), exported; and the
    held-out rest of the text."""
    from hf_tiny import MIXER_ITEMS, export_model

    from data_tools.train_tokenizer import main as train_tokenizer
    from megatron_id.model import LanguageModel
    root = tmp_path_factory.mktemp("trained")
    text = SHAKESPEARE.read_text(encoding="utf-8")
    (root / "train.txt").write_text(text[:150_000], encoding="utf-8")
    assert train_tokenizer(["--input", str(root / "train.txt"), "--vocab-size", "512",
                            "--output", str(root / "tokenizer.json")]) == 0
    tok = load_tokenizer(str(root / "tokenizer.json"))
    ids = torch.tensor(tok.encode(text[:150_000]).ids)
    out = {}
    for mixer, steps in (("softmax", 300), ("interdomain", 30)):
        cfg = load_config([CONFIGS / "model" / "tiny.yaml"], MIXER_ITEMS[mixer] + ["model.chunk_size=16"]).model
        torch.manual_seed(0)
        model = LanguageModel(cfg, seed=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(0)
        for _ in range(steps):
            starts = torch.randint(0, len(ids) - 65, (16,), generator=generator)
            batch = torch.stack([ids[s:s + 65] for s in starts])
            loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        out[mixer] = export_model(model.eval(), cfg, root / mixer, step=steps, tokenizer=root / "tokenizer.json")
    held_out = root / "held-out.txt"
    held_out.write_text(text[150_000:], encoding="utf-8")
    return out, held_out


@pytest.mark.slow
def test_length_sweep_softmax_rises_past_its_training_length(trained_pair, tmp_path):
    models, text = trained_pair
    done = eval_cli("length", "--checkpoint", models["softmax"], models["interdomain"], "--text", text,
                    "--factors", "1", "4", "8", "--max-tokens", "8192", "--bucket", "1", "--json",
                    "--out", tmp_path / "length")
    softmax, interdomain = json.loads(done.stdout)["results"]
    by = {c["factor"]: c for c in softmax["contexts"]}
    buckets = softmax["positions"]["buckets"]   # positions 0-63, 64-127, ... at 8x
    print("softmax by position bucket:", [round(b["perplexity"], 1) for b in buckets])
    print("interdomain:", [round(c["perplexity"], 1) for c in interdomain["contexts"]])
    assert by[8]["perplexity"] > 1.3 * by[1]["perplexity"]
    # positions 128 on (past 2x the training length) all above the trained range's perplexity
    assert min(b["perplexity"] for b in buckets[2:]) > 1.3 * buckets[0]["perplexity"]
    assert all(torch.isfinite(torch.tensor(c["perplexity"])) for c in interdomain["contexts"])
    assert interdomain["contexts"][-1]["context"] == 512
    assert (tmp_path / "length" / "results.png").stat().st_size > 10_000
    csv = (tmp_path / "length" / "results.csv").read_text().splitlines()
    assert csv[0].startswith("model,kind,") and len(csv) == 1 + 2 * (3 + 8)


@pytest.mark.slow
def test_eval_json_is_identical_for_the_same_seed_and_checkpoint(trained_pair, tmp_path):
    models, text = trained_pair
    outputs = []
    for run in range(2):
        out = tmp_path / f"run{run}"
        eval_cli("recall", "--checkpoint", models["interdomain"], models["softmax"], "--samples", "2",
                 "--factors", "1", "--depths", "0", "1", "--pairs", "2", "4", "--seed", "7", "--out", out)
        eval_cli("perplexity", "--checkpoint", models["interdomain"], "--text", text, "--max-tokens", "2048",
                 "--out", out / "ppl")
        outputs.append(((out / "results.json").read_bytes(), (out / "ppl" / "results.json").read_bytes()))
    assert outputs[0] == outputs[1]
    other = tmp_path / "seed8"
    eval_cli("recall", "--checkpoint", models["interdomain"], "--samples", "2", "--factors", "1", "--depths", "0",
             "--pairs", "2", "--seed", "8", "--out", other, "--task", "mqar")
    summary = json.loads(outputs[0][0])
    assert {r["name"] for r in summary["results"]} == {"interdomain", "softmax"}
    assert all(0 <= c["accuracy"] <= 1 for r in summary["results"] for c in r["passkey"] + r["mqar"])


def test_recall_generators_produce_the_documented_formats():
    tok = load_tokenizer(str(GPT2))
    for length in (40, 64, 300):
        for depth in (0, 0.5, 1):
            p = passkey(tok, length, depth, random.Random(f"{length}-{depth}"))
            assert p.length == len(p.ids) == length
            key = tok.decode(p.answers[0]).strip()
            assert re.fullmatch(r"\d{5}", key)
            assert p.text.endswith(" " + QUESTION) and NEEDLE.format(key=key) in p.text
            filler = p.text.replace(NEEDLE.format(key=key), "").replace(QUESTION, "")
            assert set(re.findall(r"[A-Z][^.]*\.", filler)) <= set(FILLER) | {""}
            before = p.text.index("The pass key is")
            share = before / max(len(p.text) - len(QUESTION) - len(NEEDLE.format(key=key)), 1)
            assert abs(share - depth) < 0.25, (length, depth, share)
    again = passkey(tok, 64, 0.5, random.Random("64-0.5"))
    assert again.ids == passkey(tok, 64, 0.5, random.Random("64-0.5")).ids   # the seed decides everything
    m = mqar(tok, 6, random.Random(3))
    pairs = re.fullmatch(r"((?:[a-z]+ \d\d, ){5}[a-z]+ \d\d)\. ((?:[a-z]+ \d\d, ){5}[a-z]+ \d\d)", m.text)
    assert pairs, m.text
    given = dict(x.split() for x in pairs.group(1).split(", "))
    asked = [x.split() for x in pairs.group(2).split(", ")]
    assert len(given) == 6 and set(given) <= set(KEY_WORDS) and {k for k, _ in asked} == set(given)
    assert [given[k] for k, _ in asked] == [v for _, v in asked]
    assert [tok.decode(m.ids[p:p + len(a)]) for p, a in zip(m.positions, m.answers)] == [f" {v}" for _, v in asked]
    with pytest.raises(ValueError, match="shorter than the needle"):
        passkey(tok, 10, 0.5, random.Random(0))


def test_careless_eval_options_are_refused(tmp_path):
    from hf_tiny import tiny_export
    export = tiny_export(tmp_path / "export")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    base = ["megatron_id.cli", "eval"]
    cases = [
        (["perplexity", "--checkpoint", export], r"no --data given and the checkpoint records no data\.data_path"),
        (["perplexity", "--checkpoint", export, "--text", tmp_path / "missing.txt"], r"missing\.txt: not found"),
        (["length", "--checkpoint", export, "--text", SHAKESPEARE, "--factors", "0"],
         r"--factors 0\.0 is out of range"),
        (["length", "--checkpoint", export, "--text", SHAKESPEARE, "--factors", "5000"], r"too few for one window"),
        (["recall", "--checkpoint", export, "--out", tmp_path / "busy", "--overwrite"],
         r"holds files that are not an earlier eval's results \(notes\.txt\)"),
        (["recall", "--checkpoint", export, "--name", "a", "b"], r"--name gives 2 names for 1 checkpoints"),
        (["recall", "--checkpoint", export, "--device", "cuda:3"] if not torch.cuda.is_available() else
         ["recall", "--checkpoint", export, "--depths", "2"], r"no CUDA device here|--depths 2\.0 is out of range"),
    ]
    for argv, mention in cases:
        refused([*base, *argv], mention=mention, unchanged=[tmp_path])


@pytest.mark.slow
def test_lm_eval_runs_local_tasks_on_a_tiny_export(tmp_path):
    """`megatron-id eval lm-eval-tasks` writes the two local tasks; lm_eval's own command runs
    them on an export (batch size 2) and reports finite metrics of every kind."""
    pytest.importorskip("lm_eval", reason="lm_eval is in the test extra: pip install -e '.[test]'")
    from hf_tiny import tiny_export
    export = tiny_export(tmp_path / "export")
    tasks = tmp_path / "tasks"
    done = subprocess.run([sys.executable, "-m", "megatron_id.cli", "eval", "lm-eval-tasks", "--text",
                           ROOT / "tests" / "data" / "fineweb-edu-sample-150.jsonl", SHAKESPEARE, "--out", tasks,
                           "--passages", "6", "--documents", "2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "wrote 6 last-word passages and 2 documents" in done.stdout, done.stderr
    script = shutil.which("lm_eval", path=str(Path(sys.executable).parent))   # its console script, beside us
    assert script, "lm_eval's command is not installed beside this Python"
    out = tmp_path / "lm_eval_out"
    run = subprocess.run([script, "--model", "hf", "--model_args", f"pretrained={export},trust_remote_code=True",
                          "--include_path", str(tasks), "--tasks", "megatron_id_lastword,megatron_id_rolling",
                          "--batch_size", "2", "--device", "cpu", "--output_path", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    lastword, rolling = results["megatron_id_lastword"], results["megatron_id_rolling"]
    for value in (lastword["perplexity,none"], rolling["word_perplexity,none"], rolling["byte_perplexity,none"],
                  rolling["bits_per_byte,none"]):
        assert value > 0 and value == value and value != float("inf"), results
    assert 0 <= lastword["acc,none"] <= 1


class Oracle:
    """A 'model' that knows the sequence: at every position its logits pick the true next id
    (`ids`), or a wrong one (`wrong`); it carries its position as the state, as the mixers do."""

    def __init__(self, ids, vocab=50257, wrong=False):
        self.ids, self.vocab, self.wrong = ids, vocab, wrong

    def __call__(self, tokens, states=None, return_states=True):
        start = states or 0
        logits = torch.zeros(1, tokens.shape[1], self.vocab)
        for i in range(tokens.shape[1]):
            nxt = self.ids[start + i + 1] if start + i + 1 < len(self.ids) else 0
            logits[0, i, (nxt + 1) % self.vocab if self.wrong else nxt] = 50.0
        return logits, start + tokens.shape[1]


def test_recall_scoring_against_an_oracle():
    """An oracle that always predicts the true next token scores 1 with loss ~0 on both probes,
    also when the prompt is fed in chunks; one that is always wrong scores 0 with a high loss."""
    tok = load_tokenizer(str(GPT2))
    p = passkey(tok, 100, 0.5, random.Random(0))
    m = mqar(tok, 8, random.Random(0))
    for chunk in (7, 2048):
        ok, loss = passkey_correct(Oracle(p.ids + p.answers[0]), p, "cpu", chunk)
        assert ok and loss < 1e-6
        hits, losses = mqar_correct(Oracle(m.ids), m, "cpu", chunk)
        assert hits == [True] * 8 and max(losses) < 1e-6
    ok, loss = passkey_correct(Oracle(p.ids + p.answers[0], wrong=True), p, "cpu")
    assert not ok and loss > 40
    hits, losses = mqar_correct(Oracle(m.ids, wrong=True), m, "cpu")
    assert not any(hits) and min(losses) > 40
