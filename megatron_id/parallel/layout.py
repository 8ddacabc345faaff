"""The one layout validator: can `world_size` processes run this model at TP x PP x DP with ZeRO
stage z? Every problem is a LayoutError (a ConfigError: one line with the values and the fix),
raised before any process group or model exists.

    check_sizes        world size = TP x PP x DP                    (process groups, state.py)
    check_model_split  heads (and key/value heads), SwiGLU and vocabulary over TP; layers
                       over PP (stage_layers: which blocks each stage holds, hybrids
                       balanced by cost)
                                                                     (parallelize, checkpoints,
                                                                      import-hf, convert-checkpoint)
    check_zero         ZeRO stage against pipelining
    check_layout       all of them: what training/layout.py and the planner ask

The batch arithmetic (global batch = micro-batch x accumulation x DP) and the step counts are
the trainer's, in training/layout.py, on top of `check_layout`.
"""
from __future__ import annotations

import math

from ..config import ConfigError, ModelConfig, ffn_hidden_size
from ..model.accounting import layer_flops_per_token
from ..model.pattern import is_hybrid, stage_layer_counts


class LayoutError(ConfigError):
    """A parallel layout that cannot work, with the numbers and the fix."""


def check_sizes(world_size: int, tensor: int, pipe: int = 1) -> int:
    """World size = TP x PP x DP; returns DP."""
    if tensor < 1 or pipe < 1:
        raise LayoutError(f"tensor ({tensor}) and pipeline ({pipe}) parallel sizes must be >= 1.")
    if world_size % (tensor * pipe):
        raise LayoutError(
            f"world size {world_size} does not factor into TP={tensor} x PP={pipe} x DP: "
            f"{world_size} is not a multiple of {tensor * pipe}. Launch a multiple of "
            f"{tensor * pipe} processes or change parallel.tensor_model_parallel_size / "
            f"parallel.pipeline_model_parallel_size.")
    return world_size // (tensor * pipe)


def padded_vocab_size(cfg: ModelConfig, tp: int) -> int:
    """Megatron's rule: pad to a multiple of make_vocab_size_divisible_by x TP (0: no padding)."""
    if cfg.make_vocab_size_divisible_by == 0:
        return cfg.vocab_size
    multiple = cfg.make_vocab_size_divisible_by * tp
    return math.ceil(cfg.vocab_size / multiple) * multiple


def check_model_split(cfg: ModelConfig, tensor: int, pipe: int = 1) -> None:
    """Everything TP splits must split evenly (each rank keeps whole heads), and the layers must
    divide into PP stages; all problems in one message."""
    problems = []
    if cfg.n_heads % tensor:
        problems.append(f"model.n_heads={cfg.n_heads} is not divisible by tensor parallel size {tensor} "
                        f"(each rank keeps whole heads); use a TP size that divides {cfg.n_heads}")
    elif cfg.n_kv_heads is not None and cfg.n_kv_heads % tensor:
        problems.append(f"model.n_kv_heads={cfg.n_kv_heads} is not divisible by tensor parallel size {tensor} "
                        f"(each rank keeps whole key/value heads, with the query heads that read them); use a "
                        f"TP size that divides {cfg.n_kv_heads}, or more key/value heads (a multiple of {tensor} "
                        f"that divides model.n_heads={cfg.n_heads})")
    if ffn_hidden_size(cfg) % tensor:
        problems.append(f"the SwiGLU hidden size {ffn_hidden_size(cfg)} is not divisible by tensor "
                        f"parallel size {tensor}; set model.ffn_hidden to a multiple of {tensor}")
    if padded_vocab_size(cfg, tensor) % tensor:
        problems.append(f"model.vocab_size={cfg.vocab_size} is not divisible by tensor parallel size "
                        f"{tensor} and vocabulary padding is off (model.make_vocab_size_divisible_by=0); "
                        f"set model.make_vocab_size_divisible_by=128 (Megatron's default) to pad")
    problems += _stage_problems(cfg, pipe)
    if problems:
        raise LayoutError("; ".join(problems) + ".")


