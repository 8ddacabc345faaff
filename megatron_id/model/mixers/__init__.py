"""Token mixers. Each is plain single-device code with one interface (docs/adding-a-mixer.md):

    Mixer(cfg, residual_std, form="chunked")      cfg: the layer's model config
    forward(x [B, N, d], state=None, return_state=False, start=None, seq_idx=None, position_ids=None)
    PARAMETER_ROLES, initial_value(...)            model/roles.py, model/init.py
    core_macs_per_token(cfg, context), decode_state_numbers(cfg)   model/accounting.py
    context_parallel = None                        only if it runs context parallel

A state makes it continue a prefix (prefill in one call, decode one token at a time). Which
mixer a layer runs: model/pattern.py's letters, whose `mixer` names a key of MIXERS."""
from .interdomain import InterdomainMixer
from .softmax import SoftmaxAttention

# model.mixer value -> the module that runs it (s4d is the interdomain module with both
# ingredients switched off: config.py's MIXER_DEFAULTS / MIXER_FIXED)
MIXERS = {"interdomain": InterdomainMixer, "s4d": InterdomainMixer, "softmax": SoftmaxAttention}


def build_mixer(cfg, residual_std: float, form: str = "chunked", kind: str | None = None):
    """kind: a key of MIXERS (a hybrid's layer, model/pattern.layer_mixer); None: model.mixer."""
    kind = kind or getattr(cfg.mixer, "value", cfg.mixer)
    return MIXERS[kind](cfg, residual_std, form=form)


__all__ = ["InterdomainMixer", "MIXERS", "SoftmaxAttention", "build_mixer"]
