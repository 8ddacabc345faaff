"""The fused, chunked LM head + vocab-parallel cross entropy (parallel/fused_cross_entropy.py,
train.fused_lm_head_loss) against its naive reference, today's unfused path: the loss and the
gradients for h and the weight shard (< 1e-5 relative in float32) with chunks that do not
divide the tokens, padded vocabulary and a loss mask; through a whole tiny model (every
parameter, tied and untied) at TP=1 and TP=2 (with sequence parallelism); under bf16 autocast
(stated tolerances); and the trainer with the switch on and off (equal losses over 3 steps at
TP=1, TP=2 and PP=2) (issue 16, item 4)."""
import pytest
import torch
import torch.distributed as dist
from conftest import CONFIGS, relative_error
from distributed import run_distributed

from megatron_id.config import ConfigError, load_config
from megatron_id.parallel.fused_cross_entropy import fused_lm_head_loss, lm_head_loss, masked_mean, naive_lm_head_loss
from megatron_id.parallel.layers import vocab_parallel_cross_entropy

TOL = 1e-5   # float32


def _inputs(B, N, d, rows, vocab, mask, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, N, d, generator=g, dtype=dtype)
    w = torch.randn(rows, d, generator=g, dtype=dtype) * 0.5
    target = torch.randint(0, vocab, (B, N), generator=g)
    m = {"none": None, "random": (torch.rand(B, N, generator=g) > 0.4).float(),
         "all_zero": torch.zeros(B, N)}[mask]
    return h, w, target, m


def _loss_and_grads(fn, h, w, target, mask, scale=2.5, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h, w, target, None, kw.pop("vocab"), mask, **kw)
    (loss * scale).backward()   # an upstream gradient that is not 1 (DeepSpeed scales losses)
    return loss.detach(), h.grad, w.grad


