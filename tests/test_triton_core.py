"""The Triton kernels of the chunked core (ops/interdomain/triton_chunked.py) compute the naive
recurrence's numbers: outputs, final state and every gradient (q, k, v, the initial state and
all five parameter tensors), for both readouts and the contraction, on a grid of shapes (lengths
not divisible by the chunk, one token, one chunk; M, R, Dv that need padding and that do not;
several heads; Delta up to 50), with float32 and bf16 inputs.

On this CPU machine the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported; numpy semantics, so the numbers are the kernels' own arithmetic, not a
GPU's; the tensor cores' rounding of tf32 / tf32x3 / bf16 operands is emulated in _dot).
Tolerance of the shape grid (exact fp32 dots) against the float64 naive reference on the same
float32 values: < 1e-4 relative (the PyTorch chunked form's float32 tolerance in
test_interdomain_forms.py); of each dot precision at the production tile: TOLERANCE. Also here:
two backward passes give bitwise equal gradients; core_impl=auto falls back with one warning
when a kernel cannot launch (a simulated OutOfResources); core_impl=triton then names the
kernel, the shape and the limit.
"""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: the CPU interpreter
triton = pytest.importorskip("triton")

from conftest import relative_error  # noqa: E402
from test_interdomain_forms import core_inputs, run_form  # noqa: E402
from test_recompute import graph_names  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="triton was imported before TRITON_INTERPRET=1 could be set")

SHAPES = [  # (B, N, H, R, Dv, M, chunk)
    (2, 37, 2, 16, 16, 16, 16),    # N not a multiple of the chunk, kernel shapes as they are
    (1, 64, 3, 16, 32, 16, 16),    # whole chunks, R != Dv
    (1, 1, 1, 16, 16, 16, 16),     # one token
    (2, 29, 1, 6, 5, 8, 7),        # every dimension padded, the chunk raised to 16
    (1, 40, 2, 32, 16, 32, 32),    # larger M and chunk
]


def _close(got, ref, tol, what):
    assert torch.isfinite(got).all(), what
    assert relative_error(got, ref) < tol, (what, relative_error(got, ref))


# every shape at the init Delta range with a given state; Delta 1 (no state) and 50 on the two
# shapes that stress the carry most (a partial last chunk; every dimension padded)
CASES = [(shape, "init", True) for shape in SHAPES] + \
    [(shape, delta, state) for shape in (SHAPES[0], SHAPES[3]) for delta, state in ((1.0, False), (50.0, True))]


@pytest.mark.parametrize("readout", ["hermitian", "plain", "contraction"])
@pytest.mark.parametrize("shape,delta,with_state", CASES,
                         ids=["B{}N{}H{}R{}Dv{}M{}T{}".format(*c[0]) + f"-delta_{c[1]}-{'state' if c[2] else 'zero'}"
                              for c in CASES])
def test_triton_core_equals_naive(monkeypatch, readout, shape, delta, with_state):
    """The kernels' algebra on a grid of shapes, in exact fp32 dots ("ieee": the precisions'
    own errors are test_production_tile_equals_naive_at_each_dot_precision's)."""
    monkeypatch.setenv("MEGATRON_ID_DOT_PRECISION", "ieee")
    B, N, H, R, Dv, M, T = shape
    contraction = readout == "contraction"
    mode = "hermitian" if contraction else readout
    common = dict(B=B, N=N, H=H, R=R, Dv=Dv, M=M, delta=delta, contraction=contraction, with_state=with_state)
    tensors, state = core_inputs(1, torch.float32, **common)
    if state is not None:
        tensors["initial_state"] = state = state.to(torch.complex64).requires_grad_()
    # the reference sees the same float32-rounded values, in float64: what remains is the kernels'
    # own arithmetic (log_dt's gradient is a sum with cancellation that amplifies input rounding)
    ref_in = {n: None if t is None else t.detach().to(torch.float64 if not t.is_complex() else torch.complex128)
              .requires_grad_() for n, t in tensors.items()}
    ref = run_form("naive", ref_in, ref_in.get("initial_state"), mode, T)
    got = run_form("triton", tensors, state, mode, T)
    _close(got[0], ref[0], 1e-4, "output")
    _close(got[1], ref[1], 1e-4, "final state")
    assert set(got[2]) == set(ref[2])
    for name, grad in ref[2].items():
        _close(got[2][name], grad, 1e-4, f"grad {name}")