def _stage_problems(cfg: ModelConfig, pipe: int) -> list[str]:
    """How the layers divide into `pipe` stages (stage_layers): the pattern's | marks when it
    has them, by cost for a hybrid, equally for a uniform model (as Megatron)."""
    if pipe == 1:
        return []
    marks = stage_layer_counts(cfg)
    if marks is not None:
        if len(marks) != pipe:
            return [f"model.layer_pattern={cfg.layer_pattern} marks {len(marks)} pipeline stages with | but "
                    f"parallel.pipeline_model_parallel_size={pipe}: use {len(marks)} stages, or move the "
                    f"| marks (or remove them to balance the stages by cost)"]
        return []
    if is_hybrid(cfg):
        if cfg.n_layers < pipe:
            return [f"model.n_layers={cfg.n_layers} cannot fill parallel.pipeline_model_parallel_size={pipe} "
                    f"stages (each needs a layer); use at most {cfg.n_layers} stages"]
        return []
    if cfg.n_layers % pipe:
        return [f"model.n_layers={cfg.n_layers} cannot be divided into "
                f"parallel.pipeline_model_parallel_size={pipe} equal stages; use a number "
                f"of stages that divides {cfg.n_layers}"]
    return []


def stage_layers(cfg: ModelConfig, pipe: int) -> list[range]:
    """The blocks of each pipeline stage. The pattern's | marks when it has them; for another
    hybrid, contiguous stages whose largest cost (forward FLOPs per token of their blocks,
    model/accounting.layer_flops_per_token: a softmax layer at a long context costs more than
    an interdomain one) is the smallest possible; for a uniform model, equal counts (what
    DeepSpeed's partition by layer type gave before hybrids existed)."""
    n = cfg.n_layers
    if pipe == 1:
        return [range(n)]
    key = (repr(cfg), pipe)   # the planner asks hundreds of times per config
    if key not in _STAGES:
        _STAGES[key] = _stage_layers(cfg, pipe)
    return _STAGES[key]


_STAGES: dict = {}


def _stage_layers(cfg: ModelConfig, pipe: int) -> list[range]:
    n = cfg.n_layers
    marks = stage_layer_counts(cfg)
    if marks is not None and len(marks) == pipe:
        counts = marks
    elif is_hybrid(cfg):
        counts = balanced_counts(layer_flops_per_token(cfg), pipe)
    else:
        counts = [n // pipe] * pipe
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def balanced_counts(costs: list[float], parts: int) -> list[int]:
    """Split `costs` into `parts` contiguous non-empty runs minimising the largest run's sum
    (ties: the later stages take fewer layers, as the last stage also runs the LM head and loss);
    returns the runs' lengths. Dynamic programming over (layers, stages): n^2 x parts."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    INF = float("inf")
    # best[k][i]: the smallest largest sum splitting costs[:i] into k runs; cut[k][i]: the last run's start
    best = [[INF] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(i - 1, k - 2, -1):   # the last run is costs[j:i]; later j first
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def check_zero(zero_stage: int, pipe: int) -> None:
    if zero_stage not in (0, 1, 2, 3):
        raise LayoutError(f"train.zero_stage={zero_stage} is invalid: use 0, 1, 2 or 3.")
    if pipe > 1 and zero_stage >= 2:
        raise LayoutError(
            f"train.zero_stage={zero_stage} cannot be combined with pipeline parallelism "
            f"(parallel.pipeline_model_parallel_size={pipe}): DeepSpeed's pipeline engine supports "
            f"ZeRO stage 0 or 1 only. Set train.zero_stage=1, or "
            f"parallel.pipeline_model_parallel_size=1 to use ZeRO-{zero_stage}.")


def check_layout(cfg: ModelConfig, world_size: int, tensor: int, pipe: int, zero_stage: int,
                 sequence_parallel: bool = False) -> int:
    """Every check of a training layout; returns DP."""
    data = check_sizes(world_size, tensor, pipe)
    check_model_split(cfg, tensor, pipe)
    check_zero(zero_stage, pipe)
    if sequence_parallel and cfg.seq_length % tensor:
        raise LayoutError(f"parallel.sequence_parallel splits model.seq_length={cfg.seq_length} over "
                          f"TP={tensor} ranks: use a sequence length divisible by {tensor}.")
    return data
