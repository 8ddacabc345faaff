"""Tensor parallelism: every layer and the whole model at TP=2 and TP=4 equal TP=1.

Multi-process tests run on gloo (CPU) through tests/distributed.py, whose waits are bounded.
Each spawned run checks many things at once, because starting ranks costs seconds.
"""
import time

import pytest
import torch
import torch.distributed as dist
from conftest import CONFIGS, relative_error
from distributed import RankError, run_distributed

from megatron_id.config import load_config
from megatron_id.model import LanguageModel, lm_loss
from megatron_id.model.init import initialize
from megatron_id.model.layers import Embedding, Linear, RMSNorm
from megatron_id.parallel import (
    ColumnParallelLinear,
    LayoutError,
    PartialGradRMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_layout,
    check_model_split,
    check_sizes,
    gather_logits,
    merge_state_dicts,
    padded_vocab_size,
    parallelize,
    split_state_dict,
    state,
    vocab_parallel_cross_entropy,
)
from megatron_id.parallel.tensor_parallel import TP_ATTRIBUTES, parallel_model

TOL = 1e-5


def tiny(*overrides):
    base = ["model.vocab_size=500", "model.chunk_size=8"]   # 500: exercises vocabulary padding
    return load_config([CONFIGS / "model" / "tiny.yaml"], base + list(overrides)).model


# ---------------------------------------------------------------- harness

def _rank_one_fails(rank, world):
    if rank == 1:
        raise ValueError("rank one failed on purpose")
    dist.barrier()   # rank 0 would wait here forever without the harness
    return rank


def _everyone_hangs(rank, world):
    time.sleep(600)


def test_a_failing_rank_ends_the_test_with_its_error():
    start = time.monotonic()
    with pytest.raises(RankError, match="(?s)rank 1 of 2 raised.*rank one failed on purpose"):
        run_distributed(_rank_one_fails, 2, timeout=60)
    assert time.monotonic() - start < 60


def test_a_hung_run_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 3 s"):
        run_distributed(_everyone_hangs, 2, timeout=3)
    assert time.monotonic() - start < 30


# ---------------------------------------------------------------- errors before computation

def test_layouts_that_cannot_work_are_refused_up_front():
    with pytest.raises(LayoutError, match="world size 6 does not factor into TP=4 x PP=1"):
        check_sizes(6, tensor=4)
    with pytest.raises(LayoutError, match="world size 8 .* TP=2 x PP=3"):
        check_sizes(8, tensor=2, pipe=3)
    assert check_sizes(8, tensor=2, pipe=2) == 2
    with pytest.raises(LayoutError, match="model.n_heads=4 is not divisible by tensor parallel size 3"):
        check_model_split(tiny(), 3)
    with pytest.raises(LayoutError, match="model.n_heads=4 .* size 8"):
        check_layout(tiny(), 8, tensor=8, pipe=1, zero_stage=0)
    with pytest.raises(LayoutError, match="model.vocab_size=502 is not divisible by tensor parallel size 4"):
        check_model_split(tiny("model.vocab_size=502", "model.make_vocab_size_divisible_by=0"), 4)
    with pytest.raises(LayoutError, match="model.n_kv_heads=2 is not divisible by tensor parallel size 4"):
        check_model_split(tiny("model.mixer=softmax", "model.n_kv_heads=2"), 4)
    with pytest.raises(LayoutError, match="SwiGLU hidden size 250"):
        check_model_split(tiny("model.ffn_hidden=250"), 4)
    with pytest.raises(LayoutError, match="model.n_layers=2 cannot be divided into .*=4"):
        check_model_split(tiny(), 1, pipe=4)
    # the split rules check before touching anything
    model = LanguageModel(tiny(), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LayoutError):
        split_state_dict(model.state_dict(), model.cfg, 3)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_vocabulary_padding_rule():
    assert padded_vocab_size(tiny(), 1) == 512 and padded_vocab_size(tiny(), 4) == 512
    assert padded_vocab_size(tiny("model.vocab_size=50257"), 2) == 50432   # multiple of 256
    assert padded_vocab_size(tiny("model.make_vocab_size_divisible_by=0"), 4) == 500


