"""The one training loss (training/loss.py, issue 42): its value on tiny tensors against a direct
computation for every path (plain, packed-document EOD mask, MQAR answers, the vocab padding,
the fused LM head, context parallelism's normalisation, the pipeline's last stage), and, through
real Trainers, that every engine path calls the one object the Trainer built."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import CONFIGS, relative_error
from distributed import run_distributed

from megatron_id.config import load_config
from megatron_id.data.mqar import MQARTask
from megatron_id.parallel import state
from megatron_id.parallel.context_parallel import ContextParallel, split_sequence
from megatron_id.parallel.fused_cross_entropy import masked_mean
from megatron_id.parallel.layers import vocab_parallel_cross_entropy
from megatron_id.parallel.pipeline import HeadStage, pipeline_model
from megatron_id.training.distributed import skip_deepspeed_shm_build
from megatron_id.training.documents import DocumentOptions
from megatron_id.training.loss import LanguageModelLoss

TOL = 1e-6
VOCAB, PADDED = 50, 64   # logits carry the TP padding; its columns never count


def _batch(B=2, N=12, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, N + 1), generator=g)
    tokens[0, 4] = tokens[1, 7] = 0   # EOD (id 0) inside the samples
    return tokens[:, :-1], tokens[:, 1:], torch.randn(B, N, d, generator=g), torch.randn(PADDED, d, generator=g)


def _direct(logits, labels, mask=None):
    """The masked mean of the plain cross entropy over the real vocabulary."""
    per_token = F.cross_entropy(logits[..., :VOCAB].flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    if mask is None:
        return per_token.mean()
    return (per_token * mask).sum() / mask.sum()


def test_the_mask_counts_what_the_config_says():
    inputs, *_ = _batch()
    assert LanguageModelLoss(VOCAB).mask(inputs) is None
    eod = DocumentOptions(eod_mask_loss=True, eod_id=0)
    assert torch.equal(LanguageModelLoss(VOCAB, documents=eod).mask(inputs), (inputs != 0).float())
    task = MQARTask(seq_length=12, num_pairs=2, num_queries=2, num_keys=10, num_values=10)
    answers = task.answer_mask(inputs)
    assert torch.equal(LanguageModelLoss(VOCAB, mqar=task).mask(inputs), answers)
    both = LanguageModelLoss(VOCAB, documents=eod, mqar=task).mask(inputs)
    assert torch.equal(both, (inputs != 0).float() * answers)


def test_from_config_reads_vocab_masks_mqar_and_the_fused_switch():
    loss = LanguageModelLoss.from_config(load_config([CONFIGS / "model" / "tiny.yaml"],
                                                     ["data.eod_mask_loss=true", "data.eod_token_id=0",
                                                      "train.fused_lm_head_loss=true"]), None)
    assert (loss.vocab_size, loss.fused, loss.documents.eod_id, loss.mqar) == (512, True, 0, None)
    mqar = LanguageModelLoss.from_config(load_config([CONFIGS / "model" / "tiny.yaml"], ["data.source=mqar"]), None)
    assert mqar.mqar is not None and not mqar.fused and not mqar.documents.active


@pytest.mark.parametrize("masked", [False, True])
def test_plain_path_is_the_masked_cross_entropy(masked):
    inputs, labels, h, w = _batch()
    logits = F.linear(h, w)
    loss = LanguageModelLoss(VOCAB, documents=DocumentOptions(eod_mask_loss=masked, eod_id=0))
    mask = loss.mask(inputs)
    got = loss(logits, labels, mask)
    assert relative_error(got, _direct(logits, labels, mask)) < TOL
    # the very operations the engines ran before the loss had a home: bit for bit
    assert torch.equal(got, masked_mean(vocab_parallel_cross_entropy(logits, labels, None, VOCAB), mask))


@pytest.mark.parametrize("masked", [False, True])
def test_fused_path_applies_the_head(masked):
    inputs, labels, h, w = _batch()
    head = torch.nn.Linear(8, PADDED, bias=False)
    with torch.no_grad():
        head.weight.copy_(w)
    h.requires_grad_(True)
    loss = LanguageModelLoss(VOCAB, documents=DocumentOptions(eod_mask_loss=masked, eod_id=0), fused=True)
    mask = loss.mask(inputs)
    got = loss(h, labels, mask, lm_head=head)
    (dh,) = torch.autograd.grad(got, h)
    want = _direct(F.linear(h, w), labels, mask)
    (want_dh,) = torch.autograd.grad(want, h)
    assert relative_error(got, want) < 1e-5 and relative_error(dh, want_dh) < 1e-5
    with pytest.raises(ValueError, match="lm_head"):
        loss(h, labels, mask)


def _context_parallel(rank, world, fused):
    """Each rank's loss on its block; returns them with the whole-sample direct loss."""
    cp = ContextParallel(dist.group.WORLD, rank, world)
    inputs, labels, h, w = _batch(N=16)
    mask = (inputs != 0).float()
    head = torch.nn.Linear(8, PADDED, bias=False)
    with torch.no_grad():
        head.weight.copy_(w)
    loss = LanguageModelLoss(VOCAB, context=cp, fused=fused)
    block = [split_sequence(x, cp) for x in (h, labels, mask)]
    if fused:
        got = loss(*block, lm_head=head)
    else:
        got = loss(F.linear(block[0], w), *block[1:])
    return got.item(), _direct(F.linear(h, w), labels, mask).item()


