"""The recomputing backward (ops/segments.py, the chunked core's "recompute" mode and the
interdomain mixer's segment path) computes the same numbers as plain autograd and keeps less.

The core's and the layer's agreement with the naive reference on every cube switch is in
test_interdomain_forms.py (forms "recompute"); here: the generic segment machinery on a toy
causal function (halo, carried state, parameters, segments shorter than the halo), when each
path is chosen, bf16 autocast, and how much autograd keeps."""

import pytest
import torch
from conftest import relative_error

from megatron_id.model.init import initialize
from megatron_id.model.mixers import InterdomainMixer
from megatron_id.ops.interdomain import chunked
from megatron_id.ops.segments import run_in_segments


def toy_step(params, window, lo, window_lo, state):
    """A causal function with everything the mixer's step has: a 3-tap conv over the window
    (halo 2), a parameter-dependent decay carried in a state, two inputs, one of them optional."""
    weight, decay = params
    x, y = window
    u = torch.nn.functional.pad(x, (0, 0, 2, 0))          # zeros before the window (as the conv)
    conv = weight[0] * u[:, 2:] + weight[1] * u[:, 1:-1] + weight[2] * u[:, :-2]
    conv = conv[:, lo - window_lo:]
    if y is not None:
        conv = conv * torch.tanh(y[:, lo - window_lo:])
    outs = []
    for t in range(conv.shape[1]):
        state = torch.sigmoid(decay) * state + conv[:, t]
        outs.append(state * conv[:, t])
    return torch.stack(outs, dim=1), state