# ---------------------------------------------------------------- split / merge

MIXER_CASES = [["model.mixer=interdomain"], ["model.mixer=s4d"], ["model.mixer=softmax"],
               ["model.query_readout=false"], ["model.dual_kv_input=false"], ["model.output_gate=true"],
               # grouped-query attention (4 kv heads for 8 query heads) with q/k/v biases
               ["model.mixer=softmax", "model.n_heads=8", "model.n_kv_heads=4", "model.qkv_bias=true"]]


@pytest.mark.parametrize("overrides", MIXER_CASES, ids=lambda o: "-".join(x.split("=")[-1] for x in o))
@pytest.mark.parametrize("tp", [2, 4])
def test_split_then_merge_is_exact(overrides, tp):
    cfg = tiny(*overrides)
    full = LanguageModel(cfg, seed=1).state_dict()
    shards = split_state_dict(full, cfg, tp)
    assert len(shards) == tp
    assert shards[0]["embed.weight"].shape[0] == padded_vocab_size(cfg, tp) // tp
    merged = merge_state_dicts(shards, cfg)
    assert set(merged) == set(full)
    for name in full:
        assert torch.equal(merged[name], full[name]), name
    shards[1]["layers.0.ffn_norm.weight"] += 1   # replicated copies must agree
    with pytest.raises(ValueError, match="replicated tensor 'layers.0.ffn_norm.weight' differs"):
        merge_state_dicts(shards, cfg)


# ---------------------------------------------------------------- layers vs plain torch

