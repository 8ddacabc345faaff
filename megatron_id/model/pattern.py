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

Plain torch-free code on the ModelConfig of model/spec.py (the training config's, or the one an
HF export rebuilds from its config.json: the export bundles this file); per-layer configs are
copies of it. The letters are those of model/spec.py's MIXER_SPECS, each mixer's row.
"""
from __future__ import annotations

import copy

from .spec import LETTER_MIXERS, MIXER_SPECS, Letter, ModelConfig

# every letter of model.layer_pattern, in the order reports list them (LETTER_MIXERS')
LAYER_KINDS: dict[str, Letter] = {letter: MIXER_SPECS[mixer].letters[letter] for letter, mixer in LETTER_MIXERS.items()}
# letter -> the model.mixer value whose module runs it (model/spec.py MIXERS)
LAYER_MIXERS = dict(LETTER_MIXERS)
# a uniform model's letter: its mixer's first letter (A, not W)
LETTER_OF_MIXER = {mixer: next(iter(spec.letters)) for mixer, spec in MIXER_SPECS.items() if spec.letters}
STAGE_MARK = "|"


def spelled_out(layer_pattern: str | None, mixer: str, n_layers: int) -> str:
    """One letter per layer from the three keys that decide it (mixer: a model.mixer value)."""
    if layer_pattern:
        return layer_pattern.replace(STAGE_MARK, "")
    return LETTER_OF_MIXER[mixer] * n_layers


def layer_letters(cfg: ModelConfig) -> str:
    """One letter per layer (the pattern without its stage marks)."""
    return spelled_out(cfg.layer_pattern, cfg.mixer.value, cfg.n_layers)


def is_hybrid(cfg) -> bool:
    """More than one kind of layer (A and W count as two)."""
    return len(set(layer_letters(cfg))) > 1


def stage_layer_counts(cfg) -> list[int] | None:
    """Layers per segment between the pattern's stage marks; None without marks."""
    pattern = cfg.layer_pattern
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
    return cfg.window if layer_letters(cfg)[index] == "W" else None


def describe_pattern(cfg) -> str:
    """'IIIAIIIAIIIA (9 interdomain, 3 softmax)' / 'uniform interdomain x 12'."""
    letters = layer_letters(cfg)
    if not is_hybrid(cfg):
        return f"{LAYER_KINDS[letters[0]].name} x {len(letters)}"
    counts = ", ".join(f"{letters.count(c)} {kind.name}" for c, kind in LAYER_KINDS.items() if c in letters)
    return f"{cfg.layer_pattern} ({counts})"


def model_label(cfg) -> str:
    """What a header calls the model's mixer: 'interdomain', or 'hybrid IIIAIIIAIIIA' (with
    ', window N' when it has W layers)."""
    label = cfg.mixer.value
    if is_hybrid(cfg) or "W" in layer_letters(cfg):
        label = f"{label} {cfg.layer_pattern}"
        if "W" in layer_letters(cfg):
            label += f" window={cfg.window}"
    return label
