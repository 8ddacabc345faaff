"""The model's config and what each mixer declares to the rest of the stack, free of torch.

Three readers need these, and none of them may need the model's torch code: config.py (the
`model` section of the schema and its validation), model/pattern.py (the layer letters) and a
Hugging Face export, which bundles this file (hf/bundle.py) and rebuilds ModelConfig from its
config.json (`model_config_from_values`). So it holds only the standard library.

MIXER_SPECS has one row per `model.mixer` value: its meaning, its layer letters, the defaults
of the switches left at None, and the switches it fixes; the Mixer enum is made from its keys.
A mixer module registers the values it runs with @mixer_module, into MIXERS. So a new mixer is
its module (model/mixers/) plus a row here (docs/adding-a-mixer.md).
"""
from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Optional


class Readout(str, Enum):
    hermitian = "hermitian"   # conj(xi(q) . U) Gamma: a Parseval inner product of the coefficients
    plain = "plain"           # without the conjugate (the ablation)


class CoreImpl(str, Enum):
    """How the interdomain / S4D core is computed in training (ops/interdomain/chunked.py)."""
    auto = "auto"             # triton on CUDA when installed; else recompute from 16K tokens on
    autograd = "autograd"     # chunked, autograd keeps every intra-chunk tensor
    recompute = "recompute"   # chunked, backward recomputes segment by segment (bounded memory)
    triton = "triton"         # the fused Triton kernels (ops/interdomain/triton_chunked.py), forced


@dataclass(frozen=True)
class Letter:
    """One letter of model.layer_pattern (model/pattern.py)."""
    name: str                   # what reports call its layers
    switches: dict | None       # its layer's config in a hybrid: these keys replaced; None: the model's own


@dataclass(frozen=True)
class MixerSpec:
    """One row of MIXER_SPECS: what config.py, model/pattern.py and the export know of a mixer."""
    meaning: str                # what the value means (docs/reference/config.md, `model.mixer`)
    letters: dict               # its letters (str -> Letter); the first spells a uniform model
    defaults: dict              # the switches left at None under model.mixer=this get these values
    fixed: dict                 # switches it fixes: setting one to anything else is a contradiction


# The one table of mixers, in the order model.mixer lists its values (the reference, config
# errors). s4d is the interdomain mixer with both ingredients removed; the paper's S4D-only
# control has no RoPE ("S4D-only + RoPE" is a separate cube cell), so rope defaults to off for it.
MIXER_SPECS = {
    "interdomain": MixerSpec(
        "the paper's: S4D state over keys and values, read by each query",
        letters={"I": Letter("interdomain", None)},   # the cube switches apply to these layers
        defaults=dict(query_readout=True, dual_kv_input=True, rope=True),
        fixed={}),
    "softmax": MixerSpec(
        "causal softmax attention with RoPE (the baseline)",
        letters={"A": Letter("softmax", dict(query_readout=None, dual_kv_input=None, rope=True, output_gate=False,
                                             window=None)),
                 "W": Letter("sliding-window softmax", dict(query_readout=None, dual_kv_input=None, rope=True,
                                                            output_gate=False))},
        defaults=dict(query_readout=None, dual_kv_input=None, rope=True),
        fixed=dict(query_readout=None, dual_kv_input=None, output_gate=False, readout=Readout.hermitian)),
    "s4d": MixerSpec(
        "S4D-only: interdomain without its two ingredients (the control)",
        letters={"S": Letter("s4d", dict(query_readout=False, dual_kv_input=False, rope=False, output_gate=False,
                                         window=None))},
        defaults=dict(query_readout=False, dual_kv_input=False, rope=False),
        fixed=dict(query_readout=False, dual_kv_input=False)),
    # a hybrid has no letter of its own; its switches are its interdomain layers' (the other
    # letters fix their layers' switches above)
    "hybrid": MixerSpec(
        "more than one kind of layer: model.layer_pattern says which (model/pattern.py)",
        letters={},
        defaults=dict(query_readout=True, dual_kv_input=True, rope=True),
        fixed={}),
}

# model.mixer's values, one per row (Mixer.interdomain == "interdomain", as YAML gives it)
Mixer = Enum("Mixer", [(name, name) for name in MIXER_SPECS], type=str, module=__name__, qualname="Mixer")

# every letter of model.layer_pattern -> the model.mixer value whose module runs it, in the order
# reports and config errors list the letters: I, S, A, W as they always have, then any other
# row's letters in MIXER_SPECS' order
_LISTED_FIRST = "ISAW"
LETTER_MIXERS = dict(sorted(((letter, name) for name, spec in MIXER_SPECS.items() for letter in spec.letters),
                            key=lambda item: _LISTED_FIRST.index(item[0]) if item[0] in _LISTED_FIRST
                            else len(_LISTED_FIRST)))

# model.mixer value -> the class that runs it (model/mixers/ MIXERS). Each mixer module registers
# itself with @mixer_module; model/mixers/__init__.py imports every module of its folder.
MIXERS: dict[str, type] = {}