@pytest.mark.parametrize("fused", [False, True])
def test_context_parallel_ranks_average_to_the_whole_sample(fused):
    """DeepSpeed averages over the C ranks of a sample: that average is the sample's masked mean."""
    results = run_distributed(_context_parallel, 2, args=(fused,), timeout=120)
    mean = sum(r[0] for r in results) / len(results)
    assert abs(mean - results[0][1]) <= 1e-5 * abs(results[0][1])


class _Recording(LanguageModelLoss):
    """The loss, recording each call's arguments and value."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def __call__(self, output, labels, mask=None, *, lm_head=None):
        value = super().__call__(output, labels, mask, lm_head=lm_head)
        self.calls.append((mask, lm_head, value.detach()))
        return value


def _pipeline_stage(rank, world):
    """The pipeline's last stage (PP=1 here: one stage is first and last) hands DeepSpeed's
    (output, labels) to the loss it was given, unpacking packed documents' (labels, mask)."""
    import deepspeed
    skip_deepspeed_shm_build()   # as the Trainer does before DeepSpeed adopts the group
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], []).model
    state.initialize_model_parallel(1, 1)
    out = {}
    for fused in (False, True):
        loss = _Recording(cfg.vocab_size, state.get_tensor_model_parallel_group(), fused=fused)
        module = pipeline_model(cfg, state.get_topology(), state.get_tensor_model_parallel_group(), seed=0, loss=loss)
        g = torch.Generator().manual_seed(1)
        output = torch.randn(2, 6, cfg.d_model if fused else cfg.vocab_size, generator=g)
        labels = torch.randint(0, cfg.vocab_size, (2, 6), generator=g)
        mask = (labels % 3 != 0).float()
        plain, packed = module.loss_fn(output, labels), module.loss_fn(output, (labels, mask))
        head = loss.calls[0][1]
        assert (head is not None) == fused
        if fused:   # the last stage's own head
            assert head is (module.tied_modules["embed"].lm_head if cfg.tie_embeddings else
                            next(m for m in module.modules() if isinstance(m, HeadStage)).lm_head)
            output = head(output)
        assert [c[0] is mask for c in loss.calls] == [False, True] and loss.calls[0][0] is None
        out[fused] = (plain.item(), packed.item(), _direct_full(output, labels, None).item(),
                      _direct_full(output, labels, mask).item())
    return out