# (B, N, d, weight rows, vocab_size, mask, chunk): ids say what each case covers
CASES = {
    "chunk_does_not_divide": (2, 19, 16, 64, 64, "none", 8),
    "padded_vocabulary": (2, 19, 16, 64, 50, "none", 10),
    "loss_mask": (2, 19, 16, 64, 50, "random", 16),
    "mask_all_zero": (1, 7, 16, 64, 50, "all_zero", 4),
    "chunk_larger_than_tokens": (1, 5, 16, 64, 60, "random", 64),
    "one_token_chunks": (1, 9, 8, 32, 30, "none", 1),
    "default_chunk": (2, 19, 16, 64, 50, "random", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_the_unfused_loss_and_gradients(case):
    B, N, d, rows, vocab, mask_kind, chunk = CASES[case]
    h, w, target, mask = _inputs(B, N, d, rows, vocab, mask_kind)
    want = _loss_and_grads(naive_lm_head_loss, h, w, target, mask, vocab=vocab)
    got = _loss_and_grads(fused_lm_head_loss, h, w, target, mask, vocab=vocab, chunk_size=chunk)
    for name, a, b in zip(("loss", "dh", "dW"), got, want):
        assert relative_error(a, b) < TOL, (case, name, relative_error(a, b))
    assert torch.all(got[2][vocab:] == 0)   # padding rows get no gradient


def test_normalizer_gives_sum_over_normalizer():
    """Context parallelism's reduction: sum(mask x loss) / a given normalizer."""
    h, w, target, mask = _inputs(2, 11, 16, 64, 50, "random")
    normalizer = torch.tensor(3.7)

    def ref(h, w, t, group, vocab, m):
        return (vocab_parallel_cross_entropy(h @ w.t(), t, group, vocab) * m).sum() / normalizer
    want = _loss_and_grads(ref, h, w, target, mask, vocab=50)
    got = _loss_and_grads(fused_lm_head_loss, h, w, target, mask, vocab=50, chunk_size=6, normalizer=normalizer)
    for name, a, b in zip(("loss", "dh", "dW"), got, want):
        assert relative_error(a, b) < TOL, (name, relative_error(a, b))


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_bf16_autocast_matches_the_unfused_path(scale):
    """Under autocast both run the head's matmuls in bf16 and the softmax in float32. The loss
    agrees to float rounding (observed: bitwise). dW: the unfused path rounds it to bf16 once
    over all tokens, the fused one sums each chunk's bf16 dW in float32: bf16 rounding apart.
    dh: bitwise-close with an upstream gradient of 1; otherwise the unfused path rounds
    (upstream x dz) to bf16 and the fused one dz (its gradient made in forward): bf16 rounding."""
    h, w, target, mask = _inputs(2, 150, 64, 512, 500, "random")
    w = w * 0.2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss_and_grads(naive_lm_head_loss, h, w, target, mask, vocab=500, scale=scale)
        got = _loss_and_grads(fused_lm_head_loss, h, w, target, mask, vocab=500, scale=scale, chunk_size=64)
    assert got[1].dtype == got[2].dtype == torch.float32
    dh_tol = 1e-5 if scale == 1 else 1e-2
    for name, a, b, tol in zip(("loss", "dh", "dW"), got, want, (1e-5, dh_tol, 1e-2)):
        assert relative_error(a, b) < tol, (name, relative_error(a, b))


def test_without_autograd_and_a_frozen_weight():
    h, w, target, mask = _inputs(1, 13, 16, 64, 50, "random")
    want = naive_lm_head_loss(h, w, target, None, 50, mask)
    with torch.no_grad():   # evaluation: no gradient work, the same loss
        assert relative_error(fused_lm_head_loss(h, w, target, None, 50, mask, chunk_size=5), want) < TOL
    hr = h.clone().requires_grad_()
    loss = fused_lm_head_loss(hr, w, target, None, 50, mask, chunk_size=5)   # w needs no gradient
    (dh,) = torch.autograd.grad(loss, hr, retain_graph=True)
    (ref,) = torch.autograd.grad(naive_lm_head_loss(hr, w, target, None, 50, mask), hr)
    assert relative_error(dh, ref) < TOL
    with pytest.raises(RuntimeError, match="differentiated twice"):
        torch.autograd.grad(loss, hr)


def _tiny(*overrides):
    return load_config([CONFIGS / "model" / "tiny.yaml"], list(overrides)).model


def _model_losses(model, batch, vocab, mask, chunk):
    """(plain loss, its grads), (fused loss, its grads) of one model on one batch."""
    group = getattr(model, "tp_group", None)
    out = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        if fused:
            loss = lm_head_loss(model.lm_head, model(batch[:, :-1], return_hidden=True), batch[:, 1:], vocab, mask,
                                chunk_size=chunk)
        else:
            loss = masked_mean(vocab_parallel_cross_entropy(model(batch[:, :-1]), batch[:, 1:], group, vocab), mask)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


def _compare_models(results):
    for name, ((loss, grads), (fused_loss, fused_grads)) in results.items():
        assert relative_error(fused_loss, loss) < TOL, (name, fused_loss, loss)
        for p in grads:
            assert relative_error(fused_grads[p], grads[p]) < TOL, (name, p, relative_error(fused_grads[p], grads[p]))


MODEL_CASES = {"untied": [], "tied": ["model.tie_embeddings=true"]}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_whole_model_gradients_at_tp1(case):
    from megatron_id.model import LanguageModel
    cfg = _tiny("model.vocab_size=500", *MODEL_CASES[case])
    model = LanguageModel(cfg, seed=3)
    g = torch.Generator().manual_seed(5)
    batch = torch.randint(0, cfg.vocab_size, (2, 41), generator=g)
    mask = (torch.rand(2, 40, generator=g) > 0.2).float()
    _compare_models({case: _model_losses(model, batch, cfg.vocab_size, mask, chunk=24)})


def _tp2(rank, world):
    from megatron_id.parallel import mappings
    from megatron_id.parallel.tensor_parallel import parallel_model
    group = dist.group.WORLD
    out = {}
    # the function alone: each rank holds 40 rows of an 80-row head whose last 5 are padding
    h, w_full, target, mask = _inputs(2, 19, 16, 80, 75, "random")
    w = w_full.chunk(world)[rank]
    ref = _loss_and_grads(naive_lm_head_loss, h, w_full, target, mask, vocab=75)   # TP=1, whole vocabulary

    def fused_tp(h, w, target, _, vocab, mask, chunk_size):
        return fused_lm_head_loss(mappings.copy_to_region(h, group), w, target, group, vocab, mask,
                                  chunk_size=chunk_size)
    got = _loss_and_grads(fused_tp, h, w, target, mask, vocab=75, chunk_size=7)
    out["function"] = [relative_error(got[0], ref[0]), relative_error(got[1], ref[1]),
                       relative_error(got[2], ref[2].chunk(world)[rank])]
    # whole models: vocabulary 500 padded to 512 (rank 1 holds the padding), with and without SP
    g = torch.Generator().manual_seed(5)
    batch = torch.randint(0, 500, (2, 41), generator=g)
    mask = (torch.rand(2, 40, generator=g) > 0.2).float()
    batch[:, 0] = 499   # a target on each shard at least
    for name, overrides, sp in [("untied", [], False), ("untied+sp", [], True),
                                ("tied+sp", ["model.tie_embeddings=true"], True)]:
        cfg = _tiny("model.vocab_size=500", *overrides)
        model = parallel_model(cfg, group, seed=3, sequence_parallel=sp)
        out[name] = _model_losses(model, batch, cfg.vocab_size, mask, chunk=24)
    return out


def test_tp2_function_and_whole_model():
    for rank, result in enumerate(run_distributed(_tp2, 2, timeout=240)):
        assert max(result.pop("function")) < TOL, (rank, result)
        _compare_models(result)


def test_zero3_is_refused_with_the_keys():
    from megatron_id.training.layout import training_layout
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], ["train.zero_stage=3", "train.fused_lm_head_loss=true"])
    with pytest.raises(ConfigError, match=r"train\.fused_lm_head_loss=true .* train\.zero_stage=3"):
        training_layout(cfg, 1)


