"""Softmax layers -> interdomain (I) or S4D-only (S) layers initialised from the attention they
replace: the weight mapping of `megatron-id convert` (docs/conversion.md), on tensors and
ModelConfigs alone, and the attention score its --select ranks the layers by. The files (the
source checkpoint, the weights-only output, the data --select reads) are checkpoint/conversion.py's.

Per converted layer (teacher: q, k, v [n_kv_heads x d_h rows], o; the student's streams by cell):

    student stream        teacher weight         how
    q_proj                q_proj                 as is (cells with query readout)
    k_proj | a_proj       k_proj                 each key/value head repeated for its G query heads
    v_proj | b_proj       v_proj                 the same (HF's repeat_kv: query head i reads kv head i // G)
    o_proj (d x d)        o_proj                 as is (query readout: the output is d_h per head)
    o_proj (d x 2d)       o_proj                 its value columns, d_h per head; the key columns fresh
                                                 (contraction readout: [Re c.U, Re c.Gam] per head)

Everything else of the layer starts at the module's own init, drawn with the model's seeded,
per-name generators (model/init.py), so that a fresh tensor equals the one LanguageModel(student,
seed) draws: the short convs, the k/v norms and biases, Delta, A, C, c_h, the output gate. The
teacher's q/k/v biases (Qwen2's) have no place (the interdomain projections have none) and are
dropped; without query readout q_proj has none either. The layers left A / W, the embeddings,
the norms, the SwiGLUs and the LM head are the teacher's tensors themselves.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import BadOptionError
from ..ops.attention import visible
from .init import initialize
from .language_model import LanguageModel
from .layers import apply_rope
from .mixers import build_mixer
from .mixers.softmax import repeat_kv
from .pattern import LAYER_KINDS, STAGE_MARK, layer_config, layer_letters, layer_mixer
from .spec import LETTER_MIXERS, Mixer, ModelConfig, kv_heads

SOFTMAX = "AW"      # the letters a source may have (softmax attention, full or windowed)
CONVERTED = "IS"    # the letters a softmax layer can become
BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias")


def _letters_said() -> str:
    return ", ".join(f"{c} ({LAYER_KINDS[c].name})" for c in CONVERTED + SOFTMAX)


def check_source(teacher: ModelConfig, source: str) -> str:
    """The source's letters; refused unless every layer is softmax attention (A or W)."""
    letters = layer_letters(teacher)
    other = [f"{i} ({LAYER_KINDS[c].name})" for i, c in enumerate(letters) if c not in SOFTMAX]
    if other:
        raise BadOptionError(
            f"{source} is not a softmax model (model.mixer={teacher.mixer.value}; layer {', '.join(other[:4])}"
            f"{' and more' if len(other) > 4 else ''} not softmax attention): convert starts from softmax layers "
            f"(A, W) only. Give a checkpoint of model.mixer=softmax, e.g. one written by megatron-id import-hf.")
    return letters


