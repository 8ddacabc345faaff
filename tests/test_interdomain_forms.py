"""The chunked, recurrent and naive forms of the interdomain core compute the same function.

Compared on outputs, final states and every gradient (inputs and parameters), in float64
(relative error < 1e-10) and float32 (< 1e-4 against the float64 naive reference: the naive
form is the reference, so in float32 only the fast forms are held to it), for random
small shapes, lengths not divisible by the chunk size, every switch of the ablation cube,
and Delta both in its init range and as large as 1.0.
"""
import itertools
import math
from pathlib import Path

import pytest
import torch
from conftest import relative_error

from megatron_id.model.init import initialize
from megatron_id.model.mixers import InterdomainMixer
from megatron_id.ops.interdomain import FORMS, chunked
from megatron_id.ops.interdomain.ssm import s4d_inv_init

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def core_inputs(seed, dtype, *, B, N, H, R, Dv, M, delta, contraction, with_state):
    """Random inputs and parameters for the core; C far from identity so every term matters."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    a_log, a_im = s4d_inv_init(H, M)
    a_log = a_log + 0.3 * randn(H, M)
    if delta == "init":
        log_dt = math.log(1e-3) + torch.rand(H, generator=g, dtype=torch.float64) * math.log(100)
    else:
        log_dt = torch.full((H,), math.log(delta), dtype=torch.float64)
    params = dict(log_dt=log_dt, a_log=a_log, a_im=a_im,
                  c_re=torch.eye(M, dtype=torch.float64) + 0.4 * randn(H, M, M), c_im=0.4 * randn(H, M, M))
    data = dict(q=None if contraction else randn(B, N, H, R), k=randn(B, N, H, R), v=randn(B, N, H, Dv))
    if contraction:
        params["c_vec"] = randn(H, M)
    state = torch.complex(randn(B, H, M, R + Dv), randn(B, H, M, R + Dv)) if with_state else None
    cast = lambda t: None if t is None else t.to(dtype).requires_grad_()
    return {k: cast(v) for k, v in {**data, **params}.items()}, state


def form_options(form, chunk_size):
    """'chunked' differentiates by autograd; 'recompute' is the chunked form with the
    recomputing backward, in segments of 2 chunks so that every sequence has several."""
    if form == "chunked":
        return "chunked", dict(chunk_size=chunk_size, backward="autograd")
    if form == "recompute":
        return "chunked", dict(chunk_size=chunk_size, backward="recompute", segment_chunks=2)
    if form in ("triton", "auto"):   # tests/test_triton_core.py, under TRITON_INTERPRET=1
        return "chunked", dict(chunk_size=chunk_size, backward=form)
    return form, {}


def run_form(form, tensors, state, readout, chunk_size, seq_idx=None):
    form, kw = form_options(form, chunk_size)
    if seq_idx is not None:   # packed documents
        kw["seq_idx"] = seq_idx
    out, final = FORMS[form](tensors["q"], tensors["k"], tensors["v"], tensors["log_dt"],
                             tensors["a_log"], tensors["a_im"], tensors["c_re"], tensors["c_im"],
                             readout=readout, c_vec=tensors.get("c_vec"), initial_state=state,
                             output_final_state=True, **kw)
    g = torch.Generator().manual_seed(99)
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    w_state = torch.randn(final.shape, generator=g, dtype=torch.complex128).to(final.dtype)
    loss = (out * weight).sum() + (final * w_state).real.sum()
    names = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    grads = torch.autograd.grad(loss, [tensors[n] for n in names])
    return out, final, dict(zip(names, grads))


SHAPES = [  # (B, N, H, R, Dv, M, chunk) chosen so that N is not a multiple of the chunk
    (1, 1, 1, 2, 2, 1, 4),
    (2, 13, 2, 4, 3, 5, 4),
    (1, 37, 3, 6, 4, 8, 16),
    (2, 29, 1, 3, 5, 6, 7),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("delta", ["init", 1.0], ids=["delta_init", "delta_1"])
@pytest.mark.parametrize("readout", ["hermitian", "plain", "contraction"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}N{}H{}R{}Dv{}M{}T{}".format(*s))
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "given_state"])
def test_core_forms_agree(dtype, delta, readout, shape, with_state):
    B, N, H, R, Dv, M, T = shape
    contraction = readout == "contraction"
    mode = "hermitian" if contraction else readout
    common = dict(B=B, N=N, H=H, R=R, Dv=Dv, M=M, delta=delta, contraction=contraction,
                  with_state=with_state)
    ref_in, ref_state = core_inputs(1, torch.float64, **common)
    ref = run_form("naive", ref_in, ref_state, mode, T)
    for form in ("recurrent", "chunked", "recompute"):
        tensors, state = core_inputs(1, dtype, **common)
        got = run_form(form, tensors, None if state is None else state.to(
            torch.complex128 if dtype == torch.float64 else torch.complex64), mode, T)
        assert relative_error(got[0], ref[0]) < TOL[dtype], (form, "output")
        assert relative_error(got[1], ref[1]) < TOL[dtype], (form, "final state")
        for name, grad in ref[2].items():
            assert relative_error(got[2][name], grad) < TOL[dtype], (form, "grad", name)


def test_chunked_is_stable_for_very_large_delta():
    """Delta = 50 makes |lambda|^-T astronomically large: a lambda^i lambda^-j factorisation
    would overflow. The tables only hold non-negative powers, so all forms still agree."""
    common = dict(B=1, N=70, H=2, R=4, Dv=4, M=6, delta=50.0, contraction=False, with_state=False)
    tensors, _ = core_inputs(3, torch.float32, **common)
    ref_in, _ = core_inputs(3, torch.float64, **common)
    ref = run_form("naive", ref_in, None, "hermitian", 64)
    for form, chunk in (("chunked", 64), ("recompute", 16)):
        got = run_form(form, tensors, None, "hermitian", chunk)
        assert torch.isfinite(got[0]).all()
        assert relative_error(got[0], ref[0]) < 1e-4
        for name, grad in ref[2].items():
            assert torch.isfinite(got[2][name]).all(), name
            assert relative_error(got[2][name], grad) < 1e-4, name


# ---------------------------------------------------------------- the whole mixer layer

CUBE = [dict(query_readout=qr, dual_kv_input=dual, rope=rope, readout=ro, output_gate=gate)
        for qr, dual, rope, ro, gate in itertools.product([True, False], [True, False], [True, False],
                                                          ["hermitian", "plain"], [False, True])
        if qr or ro == "hermitian"]   # the readout kind only exists with the query readout


def cube_id(c):
    return "-".join([("Q" if c["query_readout"] else "noQ"), ("dual" if c["dual_kv_input"] else "single"),
                     ("rope" if c["rope"] else "norope"), c["readout"][:5], ("gate" if c["output_gate"] else "nogate")])


def randomized_layer(tiny_config, switches, delta, dtype, form):
    """form: naive, recurrent, chunked (autograd backward) or recompute (chunked form with the
    recomputing backward)."""
    impl = {"chunked": "autograd", "recompute": "recompute"}.get(form, "auto")
    cfg = tiny_config("model.d_model=16", "model.n_heads=2", "model.state_size=5",
                      "model.chunk_size=4", f"model.core_impl={impl}",
                      *[f"model.{k}={v}" for k, v in switches.items()])
    layer = InterdomainMixer(cfg, residual_std=0.1, form="chunked" if form == "recompute" else form)
    initialize(layer, seed=5)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():   # move every parameter off its init so each gradient path is exercised
        for name, p in layer.named_parameters():
            if name == "log_dt":
                p.copy_(torch.full_like(p, math.log(delta)) if delta != "init" else p)
            else:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return layer.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("delta", ["init", 1.0], ids=["delta_init", "delta_1"])
@pytest.mark.parametrize("switches", CUBE, ids=cube_id)
def test_mixer_layer_forms_agree(tiny_config, switches, delta, dtype, monkeypatch):
    """Every switch combination: outputs, input gradient and every parameter gradient."""
    monkeypatch.setattr(chunked, "SEGMENT_CHUNKS", 1)   # 11 tokens, chunks of 4: three segments
    def run(form, run_dtype):
        layer = randomized_layer(tiny_config, switches, delta, run_dtype, form)
        x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        x = x.to(run_dtype).requires_grad_()
        y = layer(x)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        (y * w.to(run_dtype)).sum().backward()
        return y, x.grad, {n: p.grad for n, p in layer.named_parameters()}

    ref = run("naive", torch.float64)
    for form in ("recurrent", "chunked", "recompute"):
        y, gx, gp = run(form, dtype)
        assert relative_error(y, ref[0]) < TOL[dtype], (form, "output")
        assert relative_error(gx, ref[1]) < TOL[dtype], (form, "input grad")
        assert set(gp) == set(ref[2])
        for name, grad in ref[2].items():
            assert relative_error(gp[name], grad) < TOL[dtype], (form, name)


def test_switches_change_the_function(tiny_config):
    """The agreement above would also hold for a layer that ignored its switches: check they bite."""
    x = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    outputs = {}
    for switches in CUBE:
        layer = randomized_layer(tiny_config, switches, "init", torch.float64, "chunked")
        outputs[cube_id(switches)] = layer(x)
    names = list(outputs)
    for a, b in itertools.combinations(names, 2):
        if outputs[a].shape == outputs[b].shape:
            assert relative_error(outputs[a], outputs[b]) > 1e-3, (a, b)


def test_core_runs_in_float32_under_bf16_autocast(tiny_config):
    """bf16 activations enter the core; it computes in float32/complex64 regardless."""
    tensors, _ = core_inputs(2, torch.float32, B=2, N=40, H=2, R=4, Dv=4, M=6, delta="init",
                             contraction=False, with_state=False)
    qkv = [tensors[n].detach().to(torch.bfloat16) for n in ("q", "k", "v")]
    params = [tensors[n].detach() for n in ("log_dt", "a_log", "a_im", "c_re", "c_im")]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, no_state = FORMS["chunked"](*qkv, *params, chunk_size=16)
    reference, _ = FORMS["chunked"](*[t.float() for t in qkv], *params, chunk_size=16)
    assert no_state is None   # the final state only when asked for
    assert out.dtype == torch.float32
    assert relative_error(out, reference) < 1e-6
    # and a whole layer under autocast stays close to its float32 self
    layer = randomized_layer(tiny_config, dict(), "init", torch.float32, "chunked")
    x = torch.randn(2, 20, 16, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert relative_error(y.float(), layer(x)) < 3e-2


def test_readout_scale_makes_output_independent_of_M(tiny_config):
    """o_t before W_O has a size set by the state, not by the number of modes M."""
    rms = {}
    for M in (8, 32, 128):
        cfg = tiny_config("model.d_model=128", "model.n_heads=2", f"model.state_size={M}")
        layer = InterdomainMixer(cfg, residual_std=0.02)
        initialize(layer, seed=0)
        seen = {}
        layer.o_proj.register_forward_hook(lambda m, i, o: seen.update(o=i[0]))
        with torch.no_grad():
            layer(torch.randn(2, 512, 128, generator=torch.Generator().manual_seed(1)))
        rms[M] = seen["o"].pow(2).mean().sqrt().item()
    assert max(rms.values()) / min(rms.values()) < 2.0, rms
    assert all(0.01 < r < 1.0 for r in rms.values()), rms


def test_inference_tables_are_kept_between_calls_and_follow_any_change_of_the_parameters():
    """Without a gradient, the chunked form keeps its parameter-only tables between calls
    (chunked.inference_tables): a second call builds none, and a parameter changed in place, even
    through `.data` (which leaves the version counter alone), gives the tables of its new value:
    the output equals the one computed with fresh tables under autograd."""
    from megatron_id.config import load_config
    from megatron_id.model import LanguageModel
    cfg = load_config([Path(__file__).resolve().parents[1] / "configs/model/tiny.yaml"], ["model.chunk_size=8"]).model
    mixer = LanguageModel(cfg, seed=0).layers[0].mixer
    x = torch.randn(1, 21, cfg.d_model, generator=torch.Generator().manual_seed(0))
    built = []
    real = chunked.chunk_tables
    counting = lambda *a, **k: built.append(1) or real(*a, **k)  # noqa: E731
    chunked._TABLES.clear()
    try:
        chunked.chunk_tables = counting
        with torch.no_grad():
            first = mixer(x)
            again = mixer(x)
            assert len(built) == 1 and torch.equal(first, again)
            mixer.a_log.data.add_(0.25)   # in place, outside autograd's sight
            changed = mixer(x)
        assert len(built) == 2 and not torch.allclose(changed, first)
        fresh = mixer(x).detach()   # (a gradient wanted: tables built in the graph, not kept)
        assert len(built) == 3 and torch.equal(changed, fresh)
    finally:
        chunked.chunk_tables = real