def mixer_module(*names: str):
    """Class decorator: the class runs these model.mixer values (rows of MIXER_SPECS), e.g.
    @mixer_module("interdomain", "s4d") (s4d: the same module with both ingredients switched off)."""
    def register(cls):
        for name in names:
            if name not in MIXER_SPECS:
                raise ValueError(f"@mixer_module({name!r}) on {cls.__name__}: model.mixer={name} has no row in "
                                 f"MIXER_SPECS (model/spec.py); add one (docs/adding-a-mixer.md).")
            other = MIXERS.setdefault(name, cls)
            if other.__qualname__ != cls.__qualname__:
                raise ValueError(f"@mixer_module({name!r}) on {cls.__name__}: {other.__qualname__} runs "
                                 f"model.mixer={name} already.")
            MIXERS[name] = cls   # the same class imported again (a reload) replaces itself
        return cls
    return register


@dataclass
class ModelConfig:
    mixer: Mixer = Mixer.interdomain  # the sequence mixer of every layer (model.layer_pattern mixes them)
    # one letter per layer, I interdomain / S S4D-only / A softmax / W sliding-window softmax, |
    # a pipeline-stage boundary (model/pattern.py). None: model.mixer's letter on every layer.
    # Given, it decides the mixers and model.mixer becomes the one it uses, or hybrid
    layer_pattern: Optional[str] = None
    window: Optional[int] = None      # tokens a W layer's query sees (itself included)
    vocab_size: int = 32000           # the tokenizer's; padded for TP (make_vocab_size_divisible_by)
    d_model: int = 768                # width of the residual stream
    n_layers: int = 12                # blocks (mixer + SwiGLU), pre-norm
    n_heads: int = 12                 # heads of every mixer; head width d_model / n_heads
    # grouped-query attention (softmax layers, A and W): key/value heads, each shared by
    # n_heads / n_kv_heads query heads (query head i reads kv head i // (n_heads / n_kv_heads),
    # HF's repeat_kv); the KV cache keeps these only. Megatron's --num-query-groups, HF's
    # num_key_value_heads. None: n_heads (multi-head attention)
    n_kv_heads: Optional[int] = None
    seq_length: int = 4096            # training context; the model itself has no length limit
    ffn_hidden: Optional[int] = None  # None: ceil((8 d / 3) / ffn_multiple_of) * ffn_multiple_of
    ffn_multiple_of: int = 128        # the SwiGLU hidden width is rounded up to a multiple of it
    norm_eps: float = 1e-6            # RMSNorm's epsilon
    init_std: float = 0.02            # N(0, std) weights; residual output projections std/sqrt(2L)
    rope_theta: float = 10000.0       # RoPE's base
    # a pretrained model's context-extension scaling of RoPE, in transformers' keys (rope_type
    # linear, dynamic, yarn or llama3 and that type's factors: model/rope.py); None: plain RoPE
    rope_scaling: Optional[Dict[str, Any]] = None
    state_size: int = 64              # M, basis functions (modes) per head of the interdomain / S4D core
    conv_kernel: int = 4              # short causal depthwise conv
    chunk_size: int = 64              # T of the chunked training form
    core_impl: CoreImpl = CoreImpl.auto   # how the core is computed in training (same function)
    # Delta's initial range, log-uniform per head (the paper's 1e-3..1e-1). With A's real part
    # at -1/2, the slowest mode forgets over ~2/dt_min tokens (2,000 at the paper's value, half
    # its 4K context); a run at a much shorter context may scale it (docs/replication.md)
    dt_min: float = 1e-3
    dt_max: float = 1e-1              # the upper end of Delta's initial range
    # the ablation cube; None means "the mixer's default" (MIXER_SPECS in model/spec.py)
    query_readout: Optional[bool] = None   # queries read the state through a feature map (off: a contraction)
    dual_kv_input: Optional[bool] = None   # keys and values from their own projections (interdomain)
    rope: Optional[bool] = None       # RoPE on queries and keys
    readout: Readout = Readout.hermitian   # how complex key and value coefficients meet
    output_gate: bool = False         # o <- o * SiLU(x W_g) before W_O (off in the paper)
    # biases on the q, k and v projections of softmax layers (Qwen2's; W_O has none), zero at init
    qkv_bias: bool = False
    # the LM head reuses the input embedding matrix [our choice: off, as in the paper's counts]
    tie_embeddings: bool = False
    # tensor parallelism pads the vocabulary to a multiple of this x TP (Megatron's rule); the
    # padded logits are masked out of the loss, so padding never changes the model's function
    make_vocab_size_divisible_by: int = 128


def ffn_hidden_size(m: ModelConfig) -> int:
    if m.ffn_hidden is not None:
        return m.ffn_hidden
    return math.ceil((8 * m.d_model / 3) / m.ffn_multiple_of) * m.ffn_multiple_of


def kv_heads(m: ModelConfig) -> int:
    """The key/value heads of a softmax layer: model.n_kv_heads, or n_heads when unset."""
    return m.n_heads if m.n_kv_heads is None else m.n_kv_heads


def model_config_from_values(values: dict) -> ModelConfig:
    """config.json's `model` section (enums as their values) -> the ModelConfig it was written
    from. A key it lacks takes the field's default: the value the model had before that key
    existed, so exports written before it load unchanged. An unknown key is a TypeError."""
    hints = typing.get_type_hints(ModelConfig)

    def typed(key, value):
        kind = hints.get(key)
        return kind(value) if isinstance(kind, type) and issubclass(kind, Enum) else value
    return ModelConfig(**{key: typed(key, value) for key, value in values.items()})