@pytest.mark.parametrize("readout", ["hermitian", "contraction"])
def test_triton_core_takes_bf16_inputs(readout):
    """bf16 q, k, v (as with bf16 weights) are read as float32 and multiplied in tf32
    (dot_precision): the result equals the naive form on the same bf16-rounded values within
    tf32's tolerance, and gradients come back in bf16."""
    common = dict(B=1, N=45, H=2, R=16, Dv=16, M=16, delta="init", contraction=readout == "contraction",
                  with_state=False)
    tensors, _ = core_inputs(2, torch.float32, **common)
    half = {n: (t.detach().to(torch.bfloat16).requires_grad_() if n in ("q", "k", "v") and t is not None else t)
            for n, t in tensors.items()}
    ref_in = {n: None if t is None else t.detach().to(torch.float64).requires_grad_() for n, t in half.items()}
    got = run_form("triton", half, None, "hermitian", 16)
    ref = run_form("naive", ref_in, None, "hermitian", 16)
    assert got[0].dtype == torch.float32
    _close(got[0], ref[0], TOLERANCE["tf32"], "output")
    for name in ("k", "v"):
        assert got[2][name].dtype == torch.bfloat16
        _close(got[2][name].float(), ref[2][name], TOLERANCE["tf32"], f"grad {name}")


# [our choice] the stated tolerances of each dot precision against the float64 naive form
# (relative error over the whole tensor). Measured at the production tile (T = M = R = Dv = 64,
# 200 tokens, a given state, the init Delta range; docs/gpu.md "Dot precision"): tf32 2.2e-3
# output, 3.2e-3 worst gradient (k); tf32x3 9.4e-7 output, 1.2e-6 worst gradient; ieee 3.7e-7;
# bf16 operands 4.0e-3 output, 6.2e-3 worst gradient (log_dt).
TOLERANCE = {"tf32": 1e-2, "tf32x3": 1e-5, "ieee": 1e-5, "bf16": 2e-2}


def _documents(B, N, seed):
    """seq_idx [B, N] with documents starting inside chunks, on a chunk edge and a one-token one."""
    starts = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        for at in ((37, 64, 65, 150) if b == 0 else (5, 128)):
            if at < N:
                starts[b, at] = 1
    return starts.cumsum(-1)


@pytest.mark.parametrize("readout,documents,precision", [
    ("hermitian", True, "tf32"), ("hermitian", False, "tf32x3"),
    ("contraction", True, "tf32"), ("contraction", True, "tf32x3")])
def test_production_tile_equals_naive_at_each_dot_precision(monkeypatch, precision, readout, documents):
    """The tile every shipped config above tiny runs (T = M = R = Dv = 64; 125M, 350M, 1.3B):
    the output, the final state and every gradient (q, k, v, the initial state and all
    parameters) against the float64 naive form, with the tensor cores' operand rounding
    emulated (triton_chunked._dot), inside the stated tolerance of each precision."""
    monkeypatch.setenv("MEGATRON_ID_DOT_PRECISION", precision)
    contraction = readout == "contraction"
    tensors, state = core_inputs(7, torch.float32, B=2 if documents else 1, N=160, H=2, R=64, Dv=64, M=64,
                                 delta="init", contraction=contraction, with_state=True)
    tensors["initial_state"] = state = state.to(torch.complex64).requires_grad_()
    ref_in = {n: None if t is None else t.detach().to(torch.float64 if not t.is_complex() else torch.complex128)
              .requires_grad_() for n, t in tensors.items()}
    seq_idx = _documents(tensors["k"].shape[0], 160, 0) if documents else None
    mode = "hermitian"
    ref = run_form("naive", ref_in, ref_in["initial_state"], mode, 64, seq_idx)
    got = run_form("triton", tensors, state, mode, 64, seq_idx)
    tol = TOLERANCE[precision]
    _close(got[0], ref[0], tol, "output")
    _close(got[1], ref[1], tol, "final state")
    assert set(got[2]) == set(ref[2])
    for name, grad in ref[2].items():
        _close(got[2][name], grad, tol, f"grad {name}")