def check_pattern(teacher: ModelConfig, pattern: str, source: str) -> str:
    """--layer-pattern for the student, normalised (upper case, no spaces), after the checks that
    need no weights: known letters, one per layer of the source, I / S for a converted layer,
    and a layer left softmax keeping its own letter (A stays A, W stays W)."""
    letters = check_source(teacher, source)
    given = pattern
    pattern = pattern.strip().upper().replace(" ", "")
    where = f"--layer-pattern {given!r}"
    wrong = sorted(set(pattern) - set(LETTER_MIXERS) - {STAGE_MARK})
    if wrong:
        raise BadOptionError(f"{where} has {', '.join(repr(c) for c in wrong)}: the letters are {_letters_said()} "
                             f"and | (a pipeline-stage boundary).")
    other = sorted(set(pattern) - set(CONVERTED + SOFTMAX) - {STAGE_MARK})
    if other:
        raise BadOptionError(f"{where} has {', '.join(repr(c) for c in other)}: a softmax layer converts to I or S "
                             f"only (or stays A / W); use {_letters_said()}.")
    if not pattern.replace(STAGE_MARK, "") or any(not part for part in pattern.split(STAGE_MARK)):
        raise BadOptionError(f"{where}: every pipeline stage needs at least one layer (no empty pattern, no "
                             f"leading, trailing or doubled |), e.g. {'I' * len(letters)}.")
    student = pattern.replace(STAGE_MARK, "")
    if len(student) != len(letters):
        raise BadOptionError(f"{where} has {len(student)} layers but {source} has model.n_layers={len(letters)}: "
                             f"give one letter per layer ({len(letters)}), e.g. {'I' * len(letters)}.")
    changed = [f"layer {i} is {t} in the source but {s} here" for i, (t, s) in enumerate(zip(letters, student))
               if s in SOFTMAX and s != t]
    if changed:
        raise BadOptionError(f"{where}: {'; '.join(changed[:3])}. A layer kept as softmax keeps its own letter "
                             f"(A full, W windowed: the source's are {''.join(letters)}); write it as the source "
                             f"has it, or I / S to convert it.")
    if not teacher.rope and any(c in SOFTMAX for c in student) and len(set(student)) > 1:
        raise BadOptionError(f"{where}: the source's softmax layers run without RoPE (model.rope=false), and the A / W "
                             f"layers of a hybrid always have it: converting some of its layers cannot keep the others "
                             f"as they are. Convert every layer (I / S only), or none.")
    return pattern


def student_config(teacher: ModelConfig, pattern: str, switches: dict | None = None) -> ModelConfig:
    """The student's model config before config.resolve: the teacher's shape, `pattern` (checked
    by check_pattern), the cube switches of `switches` (the rest None: the mixer's defaults when
    resolved), and the softmax-only keys (model.n_kv_heads, qkv_bias, window) kept only where a
    layer still uses them. A pattern that keeps every layer softmax is the teacher's config."""
    student = pattern.replace(STAGE_MARK, "")
    if student == layer_letters(teacher):   # every layer kept: the teacher's own model
        return dataclasses.replace(teacher, layer_pattern=pattern if STAGE_MARK in pattern or teacher.layer_pattern
                                   else None, **(switches or {}))
    values = dict(layer_pattern=pattern, mixer=Mixer.hybrid, query_readout=None, dual_kv_input=None, rope=None)
    if not any(c in SOFTMAX for c in student):
        values.update(n_kv_heads=None, qkv_bias=False)
    if "W" not in student:
        values.update(window=None)
    return dataclasses.replace(teacher, **{**values, **(switches or {})})


# ------------------------------------------------------------------------------ the weights

def _expand_kv(weight: torch.Tensor, groups: int, head_dim: int) -> torch.Tensor:
    """[n_kv_heads d_h, d] -> [n_heads d_h, d]: each key/value head's rows repeated for the
    `groups` query heads that read it (kv head j -> heads j G .. j G + G - 1)."""
    if groups == 1:
        return weight
    return weight.view(-1, head_dim, weight.shape[-1]).repeat_interleave(groups, dim=0).reshape(-1, weight.shape[-1])


