"""The Triton kernels of the chunked core (ops/interdomain/triton_chunked.py) compute the naive
recurrence's numbers: outputs, final state and every gradient (q, k, v, the initial state and
all five parameter tensors), for both readouts and the contraction, on a grid of shapes (lengths
not divisible by the chunk, one token, one chunk; M, R, Dv that need padding and that do not;
several heads; Delta up to 50), with float32 and bf16 inputs.

On this CPU machine the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported; numpy semantics, so the numbers are the kernels' own arithmetic, not a
GPU's). Tolerance: float32 accumulation against the float64 naive reference on the same float32 values,
< 1e-4 relative (the PyTorch chunked form's float32 tolerance in test_interdomain_forms.py).
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
def test_triton_core_equals_naive(readout, shape, delta, with_state):
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
    """bf16 q, k, v (as under autocast) are read as float32: the result equals the float32
    kernel on the same (bf16-rounded) values, and gradients come back in bf16."""
    common = dict(B=1, N=45, H=2, R=16, Dv=16, M=16, delta="init", contraction=readout == "contraction",
                  with_state=False)
    tensors, _ = core_inputs(2, torch.float32, **common)
    half = {n: (t.detach().to(torch.bfloat16).requires_grad_() if n in ("q", "k", "v") and t is not None else t)
            for n, t in tensors.items()}
    rounded = {n: (t.detach().to(torch.bfloat16).float().requires_grad_() if n in ("q", "k", "v") and t is not None else t)
               for n, t in tensors.items()}
    got = run_form("triton", half, None, "hermitian", 16)
    ref = run_form("triton", rounded, None, "hermitian", 16)
    assert got[0].dtype == torch.float32
    _close(got[0], ref[0], 1e-6, "output")
    for name in ("k", "v"):
        assert got[2][name].dtype == torch.bfloat16
        _close(got[2][name].float(), ref[2][name], 1e-2, f"grad {name}")   # bf16 rounding of the grad


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
