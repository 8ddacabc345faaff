"""Building blocks: RMSNorm (torch and apex paths), RoPE, feature map, short conv."""
import torch
from conftest import relative_error

from megatron_id.model import layers


def test_rms_norm_torch_path():
    norm = layers.RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x = torch.randn(3, 5, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.arange(1.0, 9.0)
    assert relative_error(norm(x), expected) < 1e-6
    assert norm(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_rms_norm_uses_apex_when_importable(monkeypatch):
    """apex is CUDA-only and not on PyPI: stand in a fused kernel and check it is dispatched to
    (with the right arguments) when available, and that both paths give the same numbers."""
    calls = []

    def fake_fused(x, weight, shape, eps):
        calls.append((tuple(shape), eps))
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    norm = layers.RMSNorm(8, eps=1e-5)
    x = torch.randn(4, 8)
    torch_path = norm(x)
    monkeypatch.setattr(layers, "_apex_rms_norm", fake_fused)
    assert not layers.use_fused_rms_norm(x)          # CPU tensors never take the CUDA kernel
    monkeypatch.setattr(layers, "use_fused_rms_norm", lambda t: layers._apex_rms_norm is not None)
    fused_path = norm(x)
    assert calls == [((8,), 1e-5)]
    assert relative_error(fused_path, torch_path) < 1e-6


def test_rope_is_relative():
    """q.k after RoPE depends only on the distance between positions, and norms are kept."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 2, 16, generator=g), torch.randn(1, 1, 2, 16, generator=g)
    dot = lambda pq, pk: (layers.apply_rope(q, pq, 1e4) * layers.apply_rope(k, pk, 1e4)).sum(-1)
    assert torch.allclose(dot(5, 2), dot(103, 100), atol=1e-5)
    assert not torch.allclose(dot(5, 2), dot(5, 3), atol=1e-3)
    rotated = layers.apply_rope(q, 1234567, 1e4)   # far beyond any table a model might have kept
    assert torch.allclose(rotated.norm(dim=-1), q.norm(dim=-1), atol=1e-5)


def test_rope_offset_matches_full_sequence():
    x = torch.randn(2, 12, 3, 8)
    full = layers.apply_rope(x, 0, 1e4)
    assert torch.allclose(layers.apply_rope(x[:, 7:], 7, 1e4), full[:, 7:], atol=1e-6)


def test_feature_map_is_unit_norm_silu():
    x = torch.randn(4, 6, 2, 8)
    xi = layers.feature_map(x)
    assert torch.allclose(xi.norm(dim=-1), torch.ones(4, 6, 2), atol=1e-6)
    assert torch.allclose(xi * torch.nn.functional.silu(x).norm(dim=-1, keepdim=True),
                          torch.nn.functional.silu(x), atol=1e-6)


def test_short_conv_is_causal_and_streams():
    conv = layers.ShortConv(6, kernel=4)
    with torch.no_grad():
        conv.weight.normal_()
        conv.bias.normal_()
    x = torch.randn(2, 10, 6)
    y, _ = conv(x)
    # literal definition: y_t = b + sum_{s=0..3} w[3-s] x_{t-s}
    xp = torch.nn.functional.pad(x, (0, 0, 3, 0))
    expected = conv.bias + sum(conv.weight[:, 0, 3 - s] * xp[:, 3 - s:13 - s] for s in range(4))
    assert relative_error(y, expected) < 1e-6
    state, outs = None, []
    for t in range(10):   # one token at a time through the carried state
        o, state = conv(x[:, t:t + 1], state)
        outs.append(o)
    assert relative_error(torch.cat(outs, dim=1), y) < 1e-6