def _convert_layer(teacher_layer: dict, fresh: dict, mixer, teacher: ModelConfig, letter_from: str,
                   letter_to: str, index: int) -> tuple[dict, dict]:
    """One converted mixer: ({student name: tensor}, its record), names relative to the mixer."""
    head_dim = teacher.d_model // teacher.n_heads
    groups = teacher.n_heads // kv_heads(teacher)
    repeated = f" (each of its {kv_heads(teacher)} key/value heads repeated for the {groups} query heads that " \
        f"read it)" if groups > 1 else ""
    out, carried, partial, dropped = dict(fresh), {}, {}, {}
    if hasattr(mixer, "q_proj"):
        out["q_proj.weight"] = teacher_layer["q_proj.weight"]
        carried["q_proj.weight"] = "q_proj.weight"
    else:
        dropped["q_proj.weight"] = "no queries: without query readout a learned vector c_h reads the state"
    key, value = ("k_proj", "v_proj") if hasattr(mixer, "k_proj") else ("a_proj", "b_proj")
    out[f"{key}.weight"] = _expand_kv(teacher_layer["k_proj.weight"], groups, head_dim)
    out[f"{value}.weight"] = _expand_kv(teacher_layer["v_proj.weight"], groups, head_dim)
    carried[f"{key}.weight"], carried[f"{value}.weight"] = "k_proj.weight" + repeated, "v_proj.weight" + repeated
    o = teacher_layer["o_proj.weight"]
    if fresh["o_proj.weight"].shape == o.shape:   # query readout: d_h per head, as attention's
        out["o_proj.weight"] = o
        carried["o_proj.weight"] = "o_proj.weight"
    else:   # contraction readout: [Re c.U (key, d_h), Re c.Gam (value, d_h)] per head
        d, heads = o.shape[0], teacher.n_heads
        w = fresh["o_proj.weight"].to(o.dtype).clone().view(d, heads, 2, head_dim)
        w[:, :, 1] = o.view(d, heads, head_dim)
        out["o_proj.weight"] = w.view(d, 2 * d)
        partial["o_proj.weight"] = ("the value columns (the second d_h of each head's 2 d_h) are o_proj.weight's "
                                    "columns of that head; the key columns start fresh")
    for name in BIASES:
        if name in teacher_layer:
            dropped[name] = "the interdomain projections have no bias"
    for name, tensor in out.items():
        if tuple(tensor.shape) != tuple(fresh[name].shape):   # (a bug, not a user's error)
            raise ValueError(f"layers.{index}.mixer.{name}: {tuple(tensor.shape)} from the teacher, "
                             f"{tuple(fresh[name].shape)} in the student")
    record = {"layer": index, "from": letter_from, "to": letter_to, "carried": carried, "partial": partial,
              "fresh": [n for n in fresh if n not in carried and n not in partial], "dropped": dropped}
    return out, record


