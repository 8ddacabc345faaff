"""Token mixers. Each is plain single-device code with one interface:
`forward(x [B, N, d], state=None, return_state=False)`; a state makes it continue a prefix
(prefill in one call, decode one token at a time)."""
from .interdomain import InterdomainMixer
from .softmax import SoftmaxAttention


def build_mixer(cfg, residual_std: float, form: str = "chunked"):
    if cfg.mixer.value == "softmax":
        return SoftmaxAttention(cfg, residual_std)
    return InterdomainMixer(cfg, residual_std, form=form)   # interdomain and s4d


__all__ = ["InterdomainMixer", "SoftmaxAttention", "build_mixer"]
