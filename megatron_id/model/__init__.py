"""Model math, single-device: layers, mixers, the decoder, initialisation, accounting."""
from .language_model import LanguageModel, lm_loss

__all__ = ["LanguageModel", "lm_loss"]