# ---------------------------------------------------------------- the trainer, switch on and off

def _items(prefix, tp, pp, fused, extra=()):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
            "train.zero_stage=1", "train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=4",
            f"train.train_tokens={3 * 4 * 64}", "optimizer.lr=1e-2", "optimizer.warmup_tokens=512",
            f"train.fused_lm_head_loss={fused}", *extra]


def _train(rank, world, runs):
    """Several trainers one after the other in the same processes: 3 steps each."""
    from megatron_id.training.engine import Trainer
    out = []
    for items in runs:
        trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
        out.append([(trainer.train_step(), trainer.grad_norm()) for _ in range(3)])
        trainer.close()
    return out


def _check_pairs(results, layouts, tol):
    for rank, runs in enumerate(results):
        for i, layout in enumerate(layouts):
            plain, fused = runs[2 * i], runs[2 * i + 1]
            for step, ((loss, norm), (want, want_norm)) in enumerate(zip(fused, plain)):
                assert abs(loss - want) <= tol * abs(want), (layout, rank, step, loss, want)
                assert abs(norm - want_norm) <= tol * want_norm, (layout, rank, step, norm, want_norm)


@pytest.mark.slow
def test_trainer_with_and_without_the_fused_loss_at_tp1(fineweb_prefix):
    layouts = {"tp1 fp32": [], "tp1 bf16": ["train.precision=bf16"]}
    runs = [_items(fineweb_prefix, 1, 1, fused, extra) for extra in layouts.values() for fused in ("false", "true")]
    results = run_distributed(_train, 1, args=(runs,), timeout=300)
    _check_pairs(results, ["tp1 fp32"], TOL)
    _check_pairs([r[2:] for r in results], ["tp1 bf16"], 1e-3)


@pytest.mark.slow
def test_trainer_with_and_without_the_fused_loss_at_tp2_pp2_and_cp2(fineweb_prefix):
    """TP=2 with sequence parallelism and a loss mask; PP=2 (the last stage's loss_fn applies
    the head) with tied embeddings and a loss mask; context parallelism (the loss normalised by
    the whole sample's count) with a loss mask."""
    mask = "data.eod_mask_loss=true"
    layouts = {"tp2 sp": (2, 1, ["parallel.sequence_parallel=true", mask]),
               "pp2 tied": (1, 2, ["model.tie_embeddings=true", mask]),
               "cp2": (1, 1, ["parallel.context_parallel_size=2", mask])}
    runs = [_items(fineweb_prefix, tp, pp, fused, extra) for tp, pp, extra in layouts.values()
            for fused in ("false", "true")]
    _check_pairs(run_distributed(_train, 2, args=(runs,), timeout=300), list(layouts), TOL)