def _direct_full(logits, labels, mask):
    per_token = F.cross_entropy(logits.detach().flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    return per_token.mean() if mask is None else (per_token * mask).sum() / mask.sum()


def test_the_pipeline_stage_calls_the_loss_it_is_given():
    (result,) = run_distributed(_pipeline_stage, 1, timeout=120)
    for fused, (plain, packed, want_plain, want_packed) in result.items():
        assert abs(plain - want_plain) <= 1e-5 * want_plain, fused
        assert abs(packed - want_packed) <= 1e-5 * want_packed, fused


# ---------------------------------------------------------------- every engine path, through the Trainer

def _train_recording(rank, world, runs):
    """One step and one evaluation of each run's Trainer, its LanguageModelLoss recording."""
    import megatron_id.training.engine as engine
    built = []

    class Built(_Recording):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    engine.LanguageModelLoss = Built
    out = []
    for items in runs:
        built.clear()
        trainer = engine.Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
        assert built == [trainer.loss], "one loss object per Trainer"
        loss = trainer.train_step()
        trained = list(trainer.loss.calls)
        trainer.evaluate()
        out.append(dict(loss=loss, calls=len(trained), evaluated=len(trainer.loss.calls) - len(trained),
                        masked=[c[0] is not None for c in trained], fused=[c[1] is not None for c in trained],
                        values=[c[2].item() for c in trained], pipelined=trainer.pipelined,
                        last_stage=not trainer.pipelined or trainer.engine.is_last_stage()))
        trainer.close()
    return out


def _items(prefix, *extra):
    return [f"data.data_path=[{prefix}]", "data.split=90,10,0", "model.vocab_size=50257", "train.zero_stage=1",
            "train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=4",
            f"train.train_tokens={4 * 64}", "train.eval_iters=1", *extra]


def _check(results, runs, masked_runs):
    for rank, per_run in enumerate(results):
        for name, got in zip(runs, per_run):
            if not got["last_stage"]:   # the pipeline's loss runs on its last stage only
                assert got["calls"] == 0, (name, rank)
                continue
            # global batch 4 of micro-batches of 2, one sample replica: 2 micro-batches a step
            assert got["calls"] == 2 and got["evaluated"] >= 1, (name, rank, got)
            assert all(got["masked"]) == (name in masked_runs), (name, rank, got)
            assert all(got["fused"]) == ("fused" in name), (name, rank, got)


@pytest.mark.slow
def test_every_single_rank_path_calls_the_trainers_loss(fineweb_prefix):
    """Plain, plain with the EOD mask, the fused head, MQAR's answers (DP=1: the step's loss is the
    mean of the loss object's values)."""
    mqar = ["data.source=mqar", "train.zero_stage=1", "train.precision=fp32", "train.micro_batch_size=2",
            "train.global_batch_size=4", f"train.train_tokens={4 * 64}", "train.eval_iters=1"]
    runs = {"plain": _items(fineweb_prefix), "eod mask": _items(fineweb_prefix, "data.eod_mask_loss=true"),
            "fused eod mask": _items(fineweb_prefix, "data.eod_mask_loss=true", "train.fused_lm_head_loss=true"),
            "mqar": mqar}
    results = run_distributed(_train_recording, 1, args=(list(runs.values()),), timeout=600)
    _check(results, runs, {"eod mask", "fused eod mask", "mqar"})
    for got in results[0]:
        assert abs(got["loss"] - sum(got["values"]) / len(got["values"])) <= 1e-6 * got["loss"]


@pytest.mark.slow
def test_context_parallel_and_pipeline_paths_call_the_trainers_loss(fineweb_prefix):
    m = "data.eod_mask_loss=true"
    runs = {"cp2 mask": _items(fineweb_prefix, m, "parallel.context_parallel_size=2"),
            "cp2 fused mask": _items(fineweb_prefix, m, "parallel.context_parallel_size=2",
                                     "train.fused_lm_head_loss=true"),
            "pp2 mask": _items(fineweb_prefix, m, "parallel.pipeline_model_parallel_size=2"),
            "pp2 fused mask": _items(fineweb_prefix, m, "parallel.pipeline_model_parallel_size=2",
                                     "model.tie_embeddings=true", "train.fused_lm_head_loss=true")}
    results = run_distributed(_train_recording, 2, args=(list(runs.values()),), timeout=600)
    _check(results, runs, set(runs))