@torch.no_grad()
def convert_weights(teacher_state: dict, teacher: ModelConfig, student: ModelConfig,
                    seed: int) -> tuple[dict, list[dict]]:
    """The student's TP=1 state dict (LanguageModel(student)'s names and order) from the teacher's
    (TP=1, unpadded) and, per converted layer, what it took: {"layer", "from", "to", "carried"
    {student: teacher name}, "partial" {student name: how}, "fresh" [names], "dropped" {teacher
    name: why}} (names relative to layers.<i>.mixer.). Fresh tensors are drawn as
    LanguageModel(student, seed=seed) draws them; every other tensor is the teacher's own."""
    with torch.device("meta"):   # names and shapes only
        expected = {k: tuple(v.shape) for k, v in LanguageModel(student, seed=None).state_dict().items()}
    source, target = layer_letters(teacher), layer_letters(student)
    residual_std = student.init_std / math.sqrt(2 * student.n_layers)
    state, records, converted = {}, [], {}
    for i, (letter_from, letter_to) in enumerate(zip(source, target)):
        if letter_to not in CONVERTED:
            continue
        prefix = f"layers.{i}.mixer."
        mixer = build_mixer(layer_config(student, i), residual_std, kind=layer_mixer(student, i))
        initialize(mixer, seed, prefix=prefix)   # the generators LanguageModel(student, seed) uses
        teacher_layer = {k[len(prefix):]: v for k, v in teacher_state.items() if k.startswith(prefix)}
        fresh = {k: v.detach() for k, v in mixer.state_dict().items()}
        out, record = _convert_layer(teacher_layer, fresh, mixer, teacher, letter_from, letter_to, i)
        converted.update({prefix + k: v for k, v in out.items()})
        records.append(record)
    for name, shape in expected.items():
        tensor = converted.get(name)
        if tensor is None:
            if name not in teacher_state:
                raise ValueError(f"the teacher's weights have no {name}: they are not of the model its config says")
            tensor = teacher_state[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: {tuple(tensor.shape)} in the teacher's weights, {shape} in the student")
        state[name] = tensor
    return state, records


# ------------------------------------------------------------------------- --select's score

def _attention_probabilities(mixer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax mixer's attention weights [B, H, N, N] (float32) on its input x [B, N, d], and
    how many keys each query sees [N] (its causal mask or window: a weight may underflow to 0)."""
    B, N, _ = x.shape
    shape = (B, N, -1, mixer.head_dim)
    q, k = mixer.q_proj(x).view(shape), mixer.k_proj(x).view(shape)
    if mixer.rope:
        q, k = apply_rope(q, 0, mixer.rope_spec), apply_rope(k, 0, mixer.rope_spec)
    k = repeat_kv(k, q.shape[2] // k.shape[2], 2)
    logits = torch.einsum("bnhd,bmhd->bhnm", q.float(), k.float()) / math.sqrt(mixer.head_dim)
    pos = torch.arange(N, device=x.device)
    mask = visible(pos, pos, window=mixer.window)
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1), mask.sum(-1)


@torch.no_grad()
def attention_scores(model: LanguageModel, samples: torch.Tensor) -> list[dict | None]:
    """Per layer of `model` (None for a layer that is not softmax attention), over `samples`
    [K, L] (real tokens, one sequence per row):

      entropy       the attention distribution's entropy divided by its maximum, log(keys the
                    query sees), averaged over heads and queries (those that see at least two
                    keys): 0 = every query on one key, 1 = uniform over what it sees;
      first_token   the attention mass on the sequence's first token (an attention sink),
                    averaged over heads and queries after the first: a layer whose low entropy
                    is mostly this mass parks its heads rather than retrieving.

    --select keeps the layers of lowest entropy as softmax (docs/conversion.md says why)."""
    letters = layer_letters(model.cfg)
    totals = [[0.0, 0, 0.0, 0] if c in SOFTMAX else None for c in letters]
    for row in samples:
        hidden = []
        model(row[None], hidden_states=hidden, return_hidden=True)
        for i, block in enumerate(model.layers):
            if totals[i] is None:
                continue
            p, seen = _attention_probabilities(block.mixer, block.mixer_norm(hidden[i]))   # [1, H, N, N], [N]
            several = seen >= 2
            entropy = -torch.xlogy(p, p).sum(-1)[..., several]                            # [1, H, queries]
            normalised = entropy / torch.log(seen[several].double()).float()
            totals[i][0] += normalised.double().sum().item()
            totals[i][1] += normalised.numel()
            totals[i][2] += p[:, :, 1:, 0].double().sum().item()
            totals[i][3] += p[:, :, 1:, 0].numel()
    return [None if t is None else {"entropy": t[0] / max(t[1], 1), "first_token": t[2] / max(t[3], 1)}
            for t in totals]


def select_pattern(teacher: ModelConfig, base: str, scores: list[dict | None], keep: int) -> tuple[str, list[int]]:
    """The `keep` softmax layers of lowest entropy stay softmax (their own letter, A or W), the
    others take `base`'s letter (I); ties go to the earlier layer. Returns (the pattern, with
    base's stage marks, and the kept layers in order)."""
    source = layer_letters(teacher)
    ranked = sorted((s["entropy"], i) for i, s in enumerate(scores) if s is not None)
    kept = sorted(i for _, i in ranked[:keep])
    letters, out, layer = base, [], 0
    for c in letters:
        if c == STAGE_MARK:
            out.append(c)
            continue
        out.append(source[layer] if layer in kept else c)
        layer += 1
    return "".join(out), kept
