"""Document-aware and sliding-window softmax without a dense mask (issue 27, ops/attention.py):
the blockwise form and FlexAttention's equal the dense-mask SDPA (float64, < 1e-10, outputs and
gradients), and the softmax mixer with packed documents never builds an [N, N] mask.
The memory at 16K tokens is benchmarks/attention_memory.py's."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_id.ops import attention
from megatron_id.ops.attention import blockwise_attention, causal_attention, flex_attention_form, masked_attention


def _inputs(B=2, H=3, N=300, D=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    seq = torch.zeros(B, N, dtype=torch.long)   # rows with their own document boundaries
    seq[0, 50:], seq[0, 200:], seq[0, 201:] = 1, 2, 3   # (a one-token document too)
    if B > 1:
        seq[1, 120:] = 1
    return q, k, v, seq


@pytest.mark.parametrize("documents, window", [(True, None), (False, 37), (True, 37), (True, 1), (False, 1000)])
@pytest.mark.parametrize("block", [1, 7, 64, 256, 1000])
def test_blockwise_equals_the_dense_mask(documents, window, block):
    q, k, v, seq = _inputs()
    seq = seq if documents else None
    want = masked_attention(q, k, v, seq, window)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got = blockwise_attention(q, k, v, seq, window, block=block)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    assert (got - want).abs().max().item() < 1e-10
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max().item() < 1e-10
    with torch.no_grad():   # the inference path (no autograd function)
        assert (blockwise_attention(q, k, v, seq, window, block=block) - want).abs().max().item() < 1e-10


@pytest.mark.parametrize("documents, window", [(True, None), (False, 37), (True, 37)])
def test_flex_attention_rule_equals_the_dense_mask(documents, window):
    """The CUDA form's block mask, run unfused on the CPU (no backward there)."""
    q, k, v, seq = (t.detach() if t.dtype.is_floating_point else t for t in _inputs())
    seq = seq if documents else None
    with warnings.catch_warnings():   # "called without torch.compile": the unfused path, on purpose
        warnings.simplefilter("ignore")
        got = flex_attention_form(q, k, v, seq, window, compiled=False)
    assert (got - masked_attention(q, k, v, seq, window)).abs().max().item() < 1e-10


def test_bf16_autocast_recomputes_alike():
    q, k, v, seq = _inputs(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = masked_attention(q, k, v, seq, 37)
        got = blockwise_attention(q, k, v, seq, 37, block=64)
    assert got.dtype == want.dtype == torch.bfloat16
    # bf16 rounding of the outputs; the blocks' shorter key ranges sum in another order
    assert (got.float() - want.float()).abs().max().item() < 2e-2 * want.float().abs().max().item()
    grads = [torch.autograd.grad(out.float().sum(), (q, k, v)) for out in (got, want)]
    for a, b in zip(*grads):
        assert (a - b).abs().max().item() < 2e-2 * b.abs().max().item()


def test_without_documents_or_window_it_is_sdpas_causal_kernel():
    q, k, v, _ = _inputs(dtype=torch.float32)
    assert torch.equal(causal_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert torch.equal(causal_attention(q, k, v, window=300), F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_the_mixer_with_documents_never_builds_an_n_by_n_mask(monkeypatch):
    """The softmax mixer's training forward with packed documents (and a W layer's window):
    every mask SDPA sees has at most BLOCK query rows, and the output equals the dense form's."""
    from conftest import CONFIGS

    from megatron_id.config import load_config
    from megatron_id.model.mixers import SoftmaxAttention
    from megatron_id.model.mixers import softmax as softmax_module
    N = 700
    x = torch.randn(2, N, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    seq = torch.zeros(2, N, dtype=torch.long)
    seq[:, 100:], seq[1, 400:] = 1, 2
    for items in (["model.mixer=softmax"], ["model.layer_pattern=WW", "model.window=150"]):
        cfg = load_config([CONFIGS / "model" / "tiny.yaml"], items).model
        mixer = SoftmaxAttention(cfg, 0.02).double()
        masks = []
        sdpa = F.scaled_dot_product_attention

        def watched(q, k, v, attn_mask=None, **kwargs):
            if attn_mask is not None:
                masks.append(tuple(attn_mask.shape[-2:]))
            return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)
        with monkeypatch.context() as patch:
            patch.setattr(attention.F, "scaled_dot_product_attention", watched)
            inputs = x.clone().requires_grad_()
            got = mixer(inputs, seq_idx=seq)
            got.sum().backward()
        assert masks and all(rows <= attention.BLOCK for rows, _ in masks), (items, masks[:5])
        with monkeypatch.context() as patch:   # the same layer with the dense mask
            patch.setattr(softmax_module, "causal_attention", masked_attention)
            want = mixer(x, seq_idx=seq)
        assert (got - want).abs().max().item() < 1e-10, items
