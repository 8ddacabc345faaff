"""The decoder with each mixer: causality, length freedom, decode == forward, init, overfitting."""
import math

import pytest
import torch
from conftest import relative_error

from megatron_id.model import LanguageModel, lm_loss
from megatron_id.model.mixers import MIXERS as REGISTERED

MIXERS = list(REGISTERED)   # every registered mixer (docs/adding-a-mixer.md) gets these tests


def tokens(cfg, B, N, seed=0):
    return torch.randint(0, cfg.vocab_size, (B, N), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mixer", MIXERS)
def test_causality(tiny_config, mixer):
    """Changing token t changes no output before t (and does change the output at t)."""
    cfg = tiny_config(f"model.mixer={mixer}", "model.chunk_size=8")
    model = LanguageModel(cfg, seed=1)
    x = tokens(cfg, 2, 40)
    base = model(x)
    for t in (0, 7, 8, 23, 39):   # chunk boundaries and interiors
        changed = x.clone()
        changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
        out = model(changed)
        assert torch.allclose(out[:, :t], base[:, :t], rtol=0, atol=1e-6), t
        assert (out[:, t] - base[:, t]).abs().max() > 1e-4, t


@pytest.mark.parametrize("mixer", MIXERS)
def test_runs_at_four_times_its_context(tiny_config, mixer):
    """No positional table: 4x seq_length works and its prefix equals the short run."""
    cfg = tiny_config(f"model.mixer={mixer}")
    model = LanguageModel(cfg, seed=2)
    long = tokens(cfg, 1, 4 * cfg.seq_length)
    with torch.no_grad():
        out_long = model(long)
        out_short = model(long[:, :cfg.seq_length])
    assert torch.isfinite(out_long).all()
    assert relative_error(out_long[:, :cfg.seq_length], out_short) < 1e-5
    if mixer != "softmax":   # and the long run is the same function as the recurrence
        reference = LanguageModel(cfg, form="recurrent", seed=2)
        with torch.no_grad():
            assert relative_error(out_long, reference(long)) < 1e-4


@pytest.mark.parametrize("mixer,extra", [("interdomain", []), ("s4d", []), ("softmax", []),
                                         ("softmax", ["model.n_kv_heads=1", "model.qkv_bias=true"]),   # GQA
                                         ("interdomain", ["model.output_gate=true", "model.readout=plain"]),
                                         ("interdomain", ["model.query_readout=false"]),
                                         ("interdomain", ["model.dual_kv_input=false"])])
def test_prefill_then_decode_equals_full_forward(tiny_config, mixer, extra):
    """Constant-size state (KV cache for softmax): prefill a prefix, then one token at a time."""
    cfg = tiny_config(f"model.mixer={mixer}", "model.chunk_size=8", *extra)
    model = LanguageModel(cfg, seed=3)
    x = tokens(cfg, 2, 30)
    with torch.no_grad():
        full = model(x)
        logits, states = model(x[:, :11], return_states=True)
        pieces = [logits]
        for t in range(11, 30):
            logits, states = model(x[:, t:t + 1], states=states, return_states=True)
            pieces.append(logits)
    assert relative_error(torch.cat(pieces, dim=1), full) < 1e-5
    if mixer != "softmax":   # the state does not grow with the prefix
        assert states[0]["ssm"].shape == (2, cfg.n_heads, cfg.state_size, 2 * cfg.d_model // cfg.n_heads)


def test_prefill_in_two_chunks_equals_one(tiny_config):
    cfg = tiny_config("model.chunk_size=8")
    model = LanguageModel(cfg, seed=4)
    x = tokens(cfg, 1, 50)
    with torch.no_grad():
        full = model(x)
        a, states = model(x[:, :19], return_states=True)
        b = model(x[:, 19:], states=states)
    assert relative_error(torch.cat([a, b], dim=1), full) < 1e-5


def test_initialisation_is_deterministic_and_per_parameter(tiny_config):
    cfg = tiny_config()
    a, b = LanguageModel(cfg, seed=42), LanguageModel(cfg, seed=42)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    c = LanguageModel(cfg, seed=43)
    assert not torch.equal(a.embed.weight, c.embed.weight)
    # a parameter's init depends on its name, not on what else was built before it
    deeper = LanguageModel(tiny_config("model.n_layers=3"), seed=42)
    assert torch.equal(deeper.layers[1].mixer.q_proj.weight, a.layers[1].mixer.q_proj.weight)


def test_initialisation_follows_the_spec(tiny_config):
    cfg = tiny_config("model.d_model=256", "model.n_heads=4", "model.vocab_size=4096")
    model = LanguageModel(cfg, seed=0)
    mixer = model.layers[0].mixer
    assert abs(model.embed.weight.std().item() - 0.02) < 1e-3
    assert abs(mixer.q_proj.weight.std().item() - 0.02) < 2e-3
    resid = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert abs(mixer.o_proj.weight.std().item() - resid) < 1e-3
    assert abs(model.layers[1].ffn.w2.weight.std().item() - resid) < 1e-3
    dt = mixer.log_dt.exp()
    assert dt.min() >= 1e-3 and dt.max() <= 1e-1
    M = cfg.state_size
    assert torch.allclose(mixer.a_log, torch.full_like(mixer.a_log, math.log(0.5)))
    assert torch.allclose(mixer.a_im[0], torch.tensor([(M / math.pi) * (M / (2 * m + 1) - 1) for m in range(M)]))
    assert torch.equal(mixer.c_re[0], torch.eye(M)) and not mixer.c_im.any()
    assert not mixer.k_bias.any() and torch.equal(mixer.k_norm.weight, torch.ones(cfg.d_model // cfg.n_heads))


@pytest.mark.slow
@pytest.mark.parametrize("mixer", MIXERS)
def test_tiny_config_overfits_one_batch(tiny_config, mixer):
    cfg = tiny_config(f"model.mixer={mixer}")
    torch.manual_seed(0)
    model = LanguageModel(cfg, seed=0)
    batch = tokens(cfg, 4, cfg.seq_length + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first = None
    for step in range(150):
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > math.log(cfg.vocab_size) - 0.5      # starts at chance
    assert loss.item() < 0.1, loss.item()              # and memorises the batch


@pytest.mark.parametrize("mixer", MIXERS)
def test_activation_checkpointing_gives_identical_gradients(tiny_config, mixer):
    cfg = tiny_config(f"model.mixer={mixer}", "model.chunk_size=8")
    x = tokens(cfg, 2, 21)
    results = []
    for checkpointing in (False, True):
        model = LanguageModel(cfg, seed=5)
        model.activation_checkpointing = checkpointing
        recomputed, block_forward = [], model.layers[0].forward

        def counting_forward(*args, **kwargs):   # hooks do not fire during recomputation
            recomputed.append(1)
            return block_forward(*args, **kwargs)
        model.layers[0].forward = counting_forward
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(recomputed)))
    (loss_a, grads_a, calls_a), (loss_b, grads_b, calls_b) = results
    assert loss_a == loss_b and calls_a == 1 and calls_b == 2   # the block really ran again in backward
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
