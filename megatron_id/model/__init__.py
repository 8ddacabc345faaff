"""Model math, single-device: layers, mixers, the decoder, initialisation, accounting; and
model/spec.py, the model's config and mixer table, which imports nothing but the standard library.

LanguageModel and lm_loss are imported when first asked for (PEP 562). No import loop needs
this (model code imports model/spec.py, never config.py); it keeps this package free of torch
on import, so that config.py can read model/spec.py without loading the model's torch code."""

__all__ = ["LanguageModel", "lm_loss"]


def __getattr__(name):
    if name in __all__:
        # here, not at the top: importing megatron_id.model.spec runs this file (see above)
        from . import language_model
        return getattr(language_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
