"""The DeepSpeed training step: equal losses across TP x DP layouts and ZeRO stages (issue 5,
plain engine; pipeline layouts are not built yet)."""
import pytest

from conftest import CONFIGS, ROOT
from distributed import run_distributed
from megatron_id.config import load_config

STEPS = 5


@pytest.fixture(scope="module")
def fineweb_prefix(tmp_path_factory):
    from data_tools.preprocess import main as preprocess
    out = tmp_path_factory.mktemp("data") / "fineweb"
    assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"),
                       "--tokenizer", str(ROOT / "tests/data/gpt2-tokenizer.json"),
                       "--output-prefix", str(out), "--append-eod", "--no-progress"]) == 0
    return f"{out}_text_document"


def overrides(prefix, tp, zero):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            f"parallel.tensor_model_parallel_size={tp}", f"train.zero_stage={zero}",
            "train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=4",
            f"train.train_tokens={STEPS * 4 * 64}", "optimizer.lr=1e-2", "optimizer.warmup_tokens=512",
            "optimizer.min_lr=1e-3"]


def _train(rank, world, items):
    from megatron_id.training.engine import Trainer
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], items)
    trainer = Trainer(cfg)
    return [trainer.train_step() for _ in range(STEPS)]


@pytest.mark.slow
def test_losses_equal_across_layouts_and_zero_stages(fineweb_prefix):
    reference = run_distributed(_train, 1, args=(overrides(fineweb_prefix, 1, 0),), timeout=300)[0]
    assert reference[0] > reference[-1]   # it learns: the comparison is not between constants
    for tp, world, zero in [(2, 2, 0), (1, 2, 0), (1, 2, 1), (1, 2, 2), (2, 4, 1)]:
        results = run_distributed(_train, world, args=(overrides(fineweb_prefix, tp, zero),), timeout=300)
        for rank, losses in enumerate(results):
            for step, (got, want) in enumerate(zip(losses, reference)):
                assert abs(got - want) <= 1e-4 * abs(want), (tp, world, zero, rank, step, got, want)