def test_dot_precision_follows_autocast_and_torch_matmul_setting(monkeypatch):
    from megatron_id.ops.interdomain.triton_chunked import dot_precision
    monkeypatch.delenv("MEGATRON_ID_DOT_PRECISION", raising=False)
    assert dot_precision([torch.float32], autocast=True) == "tf32"
    assert dot_precision([torch.bfloat16, torch.float32], autocast=False) == "tf32"
    assert dot_precision([torch.float32], autocast=False) == "tf32x3"     # torch's default: highest
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert dot_precision([torch.float32], autocast=False) == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)
    monkeypatch.setenv("MEGATRON_ID_DOT_PRECISION", "fp8")
    with pytest.raises(ValueError, match="MEGATRON_ID_DOT_PRECISION='fp8'"):
        dot_precision([torch.float32], autocast=False)


@pytest.mark.parametrize("readout", ["hermitian", "contraction"])
def test_two_backward_passes_give_bitwise_equal_gradients(readout):
    """Every gradient, the parameters' included, is a fixed-order sum (no atomics: the kernels
    write per-chunk partials that torch sums), so the same inputs give the same bits."""
    tensors, state = core_inputs(3, torch.float32, B=2, N=90, H=1, R=16, Dv=16, M=16, delta="init",
                                 contraction=readout == "contraction", with_state=True)
    tensors["initial_state"] = state = state.to(torch.complex64).requires_grad_()
    seq_idx = _documents(2, 90, 0)
    first = run_form("triton", tensors, state, "hermitian", 16, seq_idx)
    second = run_form("triton", tensors, state, "hermitian", 16, seq_idx)
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name]), name
    assert {"log_dt", "a_log", "a_im", "c_re", "c_im"} <= set(first[2])


@pytest.fixture
def simulated_gpu(monkeypatch):
    """The interpreter's CPU tensors treated as a GPU's by core_impl=auto, with a kernel that
    cannot launch there: _query_backward_dv needs more shared memory than the block allows
    (the OutOfResources Triton raises at launch, for every autotuning config)."""
    from triton.runtime.errors import OutOfResources

    from megatron_id.ops.interdomain import chunked, triton_chunked
    monkeypatch.setattr(chunked, "_kernel_candidate", lambda x: x.dtype != torch.float64)
    monkeypatch.setattr(chunked, "_WARNED", set())
    monkeypatch.setattr(triton_chunked, "_LAUNCHABLE", {})
    monkeypatch.setattr(triton_chunked, "_gpu", lambda device: ("Simulated H100", 9, 0))
    loaded = []

    def load(name, grid, args, config, constexprs):
        loaded.append(name)
        if name == "query_backward_dv":
            raise OutOfResources(278528, 232448, "shared memory")
    monkeypatch.setattr(triton_chunked, "_load", load)
    return loaded


