"""Distillation from a teacher in the same process (train.distill; docs/conversion.md).

A converted student (megatron-id convert: softmax layers turned into interdomain or S4D ones,
the rest copied) learns from the softmax model it came from, in the two stages of LoLCATs
(arXiv 2410.10254) and Mamba-in-the-Llama (2408.15237):

  stage=layers   the teacher runs the micro-batch; each converted layer's mixer is given the
                 teacher's input to that layer's attention (the normalised hidden states) and its
                 output regressed on the teacher's attention output (MSE, mean over layers). Only
                 the converted mixers' parameters train: the rest of the student is frozen, so
                 nothing else can drift while the new mixers learn to stand in for attention.
  stage=logits   the whole student runs; the loss is
                     kl_weight x temperature^2 x KL(teacher || student at logits / temperature)
                   + lm_weight x the next-token loss
                 (Hinton's temperature-scaled KL: temperature^2 keeps the gradient's size), over
                 the tokens the next-token loss counts.

The teacher is this TP rank's shard of its own model (built as the student is, sequence
parallelism included), loaded from a training checkpoint at any saved layout or read from a
transformers folder, in eval mode and without gradients; it is rebuilt from the same files on
resume, so a resumed run sees the same targets. What it cannot run alongside is refused before
any work (check_distill_layout, check_teacher): pipeline and context parallelism (the teacher
would need the same schedule), ZeRO-3 (the student's mixers are called outside the engine's
forward in stage layers), the fused LM-head loss (the KL needs both distributions, which that
path never forms) and, in stage layers, sequence parallelism.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..checkpoint.files import ClientState, read_client_state
from ..checkpoint.read import CheckpointNotFoundError, checkpoint_folder, iter_local_state
from ..config import Config, ConfigError, DistillStage, TeacherDtype
from ..data.tokenizer import MISMATCH_KEY, check_same_tokenizer, identity_of_file
from ..hf.llama import TransformersWeights, transformers_config, transformers_model_config
from ..model.pattern import layer_mixer
from ..model.spec import ModelConfig
from ..parallel.fused_cross_entropy import masked_mean
from ..parallel.layers import vocab_parallel_kl
from ..parallel.layout import padded_vocab_size
from ..parallel.tensor_parallel import parallel_model


def check_distill_layout(cfg: Config, layout) -> None:
    """The settings distillation cannot run with, from the config alone (training_layout)."""
    d, t = cfg.train.distill, cfg.train
    if d.teacher is None:
        return
    where = f"train.distill.teacher={d.teacher} (stage {d.stage.value})"
    why = {
        layout.pipe > 1: (f"parallel.pipeline_model_parallel_size={layout.pipe}", "the teacher would need the "
                          "same pipeline schedule beside the student's; distil at TP and data parallelism (with "
                          "ZeRO-1/2), then convert-checkpoint to the pipeline layout"),
        layout.context > 1: (f"parallel.context_parallel_size={layout.context}", "the teacher would need the "
                             "same sequence split; distil without context parallelism"),
        t.zero_stage == 3: ("train.zero_stage=3", "ZeRO-3 gathers a parameter only inside the engine's forward, "
                            "and stage layers calls the student's mixers directly; use train.zero_stage=1 or 2"),
        t.fused_lm_head_loss: ("train.fused_lm_head_loss=true", "the KL needs the teacher's and the student's "
                               "whole distributions per token, which the fused loss never forms; set "
                               "train.fused_lm_head_loss=false"),
        d.stage == DistillStage.layers and cfg.parallel.sequence_parallel: (
            "parallel.sequence_parallel=true", "stage layers regresses each rank's whole mixer output; set "
            "parallel.sequence_parallel=false for this stage (stage logits allows it)"),
        d.stage == DistillStage.logits and d.kl_weight == 0 and d.lm_weight == 0: (
            "train.distill.kl_weight=0 and train.distill.lm_weight=0", "the loss would be zero; give either a weight"),
    }
    for refused, (setting, reason) in why.items():
        if refused:
            raise ConfigError(f"{where} cannot run with {setting}: {reason}.")


@dataclass
class TeacherSource:
    """Where the teacher's weights come from: a training checkpoint folder or a transformers folder."""
    path: Path
    cfg: ModelConfig
    folder: Path | None = None   # the checkpoint's iter_ folder (None: a transformers folder)
    client: ClientState | None = None   # its client state, read once (layout, tokenizer)

    @classmethod
    def read(cls, path: str) -> "TeacherSource":
        """The teacher's model config, from its files (no weight is read)."""
        root = Path(path)
        setting = f"train.distill.teacher={path}"
        if not root.exists():
            raise ConfigError(f"{setting} does not exist: give a training checkpoint folder (e.g. import-hf's "
                              f"--output) or a transformers folder.")
        pretrained = transformers_config(root)
        if pretrained is not None:
            cfg = transformers_model_config(root, pretrained)
            # from the safetensors headers, before any work: every tensor of the folder is one the
            # teacher reads, or the folder is refused (as import-hf refuses it)
            TransformersWeights(root).sources(cfg)
            return cls(root, cfg)
        try:
            folder = checkpoint_folder(root)
        except CheckpointNotFoundError as err:
            raise ConfigError(f"{setting} is neither a training checkpoint nor a transformers folder: {err}") from None
        client = read_client_state(folder)
        return cls(root, client.model_config(), folder, client)

    def tokenizer(self) -> tuple[str | None, str | None]:
        """(the identity of the tokenizer its ids mean, its file), either None when unknown."""
        if self.folder is None:
            path = self.path / "tokenizer.json"
            return (identity_of_file(str(path)), str(path)) if path.is_file() else (None, None)
        client = self.client
        recorded = client.tokenizer_id
        if recorded is None and client.tokenizer and Path(client.tokenizer).is_file():
            recorded = identity_of_file(client.tokenizer)
        return recorded, client.tokenizer

    def local_state(self, tp: int, rank: int, names: list[str]):
        """(name, this TP rank's slice) for every name, one tensor at a time."""
        if self.folder is not None:
            yield from iter_local_state(self.folder, self.cfg, self.client.layout, tp, rank, names)
            return
        weights = TransformersWeights(self.path)
        shard = weights.local_shard(weights.sources(self.cfg), self.cfg, tp, rank)
        for name in names:
            yield name, shard.pop(name)