def _layers_against_torch(rank, world):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    randn = lambda *s: torch.randn(*s, generator=g)
    errors = {}

    def record(name, got, want):
        errors[name] = max(errors.get(name, 0.0), relative_error(got, want))

    # column-parallel: output features split, input grad all-reduced
    full = Linear(12, 8 * world, init_std=0.5)
    initialize(full, seed=1)
    x, gy = randn(2, 5, 12), randn(2, 5, 8 * world)
    xr = x.clone().requires_grad_()
    (full(xr) * gy).sum().backward()
    col = ColumnParallelLinear(full, group)
    xt = x.clone().requires_grad_()
    y = col(xt)
    cols = slice(rank * 8, (rank + 1) * 8)
    (y * gy[..., cols]).sum().backward()
    record("column output", y, full(x)[..., cols])
    record("column input grad", xt.grad, xr.grad)
    record("column weight grad", col.weight.grad, full.weight.grad[cols])

    # row-parallel: input features split, output all-reduced
    full = Linear(6 * world, 10, init_std=0.5)
    initialize(full, seed=2)
    x, gy = randn(3, 4, 6 * world), randn(3, 4, 10)
    xr = x.clone().requires_grad_()
    (full(xr) * gy).sum().backward()
    row = RowParallelLinear(full, group)
    feats = slice(rank * 6, (rank + 1) * 6)
    xt = x[..., feats].clone().requires_grad_()
    y = row(xt)
    (y * gy).sum().backward()
    record("row output", y, full(x))
    record("row input grad", xt.grad, xr.grad[..., feats])
    record("row weight grad", row.weight.grad, full.weight.grad[:, feats])

    # vocab-parallel embedding with padding (vocab 37 padded to a multiple of 4 x world)
    vocab = 37
    padded = -(-vocab // (4 * world)) * 4 * world
    full = Embedding(vocab, 6, init_std=1.0)
    initialize(full, seed=3)
    ids, gy = torch.randint(0, vocab, (3, 9), generator=g), randn(3, 9, 6)
    (full(ids) * gy).sum().backward()
    emb = VocabParallelEmbedding(full, group, padded)
    out = emb(ids)
    (out * gy).sum().backward()
    rows = padded // world
    lo, hi = rank * rows, min((rank + 1) * rows, vocab)
    record("embedding output", out, full(ids))
    record("embedding grad", emb.weight.grad[:max(hi - lo, 0)], full.weight.grad[lo:hi])
    errors["embedding padded rows grad"] = emb.weight.grad[max(hi - lo, 0):].abs().sum().item()

    # vocab-parallel cross entropy; the padded columns hold junk that must not count
    logits_full, target = randn(4, 7, vocab), torch.randint(0, vocab, (4, 7), generator=g)
    lr = logits_full.clone().requires_grad_()
    torch.nn.functional.cross_entropy(lr.reshape(-1, vocab), target.reshape(-1), reduction="sum").backward()
    junk = torch.cat([logits_full, 50 + randn(4, 7, padded - vocab)], dim=-1)
    local = junk[..., rank * rows:(rank + 1) * rows].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group, vocab)
    loss.sum().backward()
    want = torch.nn.functional.cross_entropy(logits_full.reshape(-1, vocab), target.reshape(-1),
                                             reduction="none").view(4, 7)
    record("cross entropy", loss, want)
    record("cross entropy grad", local.grad[..., :max(hi - lo, 0)], lr.grad[..., lo:hi])
    errors["cross entropy padded grad"] = local.grad[..., max(hi - lo, 0):].abs().sum().item()

    # a norm shared by heads that live on different ranks: grads summed over the group
    full = RMSNorm(5, eps=1e-6)
    with torch.no_grad():
        full.weight.copy_(randn(5))
    xs, gs = [randn(2, 3, 5) for _ in range(world)], [randn(2, 3, 5) for _ in range(world)]
    sum((full(x) * gy).sum() for x, gy in zip(xs, gs)).backward()
    part = PartialGradRMSNorm(RMSNorm(5, eps=1e-6), group)
    with torch.no_grad():
        part.weight.copy_(full.weight)
    (part(xs[rank]) * gs[rank]).sum().backward()
    record("shared norm output", part(xs[rank]), full(xs[rank]))
    record("shared norm grad", part.weight.grad, full.weight.grad)

    # the process-group layout and the mpu (TP peers are consecutive ranks)
    layout = {}
    if world == 4:
        with_error = None
        try:
            state.initialize_model_parallel(tensor_model_parallel_size=3)
        except LayoutError as err:
            with_error = str(err)
        layout["bad layout"] = with_error
        state.initialize_model_parallel(tensor_model_parallel_size=2)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=state.get_tensor_model_parallel_group())
        layout.update(tp_rank=state.get_tensor_model_parallel_rank(),
                      tp_size=state.get_model_parallel_world_size(),
                      dp_rank=state.get_data_parallel_rank(), dp_size=state.get_data_parallel_world_size(),
                      pp_size=state.get_pipe_parallel_world_size(), tp_sum=t.item())
        state.destroy_model_parallel()
    return errors, layout


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layers_match_torch(world):
    results = run_distributed(_layers_against_torch, world, timeout=240)
    for rank, (errors, layout) in enumerate(results):
        for name, err in errors.items():
            assert err < TOL, (rank, name, err)
        if world == 4:
            assert "world size 4 does not factor into TP=3" in layout["bad layout"]
            assert layout["tp_rank"] == rank % 2 and layout["tp_size"] == 2
            assert layout["dp_rank"] == rank // 2 and layout["dp_size"] == 2 and layout["pp_size"] == 1
            assert layout["tp_sum"] == {0: 1, 1: 1, 2: 5, 3: 5}[rank]   # peers: (0, 1) and (2, 3)


# ---------------------------------------------------------------- the whole model

MODEL_CASES = {
    "interdomain": [], "s4d": ["model.mixer=s4d"], "softmax": ["model.mixer=softmax"],
    "no_query_readout": ["model.query_readout=false"], "single_input": ["model.dual_kv_input=false"],
    "no_rope": ["model.rope=false"], "plain_gate": ["model.readout=plain", "model.output_gate=true"],
    "s4d_rope": ["model.mixer=s4d", "model.rope=true"], "tied": ["model.tie_embeddings=true"],
    "softmax_gqa_bias": ["model.mixer=softmax", "model.n_heads=8", "model.n_kv_heads=4", "model.qkv_bias=true"],
}
SP_CASES = ["interdomain", "s4d", "softmax", "no_query_readout", "tied", "softmax_gqa_bias"]
SEQ = 20   # not a multiple of the chunk (8); divisible by TP for sequence parallelism


