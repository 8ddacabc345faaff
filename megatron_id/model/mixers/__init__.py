"""Token mixers. Each is plain single-device code with one interface (docs/adding-a-mixer.md):

    @mixer_module("name")                          the model.mixer values it runs (model/spec.py)
    Mixer(cfg, residual_std, form="chunked")      cfg: the layer's model config
    forward(x [B, N, d], state=None, return_state=False, start=None, seq_idx=None, position_ids=None)
    PARAMETER_ROLES, initial_value(...)            model/roles.py, model/init.py
    core_macs_per_token(cfg, context), decode_state_numbers(cfg)   model/accounting.py
    context_parallel = None                        only if it runs context parallel
    optional, the fused decode (model/mixers/decode.py, inference/fused_decode.py):
    decode_facts(), decode_tables(real_update=False), allocate_decode_state(n_slots, capacity=None,
    device=None), load_decode_state(buffers, slot, state), decode_step

A state makes it continue a prefix (prefill in one call, decode one token at a time). Which
mixer a layer runs: model/pattern.py's letters (model/spec.py's MIXER_SPECS), whose mixer
names a key of MIXERS. Every module of this folder is imported here, so a new mixer's file
registers itself with no line added to this one."""
import importlib
import pkgutil

from ..spec import LETTER_MIXERS, MIXERS
from .interdomain import InterdomainMixer
from .softmax import SoftmaxAttention


def _import_every_module() -> None:
    """Each mixer module registers the values it runs when it is imported (@mixer_module)."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_every_module()   # not bundled: the HF bundle holds every module of this folder already (hf/bundle.py)
_without_module = sorted({mixer for mixer in LETTER_MIXERS.values() if mixer not in MIXERS})
if _without_module:
    raise ImportError(f"no mixer module runs model.mixer={', '.join(_without_module)}: a module of "
                      f"model/mixers/ declares it with @mixer_module (docs/adding-a-mixer.md).")


def build_mixer(cfg, residual_std: float, form: str = "chunked", kind: str | None = None):
    """kind: a key of MIXERS (a hybrid's layer, model/pattern.layer_mixer); None: model.mixer."""
    kind = kind or cfg.mixer.value
    return MIXERS[kind](cfg, residual_std, form=form)


__all__ = ["InterdomainMixer", "MIXERS", "SoftmaxAttention", "build_mixer"]
