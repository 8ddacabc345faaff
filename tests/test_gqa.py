"""Grouped-query attention (model.n_kv_heads) and q/k/v biases (model.qkv_bias) in the softmax
mixer (issue 43): the forms against a naive reference (k and v repeated explicitly, then plain
causal softmax) in float64, multi-head attention unchanged bit for bit, TP=2 and CP=2 against
one process, decode against the full forward (eager and fused), the biases, the config's
refusals, the accounting and the Hugging Face export."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import CONFIGS, relative_error
from distributed import run_distributed

from megatron_id.config import ConfigError, load_config
from megatron_id.inference.fused_decode import FusedDecoder
from megatron_id.model import LanguageModel, lm_loss
from megatron_id.model.accounting import count_parameters, report
from megatron_id.model.layers import apply_rope
from megatron_id.parallel import LayoutError, check_model_split, merge_state_dicts, split_state_dict
from megatron_id.parallel.tensor_parallel import partition_dim
from megatron_id.training.optim import groups_by_name

VOCAB = 61
GQA = ["model.mixer=softmax", "model.n_heads=4", "model.n_kv_heads=2", "model.qkv_bias=true"]


def config(*items, d_model=32):
    return load_config([CONFIGS / "model" / "tiny.yaml"],
                       [f"model.vocab_size={VOCAB}", f"model.d_model={d_model}", "model.chunk_size=8",
                        *items]).model


def model_of(cfg, seed=1, dtype=torch.float64, biases=True):
    """LanguageModel(cfg) with its q/k/v biases (zero at init) drawn, so that they count."""
    model = LanguageModel(cfg, seed=seed).to(dtype)
    if biases:
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def tokens(B, N, seed=0):
    return torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(seed))


def naive_attention(mixer, x, seq_idx=None, window=None, rope_offset=0):
    """The reference: projections by hand, each kv head repeated for its query heads by index
    (query head i reads kv head i // G), a dense causal mask, softmax, W_O."""
    B, N, _ = x.shape
    Dh = mixer.head_dim
    linear = lambda p: x @ p.weight.T + (p.bias if p.bias is not None else 0)   # noqa: E731
    q, k, v = (linear(p).view(B, N, -1, Dh) for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
    if mixer.rope:
        q, k = apply_rope(q, rope_offset, mixer.rope_spec), apply_rope(k, rope_offset, mixer.rope_spec)
    H, Hkv = q.shape[2], k.shape[2]
    which = torch.tensor([i // (H // Hkv) for i in range(H)])
    k, v = k[:, :, which], v[:, :, which]                                          # [B, N, H, Dh]
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(Dh)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    mask = (j <= i)[None].expand(B, N, N)
    if window is not None:
        mask = mask & (i - j < window)[None]
    if seq_idx is not None:
        mask = mask & (seq_idx[:, :, None] == seq_idx[:, None, :])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(B, N, -1)
    return o @ mixer.o_proj.weight.T


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_the_forms_equal_the_naive_reference(kv):
    """Whole sequences (SDPA causal), packed documents and a window (the blockwise form), in
    float64, with biases; kv = 4: multi-head attention through the same reference."""
    cfg = config("model.layer_pattern=AW", "model.window=5", "model.n_heads=4", f"model.n_kv_heads={kv}",
                 "model.qkv_bias=true", "model.n_layers=2")
    model = model_of(cfg)
    x = torch.randn(2, 23, cfg.d_model, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    seq_idx = torch.tensor([[0] * 9 + [1] * 14, [0] * 3 + [1] * 12 + [2] * 8])
    for layer, window in zip(model.layers, (None, 5)):
        mixer = layer.mixer
        assert mixer.k_proj.weight.shape == (kv * cfg.d_model // 4, cfg.d_model)
        with torch.no_grad():
            assert relative_error(mixer(x), naive_attention(mixer, x, window=window)) < 1e-12, window
            assert relative_error(mixer(x, seq_idx=seq_idx), naive_attention(mixer, x, seq_idx, window)) < 1e-12


def test_multi_head_attention_is_unchanged_bit_for_bit():
    """n_kv_heads = n_heads builds the same parameters and computes the same numbers as a model
    without the key (no op is added on that path)."""
    x = tokens(2, 19)
    for items in (["model.mixer=softmax"], ["model.layer_pattern=AW", "model.window=4"]):
        plain, same = config(*items), config(*items, "model.n_kv_heads=4")
        a, b = LanguageModel(plain, seed=5), LanguageModel(same, seed=5)
        assert a.state_dict().keys() == b.state_dict().keys()
        assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
        with torch.no_grad():
            assert torch.equal(a(x), b(x))
            la, sa = a(x[:, :11], return_states=True)
            lb, sb = b(x[:, :11], return_states=True)
            assert torch.equal(la, lb) and all(torch.equal(s["k"], t["k"]) for s, t in zip(sa, sb))
            assert torch.equal(a(x[:, 11:12], states=sa), b(x[:, 11:12], states=sb))
        assert report(plain) == report(same)


@pytest.mark.parametrize("items", [GQA, ["model.layer_pattern=AWIA", "model.window=6", "model.n_layers=4",
                                         "model.n_kv_heads=1", "model.qkv_bias=true"]], ids=["softmax", "hybrid"])
def test_decode_equals_the_whole_sequence_eager_and_fused(items):
    """Prefill then one token at a time (the cache holds n_kv_heads heads), left padding, and the
    fused decoder's step, against the whole sequence."""
    cfg = config(*items)
    model = model_of(cfg).eval()
    x = tokens(2, 20, seed=3)
    Hkv, Dh = cfg.n_kv_heads, cfg.d_model // cfg.n_heads
    with torch.no_grad():
        whole = model(x)
        logits, states = model(x[:, :9], return_states=True)
        pieces = [logits]
        for t in range(9, 20):
            logits, states = model(x[:, t:t + 1], states=states, return_states=True)
            pieces.append(logits)
        assert relative_error(torch.cat(pieces, 1), whole) < 1e-12
        first = next(i for i, c in enumerate(model.cfg.layer_pattern or "A") if c == "A")
        assert states[first]["k"].shape == (2, 20, Hkv, Dh)
        # left padding: row 1 starts 4 tokens late; its real tokens give what they give alone
        padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), x[1:, :16]], 1)
        both = model(torch.cat([x[:1, :20], padded], 0), start=torch.tensor([0, 4]))
        assert relative_error(both[1, 4:], model(x[1:, :16])[0]) < 1e-12
        # the fused step (slot 1 of 2), its caches n_kv_heads wide
        _, states = model(x[1:, :9], return_states=True)
        decoder = FusedDecoder(model, slots=2, capacity=24, kernel="torch")
        cache = decoder.layers[first].buffers["k"]
        assert cache.shape == (2, Hkv, 24, Dh)
        decoder.load(1, states, 9)
        for t in range(9, 20):
            step = torch.zeros(2, dtype=torch.long)
            step[1] = x[1, t]
            assert relative_error(decoder.step(step)[1], whole[1, t]) < 1e-10, t


def test_the_biases_change_the_output_and_train():
    cfg = config(*GQA)
    zero, drawn = model_of(cfg, biases=False), model_of(cfg)
    x = tokens(2, 12)
    with torch.no_grad():
        assert relative_error(zero(x), drawn(x)) > 1e-3
    names = [n for n, _ in zero.named_parameters() if n.endswith(".bias")]
    assert names == [f"layers.{i}.mixer.{p}_proj.bias" for i in range(2) for p in "qkv"]
    assert all(not p.any() for n, p in zero.named_parameters() if n in names)   # zero at init
    lm_loss(zero(x[:, :-1]), x[:, 1:]).backward()
    grads = {n: p.grad for n, p in zero.named_parameters()}
    for name in names:   # (the key bias counts because RoPE turns it with the key's position)
        assert grads[name].abs().max() > 1e-6, name
    groups = groups_by_name(zero)
    assert {groups[n].value for n in names} == {"no_decay"} and groups["layers.0.mixer.q_proj.weight"].value == "decay"
    # TP roles: the biases are cut with their projections' output rows
    assert partition_dim("layers.0.mixer.k_proj.bias") == 0 and partition_dim("layers.1.mixer.q_proj.bias", cfg) == 0
    shards = split_state_dict(drawn.state_dict(), cfg, 2)
    assert shards[1]["layers.0.mixer.k_proj.bias"].shape == (cfg.d_model // 4,)   # one of the two kv heads
    merged = merge_state_dicts(shards, cfg)
    assert all(torch.equal(merged[k], v) for k, v in drawn.state_dict().items())


def test_the_config_refuses_what_cannot_be_meant():
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=3 is invalid: it must divide model.n_heads=4"):
        config("model.mixer=softmax", "model.n_kv_heads=3")
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=0 is invalid"):
        config("model.mixer=softmax", "model.n_kv_heads=0")
    for mixer in ("interdomain", "s4d"):
        with pytest.raises(ConfigError, match=rf"model.n_kv_heads=2 shapes softmax attention layers .* "
                                              rf"\(model.mixer={mixer}\) has none: remove model.n_kv_heads"):
            config(f"model.mixer={mixer}", "model.n_kv_heads=2")
        with pytest.raises(ConfigError, match=r"model.qkv_bias=true shapes .* remove model.qkv_bias"):
            config(f"model.mixer={mixer}", "model.qkv_bias=true")
    assert config("model.mixer=interdomain", "model.n_kv_heads=4").n_kv_heads == 4   # = n_heads: nothing changes
    # a hybrid: its softmax layers take them, its interdomain layers are left as they are
    hybrid = config("model.layer_pattern=IA", "model.n_layers=2", "model.n_kv_heads=1", "model.qkv_bias=true")
    names = LanguageModel(hybrid, seed=0).state_dict()
    assert "layers.1.mixer.k_proj.bias" in names and "layers.0.mixer.q_proj.bias" not in names
    assert names["layers.1.mixer.k_proj.weight"].shape[0] == hybrid.d_model // 4
    assert names["layers.0.mixer.k_proj.weight"].shape[0] == hybrid.d_model
    big = config("model.mixer=softmax", "model.n_heads=8", "model.n_kv_heads=2", "model.ffn_hidden=64")
    check_model_split(big, 2)
    with pytest.raises(LayoutError, match=r"model.n_kv_heads=2 is not divisible by tensor parallel size 4 .* "
                                          r"use a TP size that divides 2"):
        check_model_split(big, 4)


def test_the_accounting_counts_n_kv_heads():
    mha, gqa = config("model.mixer=softmax"), config(*GQA)
    d, d_kv, layers = 32, 16, 2
    assert count_parameters(mha) - count_parameters(gqa) == layers * (2 * d * (d - d_kv) - (d + 2 * d_kv))
    a, b = report(mha), report(gqa)
    assert (a.kv_cache_per_token_per_layer, b.kv_cache_per_token_per_layer) == (2 * d, 2 * d_kv)
    assert (a.decode_state_per_token, b.decode_state_per_token) == (layers * 2 * d, layers * 2 * d_kv)
    # the core (QK^T, AV) is every query head's: only the k and v projections shrink
    assert a.forward_flops_per_token - b.forward_flops_per_token == layers * 2 * 2 * d * (d - d_kv)
    window = report(config(*GQA, "model.layer_pattern=WW", "model.window=7"))
    assert (window.fixed_state, window.decode_state_per_token) == (layers * 2 * d_kv * 7, 0)


# ---------------------------------------------------------------- TP=2 and CP=2

N = 16


def _parallel_runs(rank, world, items):
    import torch.distributed as dist

    from megatron_id.parallel import gather_logits, parallelize, vocab_parallel_cross_entropy
    from megatron_id.parallel.context_parallel import ContextParallel, apply_context_parallel, split_sequence
    group, out = dist.group.WORLD, {}
    cfg = config(*items)
    x = tokens(2, N + 1, seed=4)
    for sp in (False, True):
        model = parallelize(model_of(cfg), group, sequence_parallel=sp)
        local = model(x[:, :-1])
        vocab_parallel_cross_entropy(local, x[:, 1:], group, cfg.vocab_size).mean().backward()
        out[f"tp sp={sp}"] = dict(logits=gather_logits(local.detach(), group, cfg.vocab_size),
                                  grads={n: p.grad for n, p in model.named_parameters()},
                                  k_rows=model.layers[0].mixer.k_proj.weight.shape[0])
    cp = ContextParallel(group, rank, world)
    seq_idx = torch.tensor([[0] * 5 + [1] * 11, [0] * 8 + [1] * 8])   # documents across the block edge
    model = apply_context_parallel(model_of(cfg), cp)
    logits = model(split_sequence(x[:, :-1], cp), seq_idx=split_sequence(seq_idx, cp))
    grads = torch.autograd.grad(lm_loss(logits, split_sequence(x[:, 1:], cp)) / world, list(model.parameters()))
    out["cp"] = dict(logits=logits.detach(), grads=[g.detach() for g in grads])
    return out


def test_tp2_and_cp2_equal_one_process():
    """TP=2 (each rank: 2 query heads and the one kv head they read, plus their biases), with and
    without sequence parallelism, and CP=2 with packed documents, against one process."""
    cfg = config(*GQA)
    x = tokens(2, N + 1, seed=4)
    model = model_of(cfg)
    logits = model(x[:, :-1])
    lm_loss(logits, x[:, 1:]).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    results = run_distributed(_parallel_runs, 2, args=(GQA,), timeout=240)
    for case in ("tp sp=False", "tp sp=True"):
        ranks = [r[case] for r in results]
        assert ranks[0]["k_rows"] == cfg.d_model // 4   # one kv head of the two per rank
        assert relative_error(ranks[0]["logits"], logits) < 1e-10, case
        merged = merge_state_dicts([r["grads"] for r in ranks], cfg)
        for name, grad in grads.items():   # (the vocab-parallel loss computes in float32)
            assert relative_error(merged[name], grad) < 1e-6, (case, name)
    seq_idx = torch.tensor([[0] * 5 + [1] * 11, [0] * 8 + [1] * 8])
    model = model_of(cfg)
    logits = model(x[:, :-1], seq_idx=seq_idx)
    grads = torch.autograd.grad(lm_loss(logits, x[:, 1:]), list(model.parameters()))
    assert relative_error(torch.cat([r["cp"]["logits"] for r in results], 1), logits) < 1e-10
    for i, (name, _) in enumerate(model.named_parameters()):
        assert relative_error(sum(r["cp"]["grads"][i] for r in results), grads[i]) < 1e-10, name


# ---------------------------------------------------------------- the Hugging Face export

def test_an_export_of_a_gqa_model_with_biases_loads_and_generates(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hf_tiny import tiny_export

    from megatron_id.hf.export import read_export_config
    folder = tiny_export(tmp_path / "hf", "softmax", items=["model.n_kv_heads=2", "model.qkv_bias=true"])
    _, cfg = read_export_config(folder)
    assert (cfg.n_kv_heads, cfg.qkv_bias) == (2, True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                              local_files_only=True).eval()
    assert model.config.num_key_value_heads == 2 and model.config.num_attention_heads == cfg.n_heads
    prompt = torch.randint(0, 50257, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=8, do_sample=False)
        recomputed = prompt
        for _ in range(8):
            recomputed = torch.cat([recomputed, model(recomputed, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(cached, recomputed)
    inner = model.model
    assert inner.layers[0].mixer.k_proj.weight.shape[0] == 2 * cfg.d_model // cfg.n_heads
    assert inner.layers[0].mixer.q_proj.bias.abs().sum() > 0
    with torch.no_grad():
        assert F.mse_loss(model(prompt, use_cache=False).logits, inner(prompt)).item() < 1e-10


# ---------------------------------------------------------------- decoding over the cache (eager)

def test_eager_decode_reads_the_cache_in_place_bit_for_bit(monkeypatch):
    """A model call over the cache (prefill after a cache, decode, left padding) no longer repeats
    the cached keys and values for every query head on CPU (SDPA's enable_gqa reads them in
    place): the same logits and caches bit for bit as the repeated copy (float32); greedy eager
    and fused generation give the same tokens."""
    from megatron_id.inference.generate import generate_ids
    from megatron_id.model.mixers import softmax
    cfg = config(*GQA, "model.init_std=0.3")
    model = model_of(cfg, dtype=torch.float32).eval()
    x = tokens(2, 20, seed=6)

    def run():
        with torch.no_grad():
            logits, states = model(x[:, :7], return_states=True)
            pieces = [logits]
            logits, states = model(x[:, 7:12], states=states, return_states=True)   # a chunk after a cache
            pieces.append(logits)
            for t in range(12, 20):   # decode
                logits, states = model(x[:, t:t + 1], states=states, return_states=True)
                pieces.append(logits)
            padded = model(x[:, :15], start=torch.tensor([0, 4]))
        return torch.cat(pieces, 1), padded, states

    repeated_shapes, repeat = [], softmax.repeat_kv
    monkeypatch.setattr(softmax, "repeat_kv", lambda k, groups, dim: repeated_shapes.append(tuple(k.shape)) or
                        repeat(k, groups, dim))
    in_place, padded, states = run()
    # only the first prefill (a whole sequence: causal_attention) repeats, k and v of each layer
    assert repeated_shapes == [(2, 7, 2, 8)] * 4, repeated_shapes
    monkeypatch.setattr(softmax, "_SDPA_GQA", False)   # the cache repeated, as before
    was, was_padded, was_states = run()
    assert torch.equal(in_place, was) and torch.equal(padded, was_padded)
    assert all(torch.equal(a[key], b[key]) for a, b in zip(states, was_states) for key in ("k", "v"))
    assert states[0]["k"].shape == (2, 20, 2, 8)   # the cache holds the key/value heads only
    monkeypatch.setattr(softmax, "_SDPA_GQA", True)
    prompt = x[0, :6].tolist()
    eager = list(generate_ids(model, prompt, 12, decode="eager", prefill_chunk_size=4))
    assert eager == list(generate_ids(model, prompt, 12, decode="fused", prefill_chunk_size=4))
    assert len(set(eager)) > 2, eager   # greedy choices far from ties: not one token repeated


# ---------------------------------------------------------------- a resume: None means what it stands for

def _checkpoint_of(tmp_path, name, model_cfg, **model_values):
    """A weights-only checkpoint of `model_cfg`, its recorded model config changed by
    `model_values` (another spelling of the same model); returns its iter folder."""
    from megatron_id.checkpoint.files import ClientState, model_config_dict
    from megatron_id.checkpoint.read import write_weights_only
    from megatron_id.hf.export import write_folder
    values = {**model_config_dict(model_cfg), **model_values}
    values = {k: v for k, v in values.items() if v != "absent"}   # a checkpoint written before the key
    client = ClientState(step=0, model=values, weights_only=True,
                         layout={"tensor": 1, "pipe": 1, "data": 1, "zero_stage": 0})
    shard = LanguageModel(model_cfg, seed=0).state_dict()
    root = write_folder(tmp_path / name, lambda staging: write_weights_only(staging, [shard], model_cfg, 1, client))
    return root / "iter_0000000"


def test_a_resume_reads_an_unset_key_as_the_value_it_stands_for(tmp_path):
    """model.n_kv_heads unset is n_heads, model.ffn_hidden unset is the width ffn_multiple_of
    gives (import-hf writes n_kv_heads only under GQA and ffn_hidden always): either spelling
    resumes the other; a real difference is still refused, named as the weights mean it."""
    from megatron_id.config import Config, load_config
    from megatron_id.training.agreement import check_resume_model

    def run(*items) -> Config:
        return load_config([CONFIGS / "model" / "tiny.yaml"], [f"model.vocab_size={VOCAB}", "model.d_model=32",
                                                                "model.mixer=softmax", *items])
    mha = run().model   # n_kv_heads None, ffn_hidden None (SwiGLU width 128 from d_model 32)
    unset = _checkpoint_of(tmp_path, "unset", mha)
    spelled = _checkpoint_of(tmp_path, "spelled", mha, n_kv_heads=4, ffn_hidden=128, ffn_multiple_of=64)
    for folder in (unset, spelled):
        check_resume_model(folder, run())
        check_resume_model(folder, run("model.n_kv_heads=4", "model.ffn_hidden=128"))
        check_resume_model(folder, run("model.ffn_multiple_of=64"))   # 8 x 32 / 3 = 85.3 -> 128 too
    with pytest.raises(ConfigError, match=r"model.ffn_hidden=128 in the checkpoint but 96 here.*"
                                          r"set model.ffn_hidden=128"):
        check_resume_model(unset, run("model.ffn_multiple_of=32"))   # 85.3 -> 96: another model
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=4 in the checkpoint but 2 here.*set model.n_kv_heads=4"):
        check_resume_model(unset, run("model.n_kv_heads=2"))
    # a key both sides leave unset is not named for what another key changes
    with pytest.raises(ConfigError, match=r"differs from this run's: model.d_model=32 in the checkpoint but 64 "
                                          r"here, model.n_heads=4 in the checkpoint but 8 here\. A resume"):
        check_resume_model(unset, run("model.d_model=64", "model.n_heads=8"))
    # a checkpoint written before model.n_kv_heads existed is multi-head attention
    older = _checkpoint_of(tmp_path, "older", mha, n_kv_heads="absent")
    check_resume_model(older, run("model.n_kv_heads=4"))
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=4 in the checkpoint but 1 here"):
        check_resume_model(older, run("model.n_kv_heads=1"))
    # the reverse: a GQA checkpoint refuses a run without GQA
    gqa = _checkpoint_of(tmp_path, "gqa", run("model.n_kv_heads=2").model)
    check_resume_model(gqa, run("model.n_kv_heads=2", "model.ffn_hidden=128"))
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=2 in the checkpoint but 4 here"):
        check_resume_model(gqa, run())


# ---------------------------------------------------------------- the planner

def test_the_planner_counts_the_parameters_each_rank_holds():
    """plan.py's parameters per stage and rank are the real model's TP shards (k_proj and v_proj
    n_kv_heads wide, their biases, the padded vocabulary), and the accounting's KV cache is the
    cache the model keeps."""
    from megatron_id.training.plan import largest_parameter, stage_parameters
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], [f"model.vocab_size={VOCAB}", "model.d_model=32",
                                                          "model.chunk_size=8", *GQA])
    model = LanguageModel(cfg.model, seed=0)
    assert model.layers[0].mixer.k_proj.weight.shape == (16, 32)
    for tp in (1, 2):
        shard = split_state_dict(model.state_dict(), cfg.model, tp)[0]
        for pp in (1, 2):
            assert sum(stage_parameters(cfg, tp, pp)) == sum(t.numel() for t in shard.values()), (tp, pp)
        assert largest_parameter(cfg, tp, 1, 0) == max(t.numel() for t in shard.values())
        assert shard["layers.0.mixer.k_proj.weight"].shape == (16 // tp, 32)
    r = report(cfg.model)
    assert r.parameters == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        _, states = model.eval()(tokens(1, 9), return_states=True)
    per_token = [(s["k"].numel() + s["v"].numel()) // 9 for s in states]
    assert per_token == [r.kv_cache_per_token_per_layer] * 2 and r.decode_state_per_token == sum(per_token)