def test_auto_falls_back_with_one_warning_when_a_kernel_cannot_launch(simulated_gpu):
    import warnings
    tensors, _ = core_inputs(4, torch.float32, B=1, N=40, H=2, R=16, Dv=16, M=16, delta="init",
                             contraction=False, with_state=False)
    ref = run_form("chunked", tensors, None, "hermitian", 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = run_form("auto", tensors, None, "hermitian", 16)
        second = run_form("auto", tensors, None, "hermitian", 16)
    messages = [str(w.message) for w in caught if "core_impl=auto" in str(w.message)]
    assert len(messages) == 1, messages
    assert "query_backward_dv" in messages[0] and "232448" in messages[0] and "PyTorch" in messages[0]
    assert "query_backward_dv" in simulated_gpu and "walk_forward" in simulated_gpu   # the launches were checked
    for got in (first, second):   # the PyTorch form's numbers, not the kernel's
        assert torch.equal(got[0], ref[0])
        for name in ref[2]:
            assert torch.equal(got[2][name], ref[2][name]), name


def test_forced_triton_names_the_kernel_the_shape_and_the_limit(simulated_gpu):
    tensors, _ = core_inputs(4, torch.float32, B=1, N=40, H=2, R=16, Dv=16, M=16, delta="init",
                             contraction=False, with_state=False)
    with pytest.raises(ValueError) as error:
        run_form("triton", tensors, None, "hermitian", 16)
    message = str(error.value)
    assert "\n" not in message
    for part in ("core_impl=triton", "query_backward_dv", "T=16 M=16 R=16 Dv=16", "Required: 278528",
                 "Hardware limit: 232448", "Simulated H100 (sm_90)", "core_impl=auto"):
        assert part in message, (part, message)


def test_auto_without_usable_triton_warns_once_and_uses_pytorch(monkeypatch):
    import warnings

    from megatron_id.ops.interdomain import chunked
    monkeypatch.setattr(chunked, "_kernel_candidate", lambda x: True)
    monkeypatch.setattr(chunked, "_WARNED", set())
    monkeypatch.setattr(chunked, "_triton_kernels", lambda: None)
    monkeypatch.setattr(chunked, "_TRITON_IMPORT_ERROR",
                        ["the Triton core needs triton >= 3.3 (tl.gather); this is triton 3.2.0"])
    x = torch.zeros(1, 4, 1, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not chunked.uses_triton("auto", x)
        assert not chunked.uses_triton("auto", x)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "triton 3.2.0" in messages[0] and "megatron-id[triton]" in messages[0]


def test_forced_triton_refuses_float64_and_names_the_fix():
    from megatron_id.ops.interdomain import chunked
    tensors, _ = core_inputs(0, torch.float64, B=1, N=8, H=1, R=4, Dv=4, M=4, delta="init",
                             contraction=False, with_state=False)
    with pytest.raises(ValueError, match="core_impl=autograd or recompute"):
        run_form("triton", tensors, None, "hermitian", 16)
    assert not chunked.uses_triton("auto", torch.zeros(1))   # CPU tensors: auto keeps PyTorch


@pytest.mark.parametrize("switches", [[], ["model.mixer=s4d"], ["model.query_readout=false"],
                                      ["model.readout=plain", "model.output_gate=true"]],
                         ids=["interdomain", "s4d", "no-query", "plain-gate"])
def test_layer_with_triton_core_equals_pytorch(tiny_config, switches):
    """model.core_impl=triton in the mixer (convs, RoPE, feature maps and norms in PyTorch
    around the kernels): the layer's output, its prefill state and every parameter gradient
    equal the autograd form's (float32, chunk 8 in the config: the kernel runs chunks of 16)."""
    from megatron_id.model.init import initialize
    from megatron_id.model.mixers import InterdomainMixer

    def layer(impl):
        cfg = tiny_config("model.d_model=32", "model.n_heads=2", "model.state_size=6",
                          "model.chunk_size=8", f"model.core_impl={impl}", *switches)
        mixer = InterdomainMixer(cfg, residual_std=0.1)
        initialize(mixer, seed=2)
        return mixer

    x = torch.randn(2, 45, 32, generator=torch.Generator().manual_seed(3))
    results = []
    for impl in ("triton", "autograd"):
        mixer = layer(impl)
        y = mixer(x)
        assert (impl == "triton") == ("_TritonCoreBackward" in graph_names(y))
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, 32)).sum(), list(mixer.parameters()))
        with torch.no_grad():
            prefill, state = mixer(x[:, :30], return_state=True)
            step, _ = mixer(x[:, 30:], state=state, return_state=True)
        results.append((y, grads, state["ssm"], torch.cat([prefill, step], 1)))
    (y, grads, ssm, resumed), (y_ref, grads_ref, ssm_ref, _) = results
    _close(y, y_ref, 1e-5, "output")
    _close(ssm, ssm_ref, 1e-5, "prefill state")
    _close(resumed, y_ref, 1e-5, "prefill + continuation = one pass")
    for (name, _), g, g_ref in zip(layer("autograd").named_parameters(), grads, grads_ref):
        _close(g, g_ref, 1e-4, f"grad {name}")


def test_checkpoint_readers_do_not_inherit_a_forced_kernel(tiny_config):
    """A run trained with model.core_impl=triton records it; eval, generate and export read the
    checkpoint with `auto` (the device decides), so the same checkpoint works on a CPU."""
    from megatron_id.checkpoint.files import ClientState, model_config_dict
    from megatron_id.config import CoreImpl
    saved = model_config_dict(tiny_config("model.core_impl=triton"))
    assert saved["core_impl"] == "triton"
    cfg = ClientState(step=1, model=saved).model_config()
    assert cfg.core_impl == CoreImpl.auto and cfg.d_model == 64
