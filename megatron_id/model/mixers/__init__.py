"""Token mixers. Each is plain single-device code with one interface:
`forward(x [B, N, d], state=None, return_state=False)`; a state makes it continue a prefix
(prefill in one call, decode one token at a time). Which one a layer runs: model/pattern.py."""
from .interdomain import InterdomainMixer
from .softmax import SoftmaxAttention


def build_mixer(cfg, residual_std: float, form: str = "chunked", kind: str | None = None):
    """kind: 'interdomain', 's4d' or 'softmax' (a hybrid's layer); None: model.mixer."""
    kind = kind or getattr(cfg.mixer, "value", cfg.mixer)
    if kind == "softmax":
        return SoftmaxAttention(cfg, residual_std)
    return InterdomainMixer(cfg, residual_std, form=form)   # interdomain and s4d


__all__ = ["InterdomainMixer", "SoftmaxAttention", "build_mixer"]
