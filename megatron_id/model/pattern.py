"""Which mixer each layer runs: `model.layer_pattern`, one letter per layer (hybrid models).

    I   interdomain attention   the cube switches (model.query_readout, dual_kv_input, rope,
                                readout, output_gate) apply to these layers
    S   S4D-only                the paper's control: no query readout, one input, no RoPE
    A   softmax attention       causal, RoPE; its KV cache grows with the context
    W   sliding-window softmax  each token sees itself and the model.window - 1 tokens before
                                it; a KV cache of at most model.window tokens
    |   pipeline-stage boundary optional; read when parallel.pipeline_model_parallel_size > 1
                                (one segment per stage), ignored at PP = 1

    model.layer_pattern=IIIAIIIAIIIA    (configs/model/125m-hybrid.yaml: one softmax layer in four)
    model.layer_pattern="IIA|IIA"       (two stages of three layers at PP = 2)

As Megatron-LM's --hybrid-layer-pattern (M, *, - and | there). Unset, the pattern is
model.mixer's letter repeated n_layers times, and every layer gets the model's own config, so a
uniform model is built exactly as before (same modules, names and initial weights).

Plain code on any config-like object (the training ModelConfig, or the namespace of an HF
export: the export bundles this file), so it reads fields with getattr and builds per-layer
configs by copying.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerKind:
    """One letter of model.layer_pattern."""
    mixer: str                  # the model.mixer value whose module runs it (model/mixers MIXERS)
    name: str                   # what reports call it
    switches: dict | None       # its layer's config in a hybrid: these keys replaced; None: the model's own


# the one table of layer letters: config.py's pattern check, the model build, the reports and
# the HF export all read it (docs/adding-a-mixer.md adds a letter here)
LAYER_KINDS = {
    "I": LayerKind("interdomain", "interdomain", None),   # the cube switches apply to these layers
    "S": LayerKind("s4d", "s4d", dict(query_readout=False, dual_kv_input=False, rope=False, output_gate=False,
                                      window=None)),
    "A": LayerKind("softmax", "softmax", dict(query_readout=None, dual_kv_input=None, rope=True,
                                              output_gate=False, window=None)),
    "W": LayerKind("softmax", "sliding-window softmax", dict(query_readout=None, dual_kv_input=None, rope=True,
                                                             output_gate=False)),
}
LAYER_MIXERS = {letter: kind.mixer for letter, kind in LAYER_KINDS.items()}
# a uniform model's letter: its mixer's first letter (A, not W)
LETTER_OF_MIXER = {kind.mixer: letter for letter, kind in reversed(LAYER_KINDS.items())}
STAGE_MARK = "|"


def _value(x):
    return getattr(x, "value", x)


def layer_letters(cfg) -> str:
    """One letter per layer (the pattern without its stage marks)."""
    pattern = getattr(cfg, "layer_pattern", None)
    if pattern:
        return pattern.replace(STAGE_MARK, "")
    return LETTER_OF_MIXER[_value(cfg.mixer)] * cfg.n_layers


def is_hybrid(cfg) -> bool:
    """More than one kind of layer (A and W count as two)."""
    return len(set(layer_letters(cfg))) > 1


def stage_layer_counts(cfg) -> list[int] | None:
    """Layers per segment between the pattern's stage marks; None without marks."""
    pattern = getattr(cfg, "layer_pattern", None)
    if not pattern or STAGE_MARK not in pattern:
        return None
    return [len(part) for part in pattern.split(STAGE_MARK)]


def layer_config(cfg, index: int):
    """The config layer `index`'s mixer is built from: the model's own for a uniform model, a
    copy with the letter's switches for the S, A and W layers of a hybrid (the I layers keep
    the model's cube switches)."""
    switches = LAYER_KINDS[layer_letters(cfg)[index]].switches
    if not is_hybrid(cfg) or switches is None:
        return cfg
    layer = copy.copy(cfg)
    for key, value in switches.items():
        setattr(layer, key, value)
    return layer


def layer_mixer(cfg, index: int) -> str:
    """The model.mixer value that runs layer `index` ('softmax' for A and W)."""
    return LAYER_MIXERS[layer_letters(cfg)[index]]


def layer_window(cfg, index: int) -> int | None:
    """The attention window of layer `index` (W layers), else None."""
    return getattr(cfg, "window", None) if layer_letters(cfg)[index] == "W" else None


def describe_pattern(cfg) -> str:
    """'IIIAIIIAIIIA (9 interdomain, 3 softmax)' / 'uniform interdomain x 12'."""
    letters = layer_letters(cfg)
    if not is_hybrid(cfg):
        return f"{LAYER_KINDS[letters[0]].name} x {len(letters)}"
    counts = ", ".join(f"{letters.count(c)} {kind.name}" for c, kind in LAYER_KINDS.items() if c in letters)
    return f"{getattr(cfg, 'layer_pattern')} ({counts})"


def model_label(cfg) -> str:
    """What a header calls the model's mixer: 'interdomain', or 'hybrid IIIAIIIAIIIA' (with
    ', window N' when it has W layers)."""
    label = _value(cfg.mixer)
    if is_hybrid(cfg) or "W" in layer_letters(cfg):
        label = f"{label} {getattr(cfg, 'layer_pattern')}"
        if "W" in layer_letters(cfg):
            label += f" window={getattr(cfg, 'window')}"
    return label