def toy_inputs(seed, N, with_y=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
    return [r(3), r(4)], [r(2, N, 4), r(2, N, 4) if with_y else None], r(2, 4)


@pytest.mark.parametrize("N,segment,halo", [(13, 4, 2), (12, 4, 2), (9, 1, 2), (7, 20, 2), (10, 3, 5)])
@pytest.mark.parametrize("with_y", [True, False])
def test_segments_equal_one_pass(N, segment, halo, with_y):
    """Outputs, end state and the gradients of inputs, parameters and start state, in float64,
    against the same step run once over the whole sequence under autograd (halo >= the conv's
    reach; a larger halo changes nothing)."""
    params, inputs, start = toy_inputs(0, N, with_y)
    ref_out, ref_end = toy_step(params, inputs, 0, 0, start)
    got_out, got_end = run_in_segments(toy_step, params, inputs, start, segment_tokens=segment, halo=halo)
    g = torch.Generator().manual_seed(1)
    w_out = torch.randn(ref_out.shape, generator=g, dtype=torch.float64)
    w_end = torch.randn(ref_end.shape, generator=g, dtype=torch.float64)
    leaves = [*params, *[x for x in inputs if x is not None], start]
    ref = torch.autograd.grad((ref_out * w_out).sum() + (ref_end * w_end).sum(), leaves)
    got = torch.autograd.grad((got_out * w_out).sum() + (got_end * w_end).sum(), leaves)
    assert relative_error(got_out, ref_out) < 1e-13
    assert relative_error(got_end, ref_end) < 1e-13
    for a, b in zip(got, ref):
        assert relative_error(a, b) < 1e-12


def test_a_too_small_halo_is_wrong():
    """The check above can fail: with no halo the conv loses its inputs across segment edges."""
    params, inputs, start = toy_inputs(0, 12)
    ref_out, _ = toy_step(params, inputs, 0, 0, start)
    got_out, _ = run_in_segments(toy_step, params, inputs, start, segment_tokens=4, halo=0)
    assert relative_error(got_out, ref_out) > 1e-3


def test_bad_segment_options_are_refused():
    params, inputs, start = toy_inputs(0, 5)
    with pytest.raises(ValueError, match="segment_tokens=0"):
        run_in_segments(toy_step, params, inputs, start, segment_tokens=0)


# ---------------------------------------------------------------- which path runs

def graph_names(tensor):
    """Names of every autograd node behind `tensor`."""
    seen, todo, names = set(), [tensor.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


def tiny_layer(tiny_config, impl, *extra):
    cfg = tiny_config("model.d_model=32", "model.n_heads=2", "model.state_size=6", "model.chunk_size=8",
                      f"model.core_impl={impl}", *extra)
    layer = InterdomainMixer(cfg, residual_std=0.1)
    initialize(layer, seed=2)
    return layer


def test_auto_recomputes_long_sequences_only_when_training(tiny_config, monkeypatch):
    monkeypatch.setattr(chunked, "RECOMPUTE_FROM_TOKENS", 64)
    layer = tiny_layer(tiny_config, "auto")
    recomputed = lambda y: "_SegmentedRecomputeBackward" in graph_names(y)
    long, short = torch.randn(1, 64, 32), torch.randn(1, 63, 32)
    assert recomputed(layer(long))
    assert not recomputed(layer(short))
    with torch.no_grad():
        assert layer(long).grad_fn is None
    # a prefill that returns its state (conv states included) recomputes in the core alone
    y, state = layer(long, return_state=True)
    reference, ref_state = tiny_layer(tiny_config, "autograd")(long, return_state=True)
    assert set(state["conv"]) == {"q_conv", "k_conv"} and recomputed(y)
    assert relative_error(y, reference) < 1e-5 and relative_error(state["ssm"], ref_state["ssm"]) < 1e-5
    assert recomputed(tiny_layer(tiny_config, "recompute")(short))
    assert not recomputed(tiny_layer(tiny_config, "autograd")(long))
    assert chunked.recomputes("auto", 64, True) and not chunked.recomputes("auto", 64, False)


@pytest.mark.parametrize("switches", [[], ["model.mixer=s4d"], ["model.query_readout=false"],
                                      ["model.dual_kv_input=false", "model.output_gate=true"]],
                         ids=["interdomain", "s4d", "no-query", "single-gate"])
def test_layer_recompute_equals_autograd_in_float32_and_bf16(tiny_config, monkeypatch, switches):
    """The 'recompute' layer (features and core in segments of 2 chunks) against the
    'autograd' layer: float32 outputs and gradients to 1e-5, and under bf16 autocast (the
    backward recomputes under the forward's autocast) to bf16's precision."""
    monkeypatch.setattr(chunked, "SEGMENT_CHUNKS", 2)
    x = torch.randn(2, 75, 32, generator=torch.Generator().manual_seed(0))
    w = torch.randn(2, 75, 32, generator=torch.Generator().manual_seed(1))
    for autocast, tol in ((False, 1e-5), (True, 2e-2)):
        results = []
        for impl in ("autograd", "recompute"):
            layer = tiny_layer(tiny_config, impl, *switches)
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = layer(xi)
            (y.float() * w).sum().backward()
            results.append((y.float(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
        (y0, gx0, gp0), (y1, gx1, gp1) = results
        assert relative_error(y1, y0) < tol
        assert relative_error(gx1, gx0) < tol
        for name in gp0:
            assert relative_error(gp1[name], gp0[name]) < tol * (5 if autocast else 1), name


def saved_bytes(fn):
    """Bytes autograd keeps for the backward while fn runs (every tensor saved, counted once)."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_recompute_keeps_a_fraction_of_what_autograd_keeps(tiny_config):
    """A 32-wide layer at 4096 tokens: the recomputing layer keeps its projections, o_proj's
    input, the segment starts and the tables (measured 2x the projections); autograd keeps
    every intra-chunk tensor (measured 5x more here, 12x at 125M width)."""
    x = torch.randn(1, 4096, 32)
    kept = {impl: saved_bytes(lambda: tiny_layer(tiny_config, impl)(x))[0] for impl in ("autograd", "recompute")}
    projections = 3 * x.numel() * 4
    assert kept["recompute"] < 0.25 * kept["autograd"], kept
    assert kept["recompute"] < 2.5 * projections, kept