def converted_layers(student: ModelConfig, teacher: ModelConfig) -> list[int]:
    """The layers whose mixer the student changed from the teacher's softmax one."""
    return [i for i in range(student.n_layers)
            if layer_mixer(teacher, i) == "softmax" and layer_mixer(student, i) != "softmax"]


def check_teacher(cfg: Config, tp: int, run_tokenizer=None) -> TeacherSource:
    """The teacher's files against the student (rank 0, before any work); run_tokenizer (the
    run's RunTokenizer): the teacher's token ids must mean what the data's mean."""
    d, student = cfg.train.distill, cfg.model
    source = TeacherSource.read(d.teacher)
    if run_tokenizer is not None:
        check_same_tokenizer(
            (f"train.distill.teacher={d.teacher}", *source.tokenizer()), ("this run's data", run_tokenizer.identity,
                                                                         run_tokenizer.path),
            f"Distil on data preprocessed with the teacher's tokenizer, or set {MISMATCH_KEY} to go on "
            f"on purpose.", allow=cfg.data.allow_tokenizer_mismatch,
            warn=lambda message: print(f"warning: {message}", file=sys.stderr, flush=True))
    teacher = source.cfg
    setting = f"train.distill.teacher={d.teacher}"
    if teacher.vocab_size != student.vocab_size:
        raise ConfigError(f"{setting} has model.vocab_size={teacher.vocab_size} and the student "
                          f"{student.vocab_size}: the KL compares the same token ids; distil from the model the "
                          f"student was converted from (same tokenizer and vocabulary).")
    if padded_vocab_size(teacher, tp) != padded_vocab_size(student, tp):
        raise ConfigError(
            f"{setting} pads its vocabulary to {padded_vocab_size(teacher, tp)} rows at TP={tp} "
            f"(model.make_vocab_size_divisible_by={teacher.make_vocab_size_divisible_by}) and the student to "
            f"{padded_vocab_size(student, tp)} (model.make_vocab_size_divisible_by="
            f"{student.make_vocab_size_divisible_by}): the vocab-parallel KL pairs the same rows on each rank; set "
            f"model.make_vocab_size_divisible_by={teacher.make_vocab_size_divisible_by} for the student.")
    if d.stage == DistillStage.layers:
        shape = ("d_model", "n_layers", "n_heads")
        differ = [f"model.{k}={getattr(student, k)} (teacher {getattr(teacher, k)})" for k in shape
                  if getattr(student, k) != getattr(teacher, k)]
        if differ:
            raise ConfigError(f"{setting}: stage layers pairs each layer with the teacher's, and the student "
                              f"differs in {', '.join(differ)}: use the model convert wrote (its printed model.* "
                              f"settings), or stage logits.")
        if not converted_layers(student, teacher):
            raise ConfigError(f"{setting}: stage layers trains the layers the student converted from the "
                              f"teacher's softmax layers, and there are none (student "
                              f"model.layer_pattern={student.layer_pattern or student.mixer.value}); convert "
                              f"with I or S layers first (megatron-id convert).")
    return source


