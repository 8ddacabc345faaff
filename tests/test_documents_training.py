"""Training on packed documents (data.reset_attention_mask, reset_position_ids, eod_mask_loss):
the switches reach the model and the loss, and TP=2 and PP=2 runs equal one process."""
import json

import pytest
from conftest import CONFIGS, ROOT
from distributed import run_distributed

from megatron_id.config import load_config

STEPS = 3
SWITCHES = ["data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true"]


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """FineWeb-Edu sentences as documents of ~10-40 tokens, each ending with <|endoftext|>: a
    64-token sample packs several, so every switch matters."""
    from data_tools.preprocess import main as preprocess
    folder = tmp_path_factory.mktemp("short")
    sentences = []
    with open(ROOT / "tests/data/fineweb-edu-sample-150.jsonl") as f:
        for line in f:
            sentences += [s.strip() for s in json.loads(line)["text"].split(". ") if len(s.split()) > 3]
    with open(folder / "sentences.jsonl", "w") as f:
        for s in sentences[:1500]:
            f.write(json.dumps({"text": s + "."}) + "\n")
    out = folder / "short"
    assert preprocess(["--input", str(folder / "sentences.jsonl"), "--tokenizer",
                       str(ROOT / "tests/data/gpt2-tokenizer.json"), "--output-prefix", str(out),
                       "--append-eod", "--no-progress"]) == 0
    return f"{out}_text_document"


def overrides(prefix, tp=1, pp=1, extra=()):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
            "train.zero_stage=0", "train.precision=fp32", "train.micro_batch_size=2",
            "train.global_batch_size=4", f"train.train_tokens={STEPS * 4 * 64}", "optimizer.lr=1e-2",
            "optimizer.warmup_tokens=512", "optimizer.min_lr=1e-3", *extra]


def _train(rank, world, items):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
    return [trainer.train_step() for _ in range(STEPS)]


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["interdomain"])   # softmax's block-diagonal mask: tests/test_documents.py
def test_packed_document_switches_train_alike_at_tp2_and_pp2(short_documents, mixer):
    items = lambda *a, **k: overrides(short_documents, *a, **k, extra=[f"model.mixer={mixer}", *SWITCHES])
    reference = run_distributed(_train, 1, args=(items(),), timeout=300)[0]
    plain = run_distributed(_train, 1, args=(overrides(short_documents, extra=[f"model.mixer={mixer}"]),),
                            timeout=300)[0]
    deviation = lambda losses: max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    worst = 0.0
    for tp, pp in [(2, 1), (1, 2)]:
        for rank, losses in enumerate(run_distributed(_train, 2, args=(items(tp, pp),), timeout=300)):
            assert deviation(losses) <= 1e-4, (tp, pp, rank, losses, reference)
            worst = max(worst, deviation(losses))
    # the switches change what is trained (masked EOD targets, documents that no longer read
    # each other; at init every token's loss is near log V, so the change starts small): the
    # layouts agree far better than switches on and off do
    assert deviation(plain) > max(20 * worst, 1e-5), (plain, reference, worst)


def test_switches_without_an_eod_id_fail_naming_the_prefix_and_the_fix(tmp_path):
    """Data written without --append-eod records no EOD id: the run stops before any work."""
    from data_tools.preprocess import main as preprocess
    from megatron_id.data.gpt_dataset import DataConfigError
    from megatron_id.training.documents import DocumentOptions
    out = tmp_path / "noeod"
    assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"), "--tokenizer",
                       str(ROOT / "tests/data/gpt2-tokenizer.json"), "--output-prefix", str(out),
                       "--no-progress"]) == 0
    data = load_config([CONFIGS / "model" / "tiny.yaml"],
                       [f"data.data_path=[{out}_text_document]", "data.eod_mask_loss=true"]).data
    with pytest.raises(DataConfigError, match=r"noeod_text_document\.meta\.json.*data\.eod_token_id"):
        DocumentOptions.from_config(data)
    data.eod_token_id = 50256   # an id none of its documents ends with finds no document either
    with pytest.raises(DataConfigError, match=r"data.eod_token_id=50256 ends none of the first 64 documents"):
        DocumentOptions.from_config(data)
    data.eod_mask_loss = False
    assert not DocumentOptions.from_config(data).active   # all off: nothing read, nothing needed