def _batch(cfg):
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, cfg.vocab_size, (2, SEQ + 1), generator=g)


def _model_at_tp(rank, world, cases):
    group = dist.group.WORLD
    out = {}
    for name, overrides, sp in cases:
        cfg = tiny(*overrides)
        batch = _batch(cfg)
        model = parallelize(LanguageModel(cfg, seed=7), group, sequence_parallel=sp)
        logits_local = model(batch[:, :-1])
        losses = vocab_parallel_cross_entropy(logits_local, batch[:, 1:], group, cfg.vocab_size)
        loss = losses.mean()
        loss.backward()
        with torch.no_grad():
            logits = gather_logits(logits_local, group, cfg.vocab_size)
        # the same shard as the trainer builds it: on the meta device, materialised and
        # initialised afterwards (init slicing), ties and DeepSpeed's TP attributes kept
        late = parallel_model(cfg, group, seed=7, sequence_parallel=sp)
        assert (late.lm_head.weight is late.embed.weight) == cfg.tie_embeddings, name
        attributes = lambda m: {n: {k: getattr(p, k, None) for k in TP_ATTRIBUTES}  # noqa: E731
                                for n, p in m.named_parameters()}
        assert attributes(late) == attributes(model), name
        out[name] = dict(logits=logits if rank == 0 else None, loss=loss.item(),
                         grads={n: p.grad for n, p in model.named_parameters()},
                         late_init={n: p.detach() for n, p in late.named_parameters()})
    return out


@pytest.fixture(scope="module")
def tp1_reference():
    ref = {}
    for name, overrides in MODEL_CASES.items():
        cfg = tiny(*overrides)
        batch = _batch(cfg)
        model = LanguageModel(cfg, seed=7)
        logits = model(batch[:, :-1])
        loss = lm_loss(logits, batch[:, 1:])
        loss.backward()
        ref[name] = dict(cfg=cfg, logits=logits.detach(), loss=loss.item(),
                         grads={n: p.grad for n, p in model.named_parameters()},
                         weights={n: p.detach() for n, p in model.named_parameters()})
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_model_at_tp_equals_tp1(world, tp1_reference):
    cases = [(name, MODEL_CASES[name], False) for name in MODEL_CASES]
    cases += [(f"{name}+sp", MODEL_CASES[name], True) for name in SP_CASES]
    results = run_distributed(_model_at_tp, world, args=(cases,), timeout=600)
    for name, _, sp in cases:
        ref = tp1_reference[name.replace("+sp", "")]
        ranks = [r[name] for r in results]
        assert relative_error(ranks[0]["logits"], ref["logits"]) < TOL, (name, "logits")
        for r in ranks:
            assert abs(r["loss"] - ref["loss"]) < TOL * abs(ref["loss"]), (name, "loss")
        grads = merge_state_dicts([r["grads"] for r in ranks], ref["cfg"])   # replicated grads must agree
        assert set(grads) == set(ref["grads"])
        for pname, grad in ref["grads"].items():
            assert relative_error(grads[pname], grad) < TOL, (name, pname)
        late = merge_state_dicts([r["late_init"] for r in ranks], ref["cfg"])
        for pname, weight in ref["weights"].items():
            assert torch.equal(late[pname], weight), (name, "init", pname)


def _sequence_not_divisible(rank, world):
    model = parallelize(LanguageModel(tiny(), seed=0), dist.group.WORLD, sequence_parallel=True)
    model(torch.zeros(1, 7, dtype=torch.long))


def test_sequence_parallel_names_a_bad_length():
    with pytest.raises(RankError, match="sequence length 7; use a length divisible by 2"):
        run_distributed(_sequence_not_divisible, 2, timeout=60)