class Distillation:
    """The teacher and the distillation loss of one rank (module docstring)."""

    def __init__(self, cfg: Config, tp_group, student, device="cpu"):
        d = cfg.train.distill
        self.stage, self.temperature = d.stage, d.temperature
        self.kl_weight, self.lm_weight = d.kl_weight, d.lm_weight
        self.tp_group, self.vocab_size = tp_group, cfg.model.vocab_size
        tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.source = TeacherSource.read(d.teacher)
        teacher = parallel_model(self.source.cfg, tp_group, seed=None, sequence_parallel=cfg.parallel.sequence_parallel,
                                 device=device)
        targets = teacher.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in self.source.local_state(tp, rank, list(targets)):
                if targets[name].shape != tensor.shape:
                    raise RuntimeError(f"the teacher's {name} has shape {tuple(tensor.shape)} in "
                                       f"{self.source.path}; its model builds {tuple(targets[name].shape)}.")
                targets[name].copy_(tensor)
        teacher.requires_grad_(False).eval()
        if d.teacher_dtype == TeacherDtype.bfloat16:
            teacher.to(torch.bfloat16)
        self.teacher = teacher
        self.layers = converted_layers(cfg.model, self.source.cfg)
        if self.stage == DistillStage.layers:
            freeze_all_but_converted_mixers(student, self.layers)
        # stage logits: the step's KL and next-token loss apart (the console's loss is their weighted
        # sum; its ppl is the next-token loss's, as without distillation), summed over micro-batches
        self.sums: dict[str, torch.Tensor] = {}

    def layers_loss(self, student, inputs: torch.Tensor, extra: dict) -> torch.Tensor:
        """Stage layers: mean over the converted layers of the MSE between the student's mixer and
        the teacher's attention, both given the teacher's normalised hidden states."""
        seen = {}

        def keep(index):
            def hook(module, args, kwargs, output):
                seen[index] = (args, kwargs, output)
            return hook
        handles = [self.teacher.layers[i].mixer.register_forward_hook(keep(i), with_kwargs=True)
                   for i in self.layers]
        try:
            with torch.no_grad():
                self.teacher(inputs, **extra)
        finally:
            for handle in handles:
                handle.remove()
        losses = []
        for i in self.layers:
            args, kwargs, target = seen[i]
            mixed = student.layers[i].mixer(*(a.to(_dtype(student)) for a in args), **kwargs)
            losses.append(F.mse_loss(mixed.float(), target.float()))
        return torch.stack(losses).mean()

    def logits_loss(self, student_logits: torch.Tensor, inputs: torch.Tensor, extra: dict, lm_loss: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
        """Stage logits: the weighted KL to the teacher's logits plus the weighted next-token loss."""
        with torch.no_grad():
            teacher_logits = self.teacher(inputs, **extra)
        kl = masked_mean(vocab_parallel_kl(student_logits, teacher_logits, self.tp_group, self.vocab_size,
                                           self.temperature), mask)
        for name, value in (("kl", kl), ("lm_loss", lm_loss)):
            self.sums[name] = self.sums.get(name, 0) + value.detach().float()
        return self.kl_weight * self.temperature ** 2 * kl + self.lm_weight * lm_loss

    def step_parts(self, group, count: int) -> dict[str, float]:
        """The step's mean KL and next-token loss over its `count` micro-batches of all data-parallel
        ranks (`group`), then cleared; {} in stage layers (its loss is the MSE itself)."""
        if not self.sums:
            return {}
        names = sorted(self.sums)
        totals = torch.stack([self.sums[n].reshape(()) for n in names])
        dist.all_reduce(totals, group=group)
        self.sums = {}
        return {name: value / count for name, value in zip(names, totals.tolist())}


def _dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def freeze_all_but_converted_mixers(model, layers: list[int]) -> None:
    """Stage layers trains the converted mixers only (before the optimizer is built: it takes the
    parameters that still require gradients)."""
    keep = tuple(f"layers.{i}.mixer." for i in layers)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(keep))
