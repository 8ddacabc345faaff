"""Model math, single-device: layers, mixers, the decoder, initialisation, accounting.

LanguageModel and lm_loss are imported when first asked for (PEP 562), so that config.py can
read the torch-free layer table of model/pattern.py without importing the model (which imports
config.py)."""

__all__ = ["LanguageModel", "lm_loss"]


def __getattr__(name):
    if name in __all__:
        from . import language_model
        return getattr(language_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
