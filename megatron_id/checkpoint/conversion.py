"""`megatron-id convert`: a softmax checkpoint -> a weights-only checkpoint of a model whose
layers --layer-pattern marks I (or S) are converted (model/convert.py maps the weights), in the
format import-hf writes (step 0, at any TP/PP), recording the student's model config, the
source's tokenizer and what was converted (ClientState.conversion). --select N picks the
pattern itself: the N softmax layers of lowest attention entropy on real tokens stay softmax.

Every check runs before a weight is read: the pattern against the source, the overrides, the
layout, the output (never a folder that is not an earlier import or conversion), the data.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import Config, ConfigError, ModelConfig, resolve
from ..data.indexed_dataset import IndexedDataset, check_token_ids
from ..data.tokenizer import check_same_tokenizer, dataset_tokenizer
from ..errors import BadOptionError, refuse_output_inside
from ..hf.export import check_output, why_not_an_import, write_folder
from ..model.convert import (
    attention_scores,
    check_pattern,
    check_source,
    convert_weights,
    select_pattern,
    student_config,
)
from ..model.language_model import LanguageModel
from ..model.pattern import STAGE_MARK, describe_pattern, layer_letters
from ..parallel.layout import LayoutError, check_model_split
from ..parallel.tensor_parallel import split_state_dict
from .files import ClientState, model_config_dict, read_client_state
from .read import checkpoint_folder, read_model_state, write_weights_only

# the model.* keys an override may set: the new layers' own (the cube switches, the core's
# sizes); every other key shapes or means something of the teacher's, which convert keeps
SWITCHES = ("query_readout", "dual_kv_input", "rope", "readout", "output_gate", "state_size", "conv_kernel",
            "chunk_size", "dt_min", "dt_max", "seq_length")


@dataclasses.dataclass
class Converted:
    output: Path
    model: ModelConfig
    layout: dict          # the layout written (layout_record's keys)
    record: dict          # what ClientState.conversion holds
    tokenizer: str | None  # the tokenizer the source records (and so the output)


def parse_switches(overrides) -> dict:
    """`model.KEY=VALUE` items -> {KEY: typed value}, only keys of SWITCHES."""
    switches = {}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for item in overrides:
        key, sep, value = (part.strip() for part in item.partition("="))
        name = key.removeprefix("model.")
        if not sep or not key.startswith("model.") or name not in fields:
            raise BadOptionError(f"override {item!r} is not model.KEY=VALUE with a key of the model section: convert "
                                 f"sets the new layers' {', '.join(f'model.{k}' for k in SWITCHES)}.")
        if name not in SWITCHES:
            raise BadOptionError(f"override {item!r}: model.{name} is the source model's (it shapes or means something "
                                 f"of the weights convert copies) and stays as the checkpoint has it; convert sets "
                                 f"only {', '.join(f'model.{k}' for k in SWITCHES)}.")
        try:
            node = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.from_dotlist([f"{name}={value}"]))
            switches[name] = getattr(OmegaConf.to_object(node), name)
        except OmegaConfBaseException as err:
            raise BadOptionError(f"override {item!r} is invalid: {' '.join(str(err).split()[:30])}") from None
    return switches


def resolved_student(teacher: ModelConfig, pattern: str, switches: dict, source: str) -> ModelConfig:
    """The student's model config, filled and checked by config.resolve as a training config's."""
    cfg = student_config(teacher, pattern, switches)
    try:
        resolve(Config(model=cfg))
    except ConfigError as err:
        raise BadOptionError(f"the converted model of {source} with --layer-pattern {pattern} would be invalid: "
                             f"{err}") from None
    return cfg


def _positive(option: str, value, meaning: str) -> None:
    if value is not None and value < 1:
        raise BadOptionError(f"{option} {value} is invalid: it must be at least 1 ({meaning}).")


def _check_layout(cfg: ModelConfig, tp: int, pp: int, source: str) -> None:
    try:
        check_model_split(cfg, tp, pp)
    except LayoutError as err:
        raise BadOptionError(f"--tensor-parallel {tp} --pipeline-parallel {pp} cannot hold the converted model of "
                             f"{source}: {err}") from None


def read_samples(prefix: str, samples: int, seq_length: int, vocab_size: int, client: ClientState,
                 source: str) -> torch.Tensor:
    """[samples, seq_length] tokens of the dataset at `prefix` (data_tools' .bin/.idx): windows
    at even strides of its token stream, so the whole dataset is sampled, not its first
    documents. Refused when the ids do not fit the model or its tokenizer is not the model's."""
    ds = IndexedDataset(prefix)
    check_token_ids(prefix, vocab_size)
    check_same_tokenizer((f"the model of {source}", client.tokenizer_id, client.tokenizer),
                         (f"the data {prefix}", *dataset_tokenizer(prefix)),
                         "Give --data-path a dataset preprocessed with the model's tokenizer.")
    total = ds.num_tokens
    if total < samples * seq_length:
        raise BadOptionError(f"--data-path {prefix} holds {total:,} tokens, fewer than --select-samples {samples} x "
                             f"--select-seq-length {seq_length} = {samples * seq_length:,}: give fewer or shorter "
                             f"samples, or more data.")
    ends = np.cumsum(ds.lengths, dtype=np.int64)
    stride, rows = total // samples, []
    for i in range(samples):
        start, need, pieces = i * stride, seq_length, []
        seq = int(np.searchsorted(ends, start, side="right"))
        offset = start - (int(ends[seq - 1]) if seq else 0)
        while need:
            take = min(need, int(ds.lengths[seq]) - offset)
            if take > 0:
                pieces.append(ds.get(seq, offset, take))
                need -= take
            seq, offset = seq + 1, 0
        rows.append(np.concatenate(pieces).astype(np.int64))
    return torch.from_numpy(np.stack(rows))


def score_table(scores: list, kept: list[int], pattern: str) -> str:
    """--select's per-layer table, as printed."""
    letters = pattern.replace(STAGE_MARK, "")
    lines = ["layer  entropy  first-token  becomes"]
    for i, s in enumerate(scores):
        if s is not None:
            lines.append(f"{i:>5}  {s['entropy']:7.4f}  {s['first_token']:11.4f}  {letters[i]}"
                         f"{'  (kept: sharpest)' if i in kept else ''}")
    return "\n".join(lines)


def convert(checkpoint, output, layer_pattern: str | None = None, tensor_parallel: int | None = None,
            pipeline_parallel: int | None = None, overrides=(), seed: int = 42, overwrite: bool = False,
            select: int | None = None, data_path: str | None = None, select_samples: int = 8,
            select_seq_length: int = 512, log=print) -> Converted:
    """Write `output`/iter_0000000 (+ `latest`): the softmax checkpoint `checkpoint` with the
    layers `layer_pattern` marks I / S converted (or, with `select`, the pattern --select picks).
    `log` receives --select's table. Everything is checked before any weight is read."""
    _positive("--tensor-parallel", tensor_parallel, "the tensor parallel size of the checkpoint to write")
    _positive("--pipeline-parallel", pipeline_parallel, "the pipeline parallel size of the checkpoint to write")
    _positive("--select-samples", select_samples, "sequences the attention scores are measured on")
    _positive("--select-seq-length", select_seq_length, "tokens per sequence")
    folder = checkpoint_folder(checkpoint)
    client = read_client_state(folder)
    teacher = client.model_config()
    source = f"--checkpoint {checkpoint}"
    letters = check_source(teacher, source)
    if select is None:
        if layer_pattern is None:
            raise BadOptionError(f"give --layer-pattern (one letter per layer: I / S convert a layer, A / W keep it; "
                                 f"e.g. {'I' * (len(letters) - 1) + letters[-1]}) or --select N (keep the N layers "
                                 f"of sharpest attention, convert the rest to I).")
        if data_path is not None:
            raise BadOptionError("--data-path is read by --select only: add --select N, or leave --data-path out.")
        pattern = check_pattern(teacher, layer_pattern, source)
    else:
        if not 0 <= select <= len(letters):
            raise BadOptionError(f"--select {select} is invalid: it keeps that many of the {len(letters)} softmax "
                                 f"layers, so it must be between 0 and {len(letters)}.")
        if data_path is None:
            raise BadOptionError("--select scores the layers on real tokens: give --data-path PREFIX (a dataset "
                                 "written by megatron-id preprocess, tokenized with the model's tokenizer).")
        pattern = check_pattern(teacher, layer_pattern or "I" * len(letters), source)
        if set(pattern) - {"I", STAGE_MARK}:
            raise BadOptionError(f"--select picks the softmax layers itself: give --layer-pattern as I only (with | "
                                 f"stage marks if you like), or leave it out; got {layer_pattern!r}.")
    switches = parse_switches(overrides)
    saved = client.layout or {"tensor": 1, "pipe": 1, "data": 1, "zero_stage": 0}   # (written before records)
    tp, pp = tensor_parallel or saved["tensor"], pipeline_parallel or saved["pipe"]
    # the layout for every pattern --select may choose: all converted, and all kept
    candidates = [pattern]
    if select:
        candidates.append(select_pattern(teacher, pattern, [{"entropy": 0.0}] * len(letters), len(letters))[0])
    for candidate in candidates:
        _check_layout(resolved_student(teacher, candidate, switches, source), tp, pp, source)
    output = Path(output).resolve()
    for inside in sorted({Path(checkpoint).resolve(), folder.resolve()}, key=lambda p: len(p.parts)):
        refuse_output_inside(output, inside, "the checkpoint being converted", "converted")
    check_output(output, overwrite, "conversion", why_not_an_import)
    samples = None
    if select is not None:
        samples = read_samples(data_path, select_samples, select_seq_length, teacher.vocab_size, client, source)

    weights = read_model_state(folder, teacher, saved)
    chosen = None
    if select is not None:
        model = LanguageModel(teacher, seed=None)
        model.load_state_dict(weights)
        model.eval()
        scores = attention_scores(model, samples)
        del model
        pattern, kept = select_pattern(teacher, pattern, scores, select)
        log(score_table(scores, kept, pattern))
        chosen = {"keep": select, "data_path": str(data_path), "samples": select_samples,
                  "seq_length": select_seq_length, "kept": kept, "pattern": pattern,
                  "score": "entropy: mean over heads and queries of the attention entropy / log(keys seen); "
                           "first_token: mean attention mass on the first token (not used to choose)",
                  "scores": [None if s is None else {"layer": i, **s} for i, s in enumerate(scores)]}
    student = resolved_student(teacher, pattern, switches, source)
    state, layers = convert_weights(weights, teacher, student, seed)
    del weights
    record = {"source": str(folder.resolve()), "source_step": client.step, "source_pattern": "".join(letters),
              "pattern": pattern, "seed": seed, "overrides": list(overrides), "layers": layers,
              "copied": "every tensor outside the converted layers' mixers: the source's, bit for bit",
              "select": chosen}
    written = {"tensor": tp, "pipe": pp, "data": 1, "zero_stage": 0}
    out_client = ClientState(step=0, layout=written, model=model_config_dict(student), weights_only=True,
                             tokenizer=client.tokenizer, tokenizer_id=client.tokenizer_id, conversion=record)
    shards = split_state_dict(state, student, tp)
    del state
    needed = sum(t.numel() * t.element_size() for shard in shards for t in shard.values()) + (1 << 20)

    def build(staging: Path) -> None:
        write_weights_only(staging, shards, student, pp, out_client)

    write_folder(output, build, needed, f"the conversion of {folder}")
    return Converted(output, student, written, record, client.tokenizer)


def summary(done: Converted) -> list[str]:
    """What the command prints per converted layer, and the biases it could not carry."""
    lines = [f"layers: {describe_pattern(done.model) if done.model.layer_pattern else layer_letters(done.model)}"]
    for layer in done.record["layers"]:
        carried = ", ".join(sorted({n.split(".")[0] for n in layer["carried"]}))
        partial = ", ".join(n.removesuffix(".weight") + " (part)" for n in layer["partial"])
        lines.append(f"  layer {layer['layer']} {layer['from']} -> {layer['to']}: from the source {carried}"
                     f"{', ' + partial if partial else ''}; fresh {len(layer['fresh'])} tensors")
    dropped = sorted({n for layer in done.record["layers"] for n in layer["dropped"] if n.endswith(".bias")})
    if dropped:
        which = [str(layer["layer"]) for layer in done.record["layers"]
                 if any(n.endswith(".bias") for n in layer["dropped"])]
        lines.append(f"note: the source's {', '.join(dropped)} of layer{'s' if len(which) > 1 else ''} "
                     f"{', '.join(which)} are dropped: the converted layers' projections have no bias")
    return lines

