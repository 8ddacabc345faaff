"""RoPE's frequencies: the plain base (model.rope_theta) and the context-extension scalings that
pretrained models ship with (model.rope_scaling), computed as transformers computes them
(modeling_rope_utils.py, read to learn the formulas; the papers: linear position interpolation,
Chen et al. 2023; "dynamic" NTK-aware scaling, bloc97 / emozilla; YaRN, Peng et al. 2023; Llama
3.1's wavelength-banded scaling, Meta 2024).

model.rope_scaling holds transformers' own keys (a config.json's rope_parameters / rope_scaling,
so a user can copy it over): `rope_type` and

    linear   factor                           every inverse frequency / factor
    dynamic  factor, original_max_position_embeddings
                                              past the original context, the base grows with the
                                              call's length L: theta * (factor L / orig - factor + 1)
                                              ** (D / (D - 2)); at or below it, plain RoPE
    yarn     factor, original_max_position_embeddings; optional beta_fast (32), beta_slow (1),
             attention_factor (0.1 ln(factor) + 1, or from mscale / mscale_all_dim), truncate (true)
                                              low frequencies interpolated, high ones kept, a
                                              linear ramp between; cos and sin times attention_factor
    llama3   factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
                                              wavelengths above orig / low_freq_factor divided by
                                              factor, below orig / high_freq_factor kept, smoothed
                                              between

"dynamic" differs from transformers in one way, said where it is imported: transformers keeps the
longest length a loaded model has seen and uses its base until a call within the original context
resets it; here each call uses its own length (the same for a fresh model's forward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# rope_type -> (required keys, optional keys with their defaults)
SCALINGS = {
    "linear": (("factor",), {}),
    "dynamic": (("factor", "original_max_position_embeddings"), {}),
    "yarn": (("factor", "original_max_position_embeddings"),
             {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "mscale": None,
              "mscale_all_dim": None, "truncate": True}),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), {}),
}


class RopeScalingError(ValueError):
    pass


def check_scaling(scaling) -> None:
    """model.rope_scaling's keys and values (None: plain RoPE); the error names the key and the fix."""
    if scaling is None:
        return
    if not hasattr(scaling, "keys"):
        raise RopeScalingError(f"model.rope_scaling={scaling!r} is invalid: it must be a mapping with rope_type "
                               f"({', '.join(SCALINGS)}) and that type's keys, or null for plain RoPE.")
    kind = scaling.get("rope_type")
    if kind not in SCALINGS:
        raise RopeScalingError(f"model.rope_scaling.rope_type={kind!r} is invalid: it must be one of "
                               f"{', '.join(SCALINGS)} (null model.rope_scaling: plain RoPE).")
    required, optional = SCALINGS[kind]
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise RopeScalingError(f"model.rope_scaling (rope_type {kind}) lacks {', '.join(missing)}: {kind} needs "
                               f"{', '.join(required)}.")
    unknown = sorted(set(scaling) - set(required) - set(optional) - {"rope_type"})
    if unknown:
        raise RopeScalingError(f"model.rope_scaling (rope_type {kind}) has keys it does not use: {', '.join(unknown)} "
                               f"(it reads {', '.join(required + tuple(optional))}).")
    for key in required + tuple(k for k in optional if k != "truncate"):
        value = scaling.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise RopeScalingError(f"model.rope_scaling.{key}={value!r} is invalid: it must be a positive number.")
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise RopeScalingError(f"model.rope_scaling.high_freq_factor={scaling['high_freq_factor']} must be above "
                               f"low_freq_factor={scaling['low_freq_factor']} (Llama 3.1: 4 and 1).")


@dataclass(frozen=True)
class Rope:
    """RoPE's base and scaling, hashable (decode steps key their tables by it)."""
    theta: float = 10000.0
    kind: str = "default"
    params: tuple = ()      # the scaling's (key, value) pairs, sorted

    @classmethod
    def of(cls, model_cfg) -> "Rope":
        scaling = model_cfg.rope_scaling
        if not scaling:
            return cls(float(model_cfg.rope_theta))
        check_scaling(scaling)
        required, optional = SCALINGS[scaling["rope_type"]]
        values = {**optional, **{k: v for k, v in scaling.items() if k != "rope_type"}}
        return cls(float(model_cfg.rope_theta), scaling["rope_type"], tuple(sorted(values.items())))

    def frequencies(self, dim: int, device=None, dtype=None, length: int | None = None):
        """(inverse frequencies [dim / 2], the factor on cos and sin) for heads `dim` wide, in float32
        unless `dtype`; `length`: the call's positions end there (only "dynamic" reads it)."""
        import torch  # not at import: config.py checks model.rope_scaling here, and the CLI imports no torch
        dtype = dtype or torch.float32
        p = dict(self.params)
        exponents = torch.arange(0, dim, 2, device=device, dtype=dtype) / dim
        base = self.theta
        if self.kind == "dynamic":
            original = p["original_max_position_embeddings"]
            length = max(length or original, original)
            base = base * (p["factor"] * length / original - (p["factor"] - 1)) ** (dim / (dim - 2))
        inv_freq = base ** -exponents
        if self.kind == "linear":
            return inv_freq / p["factor"], 1.0
        if self.kind == "llama3":
            return llama3_frequencies(inv_freq, p), 1.0
        if self.kind == "yarn":
            return yarn_frequencies(inv_freq, dim, self.theta, p)
        return inv_freq, 1.0

    def angles(self, positions: torch.Tensor, dim: int, dtype=None):
        """(cos, sin) [..., dim / 2] at `positions` (any shape), the attention factor applied."""
        length = int(positions.max()) + 1 if self.kind == "dynamic" and positions.numel() else None
        inv_freq, factor = self.frequencies(dim, positions.device, dtype, length)
        angles = positions.to(inv_freq.dtype)[..., None] * inv_freq
        cos, sin = angles.cos(), angles.sin()
        return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)


def llama3_frequencies(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths (above original / low_freq_factor) slowed by `factor`, short ones
    (below original / high_freq_factor) kept, a smooth blend between."""
    original, factor = p["original_max_position_embeddings"], p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    import torch
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(middle, blended, scaled)


def yarn_frequencies(inv_freq: torch.Tensor, dim: int, theta: float, p: dict):
    """YaRN: dimensions turning fewer than beta_slow times over the original context are
    interpolated (/ factor), more than beta_fast times kept, a linear ramp between; cos and sin are
    scaled by the attention factor."""
    import torch
    factor, original = p["factor"], p["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attention = p["attention_factor"]
    if attention is None:
        attention = (mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
                     if p["mscale"] and p["mscale_all_dim"] else mscale(factor))

    def dimension(rotations):   # the dimension that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dimension(p["beta_fast"]), dimension(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # (transformers' guard against a zero-width ramp)
    ramp = ((torch.arange(dim // 2, device=inv_freq.device, dtype=inv_freq.dtype) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return inv_freq / factor * (1 - kept) + inv_freq * kept, float(attention)
