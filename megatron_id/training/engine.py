"""The training loop on DeepSpeed: tensor x pipeline x data parallelism, ZeRO 0/1/2/3.

    trainer = Trainer(cfg)            # torch.distributed already initialised (torchrun, srun)
    trainer.train()                   # resumes from train.load; saves to train.save

Engines: PP = 1 uses DeepSpeed's plain engine (ZeRO 0/1/2/3) with the tensor-parallel model and
our `parallel.state` as mpu; PP > 1 uses its PipelineEngine (1F1B schedule, ZeRO 0/1) on the
PipelineModule of parallel/pipeline.py, whose grid comes from the same topology. With
train.compile=true either engine's module is compiled in place (training/compilation.py).

Order of a step: the scheduled LR (in tokens) is applied to every group (the SSM group capped),
then `gradient_accumulation` micro-batches go through forward (bf16 autocast when
train.precision=bf16; the SSM core runs in float32 regardless), the vocab-parallel loss and
backward; at the accumulation boundary gradients are averaged over data parallelism, clipped
(ZeRO-0: by GuardedAdamW, ZeRO-1/2/3: by DeepSpeed) and applied, unless any loss or gradient was
not finite: then the update is skipped on every rank, counted, and train.max_nonfinite_in_a_row
skipped steps in a row stop the run with NonFiniteTrainingError (naming the step and the last
good checkpoint). The returned loss is the mean over the global batch.

Checkpoints (the format and its protocol: megatron_id/checkpoint/): every train.save_interval
steps and at the end, `<save>/iter_XXXXXXX/` committed atomically behind `<save>/latest`, the last
train.keep_last kept; also at train.extra_save_steps (0: the starting weights, before the first
step). SIGTERM and SIGUSR1 (SLURM preemption) finish the current step, save and exit. A save at
step 0 or with train.save_optimizer=false holds no optimizer state (a weights-only checkpoint). A
checkpoint loads at this or any other TP x PP x DP x ZeRO layout (engine_io.load says how).

Before DeepSpeed starts, rank 0 checks what reads files (the data: token ids against the
vocabulary, splits; the train.save / train.load rules of checkpoint/rules.py), takes
the lock on train.save and removes staging folders of killed saves; every rank then raises the
same error, or goes on. A collective that times out (train.collective_timeout_minutes) ends
the run with the ranks that stopped responding named (distributed.Heartbeat).
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..checkpoint import engine_io
from ..checkpoint.files import (
    ClientState,
    latest_folder,
    model_config_dict,
    read_client_state,
    remove_stale_staging,
    rng_state,
    set_rng_state,
    step_of,
    tag_for,
)
from ..checkpoint.integrity import CheckpointError
from ..checkpoint.rules import SaveLock, check_resume_batch, check_save_and_load
from ..config import Config, ConfigError, DataSource, DistillStage
from ..data.gpt_dataset import (
    PretrainingSampler,
    StreamOrder,
    build_gpt_datasets,
    check_batch_token_ids,
    check_data,
    check_valid_set,
    default_cache_dir,
    parse_split,
)
from ..data.mqar import MQARDataset, MQARStreams, MQARTask, check_mqar_run
from ..errors import UserError, check_writable
from ..hf.export import export_hf, why_not_an_export
from ..parallel import state
from ..parallel.context_parallel import ContextParallel, apply_context_parallel, split_sequence
from ..parallel.pipeline import pipeline_model
from ..parallel.tensor_parallel import parallel_model
from . import spikes as spike_hooks
from .agreement import RunTokenizer, check_host_memory, check_resume_model, check_resume_tokenizer, run_tokenizer
from .carry import CarriedRows, carried_eod_id, check_carried_resume
from .compilation import check_compile_toolchain, compile_engine
from .distill import Distillation, check_teacher
from .distributed import (
    Heartbeat,
    PeerGoneError,
    agree_on_rank0,
    collective_timeout_error,
    is_collective_timeout,
    is_peer_gone,
    local_device_index,
    skip_deepspeed_shm_build,
    uses_cuda,
)
from .documents import DocumentOptions, document_index
from .downstream import DownstreamEvals
from .faults import FaultInjector
from .layout import deepspeed_config, training_layout
from .loss import LanguageModelLoss
from .metrics import Metrics, check_metrics_file, check_wandb, metrics_position
from .optim import (
    GuardedAdamW,
    apply_learning_rate,
    group_settings,
    learning_rate,
    parameter_groups,
    wsd_decay_steps,
)
from .plan import run_estimate_gib
from .profiling import ProfileWindow, StepTimer
from .resilience import LocalSaves, agreed_attempt, check_resilience, restart_line
from .spikes import SpikeMonitor
from .stragglers import Stragglers


def check_export_at_end(cfg: Config) -> None:
    """train.export_hf_at_end, before any work: what the export at the end will need (train.save,
    a tokenizer to ship) and a folder it may write (new, empty, or an earlier export)."""
    out = cfg.train.export_hf_at_end
    if not out:
        return
    if not cfg.train.save:
        raise ConfigError(f"train.export_hf_at_end={out} exports the last checkpoint, and train.save is unset: "
                          f"set train.save=<folder>.")
    if not cfg.data.tokenizer:
        raise ConfigError(f"train.export_hf_at_end={out} ships the data's tokenizer with the model, and "
                          f"data.tokenizer is unset: set data.tokenizer=<tokenizer.json of the data>.")
    folder, save = Path(out).resolve(), Path(cfg.train.save).resolve()
    if folder == save or folder.is_relative_to(save):
        raise ConfigError(f"train.export_hf_at_end={out} is inside train.save={cfg.train.save}, where the run's "
                          f"checkpoints go: choose a folder outside it, e.g. {save.parent / 'hf'}.")
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"train.export_hf_at_end={out} is a file: give the path of a new or empty folder.")
    # the export is written beside the folder and renamed into place: its parent must take new entries
    found = folder.parent
    while not found.exists() and found != found.parent:
        found = found.parent
    if not found.is_dir():
        raise ConfigError(f"train.export_hf_at_end={out}: {found} is a file, not a folder: give a folder path "
                          f"whose parents are folders.")
    if not os.access(found, os.W_OK | os.X_OK):
        raise ConfigError(f"train.export_hf_at_end={out}: {found} is not writable, so the export at the end "
                          f"would fail after the whole run: check its permissions or choose another folder.")
    reason = why_not_an_export(folder) if folder.is_dir() and any(folder.iterdir()) else None
    if reason is not None:
        raise ConfigError(f"train.export_hf_at_end={out} is not empty and is not an earlier export ({reason}): the "
                          f"export at the end replaces only an earlier export. Choose a new or empty folder.")


def index_cache_dir(cfg: Config) -> Path:
    d = cfg.data
    return Path(d.index_cache_dir) if d.index_cache_dir else default_cache_dir(d.data_path)


def check_run(cfg: Config, layout, on_gpu: bool, restarted: bool = False):
    """What train checks before any work (rank 0, before DeepSpeed starts; `megatron-id
    job-prepare` runs the same): the data, the tokenizers, the host's memory, wandb, the metrics
    file, the export at the end, the compiler, the train.save / train.load rules and the
    checkpoint resumed from. Returns (the checkpoint root to resume from or None, a note to print
    or None, the run's tokenizer (RunTokenizer), the step of that checkpoint or None).
    restarted: an in-job restart (train.max_restarts) of a run whose train.load is unset resumes
    from train.save, where its first attempt saved (checked before that attempt started)."""
    t, d, m = cfg.train, cfg.data, cfg.model
    check_paths(cfg)
    if d.source == DataSource.mqar:   # generated: no files, no tokenizer
        check_mqar_run(cfg, layout)
        tokenizer = RunTokenizer(None, None, None)
    else:
        if not d.data_path:
            raise ConfigError("data.data_path is empty: give a preprocessed dataset prefix "
                              "(data.data_path=[data/my_corpus_text_document]).")
        # ids < vocab (a scan of data without sidecar remembered in the cache), dtype, splits, checksums
        cache = index_cache_dir(cfg)
        # (and ids below data.tokenizer's size: ids it cannot make are damage or another tokenizer's,
        # unless the data is another tokenizer's on purpose)
        made_by = None if d.allow_tokenizer_mismatch else d.tokenizer
        check_data(d.data_path, d.split, m.seq_length, m.vocab_size, cache, d.verify, made_by)
        for name, path in d.valid_sets.items():   # held-out sets: present, long enough, ids in the vocabulary
            check_valid_set(name, path, m.seq_length, m.vocab_size, cache, d.verify, made_by)
        tokenizer = run_tokenizer(cfg)   # the blend, data.tokenizer and model.vocab_size agree
    if not on_gpu:   # the OOM killer ends a CPU run over the host's memory without a word
        check_host_memory(cfg, layout, run_estimate_gib(cfg, layout, on_gpu=False))
    DocumentOptions.from_config(d)   # packed-document switches need an EOD id: named here if missing
    if d.carry_state:   # so does carrying the state (documents restart it)
        carried_eod_id(cfg)
    check_wandb(cfg)
    check_resilience(cfg)
    check_metrics_file(t.metrics_file)
    check_export_at_end(cfg)
    if t.compile:   # inductor's compiler, before the first step would find it missing
        check_compile_toolchain("cuda" if on_gpu else "cpu")
    if t.distill.teacher is not None:   # its files, its vocabulary and layers against the student's
        check_teacher(cfg, layout.tensor, tokenizer)
    resume, note = check_save_and_load(t.save, t.load or (t.save if restarted else None))
    step = None
    if resume is not None:
        folder = latest_folder(resume)
        check_resume_model(folder, cfg)
        check_resume_tokenizer(folder, tokenizer, d.allow_tokenizer_mismatch)
        if finetunes(cfg, resume):   # a new run from its weights: step 0, its own batch
            note = (f"train.finetune: starting at step 0 from the weights of {folder} (its optimizer state, "
                    f"step and data position are not taken)")
        else:
            check_resume_batch(folder, layout.global_batch_size)
            check_carried_resume(folder, cfg, layout)   # the rows continue as carried, or the key says not
            changes = check_resume_optimizer(folder, cfg, layout)   # refused unless train.override_scheduler
            note = "\n".join(line for line in (note, changes, *resume_data_changes(folder, cfg)) if line) or None
            step = step_of(folder.name)
    return resume, note, tokenizer, step


def _path_keys(cfg: Config) -> dict[str, str]:
    """The keys of `cfg` that name files or folders, with their values (set ones only)."""
    t, d = cfg.train, cfg.data
    keys = {"train.save": t.save, "train.load": t.load, "train.tensorboard_dir": t.tensorboard_dir,
            "train.metrics_file": t.metrics_file, "train.export_hf_at_end": t.export_hf_at_end,
            "train.local_save": t.local_save,
            "train.profile.dir": t.profile.dir, "train.wandb.dir": t.wandb.dir, "data.tokenizer": d.tokenizer,
            "data.index_cache_dir": d.index_cache_dir, "train.distill.teacher": t.distill.teacher}
    keys.update({f"data.data_path[{i}]": x for i, x in enumerate(d.data_path)})
    keys.update({f"data.valid_sets.{name}[{i}]": x for name, path in d.valid_sets.items() for i, x in enumerate(path)})
    return {key: str(value) for key, value in keys.items() if value is not None}


def check_paths(cfg: Config) -> None:
    """Before any work: a path that starts with ~ is refused. The shell expands ~ only at the start
    of a word, so `train.save=~/runs/x` arrives as it is, and the run wrote its checkpoints into a
    folder named '~' in the current directory (which a later `rm -rf ~...` typed to clean up is one
    character from the home folder). The outputs' folders are also tried for writing here (a
    read-only train.tensorboard_dir failed after the model was built)."""
    for key, value in _path_keys(cfg).items():
        if value.startswith("~"):
            rest = value[1:].lstrip("/")
            home = f"$HOME/{rest}" if rest and not value[1:2].isalnum() else "$HOME/..."
            raise ConfigError(f"{key}={value}: ~ is not expanded here (the shell expands it only at the start of a "
                              f"word, not after key=), so this would be a folder named '{value.split('/')[0]}' in "
                              f"{Path.cwd()}: write {key.split('[')[0]}={home} (the shell expands $HOME) or the full "
                              f"path.")
    t = cfg.train
    for key, folder in (("train.tensorboard_dir", t.tensorboard_dir), ("train.profile.dir", t.profile.dir)):
        if folder:
            check_writable(folder, key)


def resume_data_changes(folder: Path, cfg: Config) -> list[str]:
    """Warning lines for a resume whose data order is not the checkpoint's (another seed, data
    path or split): it goes on at step x global batch samples into the new order, so samples
    trained on may come again and others never. Said, not refused: switching data mid-run (an
    annealing mix, a new shuffle past a loss spike) is done on purpose."""
    client = read_client_state(folder)
    record = client.data
    if not record:
        return []
    d = cfg.data

    def names(paths) -> list[str]:   # prefixes by file name (a relative path may be given from elsewhere)
        return [Path(str(x)).name for x in paths]
    now = {"seed": cfg.seed, "data.data_path": names(d.data_path), "data.split": d.split}
    saved = {"seed": record.get("seed"), "data.data_path": names(record.get("data_path", [])),
             "data.split": record.get("split")}
    changed = [key for key in now if saved[key] is not None and saved[key] != now[key]]
    if not changed:
        return []
    shown = ", ".join(f"{key}={saved[key]} -> {now[key]}" for key in changed)
    return [f"warning: {folder.name} was trained with other data settings ({shown}): the run goes on "
            f"{client.consumed_samples or 0:,} samples into the new data order, so samples already "
            f"trained on may come again and others never; resume with the checkpoint's settings to continue its order."]


def finetunes(cfg: Config, resume) -> bool:
    """train.finetune applies: train.load is another run's folder (a run resuming its own
    history, train.load = train.save, resumes as usual)."""
    t = cfg.train
    return t.finetune and resume is not None and (t.save is None or Path(resume).resolve() != Path(t.save).resolve())


# What a resume continues from its checkpoint besides the weights and the data position: the
# learning-rate schedule (a function of the tokens consumed and of these keys) and AdamW's settings
# (torch's Optimizer.load_state_dict restores its param groups from the checkpoint: a changed
# optimizer.weight_decay or adam_beta2 was silently ignored, a changed optimizer.lr silently bent the
# schedule mid-run). Every checkpoint records them (ClientState.optimizer).
RESUMED_SETTINGS = ("optimizer.lr", "optimizer.min_lr", "optimizer.warmup_tokens", "optimizer.schedule",
                    "optimizer.decay_fraction", "optimizer.decay_shape", "optimizer.ssm_lr_max", "train.train_tokens",
                    "optimizer.weight_decay", "optimizer.adam_beta1", "optimizer.adam_beta2", "optimizer.adam_eps")


def optimizer_record(cfg: Config) -> dict:
    """RESUMED_SETTINGS of `cfg` as plain values: {"optimizer.lr": 0.003, ...}."""
    record = {}
    for key in RESUMED_SETTINGS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        record[key] = value.value if isinstance(value, Enum) else value
    return record


def resume_changes(record: dict, cfg: Config) -> list[tuple[str, object, object]]:
    """(key, the checkpoint's value, this run's) of each recorded setting this run changes, where
    it matters: wsd's decay_fraction and decay_shape only if either schedule is wsd, and
    train.train_tokens only if either schedule decays (constant never reads it)."""
    now = optimizer_record(cfg)
    schedules = {record.get("optimizer.schedule"), now["optimizer.schedule"]}
    changed = []
    for key, value in now.items():
        if key not in record or record[key] == value:
            continue
        if key in ("optimizer.decay_fraction", "optimizer.decay_shape") and "wsd" not in schedules:
            continue
        if key == "train.train_tokens" and schedules == {"constant"}:
            continue
        changed.append((key, record[key], value))
    return changed


def _scheduled_rate(values: dict, tokens: int, tokens_per_step: int) -> float:
    """The learning rate after `tokens` under the settings `values` (optimizer_record's form)."""
    opt = SimpleNamespace(**{k.removeprefix("optimizer."): v for k, v in values.items() if k.startswith("optimizer.")})
    return learning_rate(tokens, opt, values["train.train_tokens"], tokens_per_step)


def check_resume_optimizer(folder: Path, cfg: Config, layout) -> str | None:
    """Before any work: a resume that changes a setting of RESUMED_SETTINGS is refused, naming
    each with the checkpoint's value and this run's (Megatron asserts that its scheduler's values
    match the checkpoint's unless --override-opt_param-scheduler); with
    train.override_scheduler=true it goes on, and the lines returned say what changes. Nothing is
    compared at step 0 (no schedule under way) or with train.load_optimizer=false (Adam restarts;
    Megatron's --no-load-optim does not check either)."""
    t = cfg.train
    client = read_client_state(folder)
    if client.step == 0 or not t.load_optimizer:
        return None
    if client.optimizer is None:
        return (f"note: {folder} records no optimizer settings (saved before checkpoints recorded them): a change "
                f"of optimizer.* or train.train_tokens since it cannot be checked; this run's values are used")
    changed = resume_changes(client.optimizer, cfg)
    if not changed:
        return None
    now, per_step, step = optimizer_record(cfg), layout.tokens_per_step, client.step + 1
    before = _scheduled_rate({**now, **client.optimizer}, client.step * per_step, per_step)
    after = _scheduled_rate(now, client.step * per_step, per_step)
    if t.override_scheduler:
        lines = [f"train.override_scheduler=true: {key}={new} from step {step} on ({folder.name} was trained with "
                 f"{key}={old})" for key, old, new in changed]
        if before != after:
            lines.append(f"train.override_scheduler=true: the learning rate of step {step} is {after:.4g} "
                         f"({before:.4g} as {folder.name} was trained)")
        return "\n".join(lines)
    was = ", ".join(f"{key}={old}" for key, old, _ in changed)
    rate = f" (the learning rate of step {step} would go from {before:.4g} to {after:.4g})" if before != after else ""
    raise ConfigError(
        f"train.load={t.load}: {folder.name} (step {client.step}) was trained with {was}, and this run sets "
        f"{', '.join(f'{key}={new}' for key, _, new in changed)}{rate}; a resume continues its checkpoint's "
        f"schedule and AdamW settings. Set {was} to resume as it was, or train.override_scheduler=true to apply "
        f"this run's values from step {step} on (Megatron's --override-opt_param-scheduler).")


def run_warnings(cfg: Config, layout, world_size: int) -> list[str]:
    """Settings that would be ignored, in whole or in part, without a word: one line each,
    printed before any work (train on rank 0, job-prepare)."""
    o, t, d = cfg.optimizer, cfg.train, cfg.data
    given = getattr(cfg, "given_keys", None) or frozenset()
    iters, out = layout.train_iters, []
    if o.schedule.value != "wsd":
        for key in ("decay_fraction", "decay_shape"):
            if f"optimizer.{key}" in given:
                out.append(f"optimizer.{key}={getattr(o, key)} applies to optimizer.schedule=wsd only; this run's "
                           f"schedule is {o.schedule.value}, which it does not change: set optimizer.schedule=wsd "
                           f"or remove optimizer.{key}.")
    elif o.decay_fraction * iters < 1:
        out.append(f"optimizer.decay_fraction={o.decay_fraction} of this run's {iters:,} steps is "
                   f"{o.decay_fraction * iters:.2g} of a step: the wsd decay takes the last "
                   f"{wsd_decay_steps(o.decay_fraction, iters)} step, from optimizer.lr to optimizer.min_lr at once.")
    if o.schedule.value == "constant" and "optimizer.min_lr" in given:
        out.append(f"optimizer.min_lr={o.min_lr} is where a decay ends, and optimizer.schedule=constant has none: "
                   f"the rate stays at optimizer.lr={o.lr}; remove optimizer.min_lr or choose a decaying schedule.")
    if o.warmup_tokens >= t.train_tokens and o.schedule.value != "constant":
        out.append(f"optimizer.warmup_tokens={o.warmup_tokens:,} is not below train.train_tokens={t.train_tokens:,}: "
                   f"the warmup never ends, so the learning rate only rises and never decays; lower "
                   f"optimizer.warmup_tokens.")
    p = t.profile
    if p.dir:
        last = p.start_step + p.steps - 1
        if p.start_step > iters:
            out.append(f"train.profile.start_step={p.start_step} is after this run's last step ({iters:,}): "
                       f"nothing will be profiled; choose a start_step from 1 to {iters:,}.")
        elif last > iters:
            out.append(f"train.profile window steps {p.start_step}-{last} ends after this run's last step "
                       f"({iters:,}): only steps {p.start_step}-{iters} will be traced.")
        missing = [r for r in p.ranks if not 0 <= r < world_size]
        if missing:
            rest = [r for r in p.ranks if 0 <= r < world_size]
            has = "rank 0 only" if world_size == 1 else f"ranks 0-{world_size - 1}"
            out.append(f"train.profile.ranks={list(p.ranks)}: this run has {has}, so "
                       f"{', '.join(map(str, missing))} will not trace"
                       f"{'' if rest else ' and nothing will be profiled'}; give ranks below {world_size}.")
    if d.source == DataSource.gpt and t.eval_iters > 0:
        try:
            no_valid = parse_split(d.split)[1] == 0
        except UserError:   # refused by the data checks, with its own message
            no_valid = False
        if no_valid:
            what = (f"only data.valid_sets ({', '.join(d.valid_sets)}) will be validated" if d.valid_sets else
                    "no validation will run")
            out.append(f"data.split={d.split} leaves no validation documents, so {what} although "
                       f"train.eval_iters={t.eval_iters}: give the split a validation share (e.g. data.split=95,5,0)"
                       f"{'' if d.valid_sets else ', add data.valid_sets,'} or set train.eval_iters=0.")
    return out


class NonFiniteTrainingError(UserError, RuntimeError):
    """Too many non-finite steps in a row; the message names the step and the last good checkpoint."""

    same_on_every_rank = True   # the skip decision is agreed by all ranks


class Trainer:
    def __init__(self, cfg: Config, skip_finished: bool = False):
        """skip_finished (megatron-id train sets it): when train.load holds the run's last step
        (a rerun of a finished run), build nothing; train() then only says so (and exports into a
        folder without an export). Otherwise such a checkpoint is built and loaded as any other
        (to evaluate it, say), and train() says the same."""
        import deepspeed
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed first (torchrun, srun or "
                               "deepspeed.init_distributed).")
        if dist.get_backend() == "gloo":
            skip_deepspeed_shm_build()   # (distributed.py says why)
        deepspeed.init_distributed(dist_backend=dist.get_backend())   # adopts the existing group
        self.cfg = cfg
        self.layout = training_layout(cfg, dist.get_world_size())   # all checks before any work
        self.faults = FaultInjector(dist.get_rank())   # drills (training/faults.py); a bad spec refused here
        # in-job restarts so far (training/resilience.py); a restart resumes from train.save
        self.attempt = agreed_attempt("cuda" if uses_cuda() else "cpu")
        self.save_lock = None
        # data, tokenizers and folders, on rank 0; every rank learns where to resume from and
        # the tokenizer identity its checkpoints record
        self.resume_from, self.tokenizer_id, self.finished_at, self.resume_step = agree_on_rank0(self._preflight)
        if self.finished_at is not None and skip_finished:   # a rerun of a finished run: nothing to build
            self.step, self.stop_signal, self.stop_requested, self.pending_save = self.finished_at, 0, False, None
            return
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        import deepspeed
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        state.initialize_model_parallel(self.layout.tensor, self.layout.pipe, self.layout.context)
        self.tp_group = state.get_tensor_model_parallel_group()
        self.context = None   # parallel.context_parallel_size > 1: this rank's share of each sample
        if self.layout.context > 1:
            self.context = ContextParallel(state.get_context_parallel_group(), state.get_context_parallel_rank(),
                                           self.layout.context)
        self.pipelined = self.layout.pipe > 1
        self.documents = DocumentOptions.from_config(cfg.data)   # packed documents (off by default)
        self.mqar = MQARTask.of_run(cfg) if cfg.data.source == DataSource.mqar else None
        self.carry = None   # data.carry_state: each row's state, carried from step to step
        if cfg.data.carry_state:
            self.carry = CarriedRows(self.layout.gradient_accumulation, self.layout.micro_batch_size,
                                     carried_eod_id(cfg), cfg.train.carry_grad_windows)
        # the one loss of every path: _loss below (plain engine) and the pipeline's last stage
        self.loss = LanguageModelLoss.from_config(cfg, self.tp_group, context=self.context, documents=self.documents,
                                                  mqar=self.mqar)
        if self.pipelined:   # DeepSpeed's PipelineEngine; its mpu is the module's own grid
            model, mpu = pipeline_model(
                cfg.model, state.get_topology(), self.tp_group, seed=cfg.seed, loss=self.loss,
                sequence_parallel=cfg.parallel.sequence_parallel,
                activation_checkpointing=cfg.train.activation_checkpointing, documents=self.documents), None
        else:
            # built on the meta device and materialised as this TP rank's shard: a rank never
            # holds the whole model (its init draws one full-size tensor at a time)
            model = parallel_model(cfg.model, self.tp_group, seed=cfg.seed,
                                   sequence_parallel=cfg.parallel.sequence_parallel)
            model.activation_checkpointing = cfg.train.activation_checkpointing
            apply_context_parallel(model, self.context)
            mpu = state
        # train.distill: the teacher, this rank's shard; in stage layers it freezes all of the
        # student but its converted mixers, before the optimizer takes the trainable parameters
        self.distill = Distillation(cfg, self.tp_group, model) if cfg.train.distill.teacher is not None else None
        o = cfg.optimizer
        # ZeRO-0: the guard computes the norm and clips (DeepSpeed's fp32 path would apply a
        # NaN step and reports no norm); ZeRO-1/2/3: DeepSpeed clips and skips, the guard checks
        # (it steps each parameter group, at ZeRO-3 each sub-group, as a separate call).
        zero0 = cfg.train.zero_stage == 0   # ZeRO-0 saves the guard's own state dict: name its parameters
        self.guard = GuardedAdamW(parameter_groups(model, o, named=zero0), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                  eps=o.adam_eps, clip_grad=o.clip_grad if cfg.train.zero_stage == 0 else None,
                                  tp_rank=dist.get_rank(self.tp_group), data_parallel=self.layout.gradient_replicas)
        optimizer = self.guard
        if self.pipelined:
            stage_loss = model.loss_fn
            model.loss_fn = lambda logits, labels: self.guard.observe_loss(stage_loss(logits, labels))
        # DeepSpeed picks the device from LOCAL_RANK unless told: with one visible GPU per task
        # (srun --gpus-per-task=1) that is device 0, whatever the local rank
        device_args = SimpleNamespace(device_rank=local_device_index()) if uses_cuda() else None
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            args=device_args, model=model, optimizer=optimizer, config=deepspeed_config(cfg, self.layout),
            mpu=mpu)
        if cfg.train.compile:   # in place: checkpoints keep their names (training/compilation.py)
            compile_engine(self.engine, cfg)
        self.device = getattr(self.engine, "device", "cpu")
        if self.distill is not None:
            self.distill.teacher.to(self.device)
        self.timer = StepTimer(self.device)
        self.wandb_run_id = None   # continued from the checkpoint resumed (training/metrics.py)
        self.train_data = self._datasets()
        self.downstream = DownstreamEvals(cfg, self.layout)   # train.eval_tasks (training/downstream.py)
        self.step, self.evaluations = 0, 0
        self.skipped_steps, self.nonfinite_in_a_row, self.last_skipped = 0, 0, False
        self.spikes = SpikeMonitor(cfg.train, self.layout.global_batch_size, len(self.train_data))   # loss spikes
        # train.local_save: this run's own local saves when newer than train.save's (a restart)
        self.local_saves = LocalSaves(self) if cfg.train.local_save else None
        local = self.local_saves.resume(self, self.resume_step) if self.local_saves is not None else None
        self.resumed_locally = local is not None
        if local is not None:
            self._adopt(local, rng=False)   # (each rank's own RNG: set by resume)
        elif self.resume_from is not None:
            self.load_checkpoint(self.resume_from)
        self._restart_sampler()
        if cfg.train.save:   # a disk too small for a checkpoint: refused now, not at the first save
            engine_io.check_room_at_start(self, cfg.train.save)
        self.stop_requested, self.saved_step, self.stop_signal = False, self.step, 0
        self.pending_save, self.last_save_blocked = None, None   # train.async_save
        self.time_next_step, self.last_timing = False, None       # train.timing_breakdown

    def _preflight(self) -> tuple[str | None, str | None]:
        """Rank 0, before DeepSpeed starts: the checks that read files (data, tokenizers,
        checkpoint folders) and the lock on train.save, then a warning line for each setting
        that would be ignored (run_warnings). Returns the checkpoint root to resume from, the
        identity of the data's tokenizer (training/agreement.py) and, when that checkpoint is at
        the run's last step or later, its step (a finished run: nothing to train)."""
        t = self.cfg.train
        resume, note, tokenizer, step = check_run(self.cfg, self.layout, on_gpu=uses_cuda(), restarted=self.attempt > 0)
        for line in run_warnings(self.cfg, self.layout, dist.get_world_size()):
            print(f"warning: {line}", file=sys.stderr, flush=True)
        if t.save:
            self.save_lock = SaveLock(t.save)   # held until close(): no second live run writes here
            for path in remove_stale_staging(t.save):
                print(f"removed {path}, left by an interrupted save", file=sys.stderr, flush=True)
        if note:
            print(note, file=sys.stderr, flush=True)
        finished = step if step is not None and step >= self.layout.train_iters else None
        return None if resume is None else str(resume), tokenizer.identity, finished, step

    def close(self) -> None:
        """Release train.save (the lock) at the end of a run, after a background save in flight
        has finished writing (its errors were reported by wait_for_saves, or are moot here)."""
        pending = getattr(self, "pending_save", None)
        if pending is not None:
            pending.thread.join()
            self.pending_save = None
        if self.save_lock is not None:
            self.save_lock.release()
            self.save_lock = None

    @property
    def consumed_tokens(self) -> int:
        return self.step * self.layout.tokens_per_step

    def _restart_sampler(self):
        """The data position is the number of samples consumed: resuming continues the order."""
        consumed = self.step * self.layout.global_batch_size
        self.sampler = iter(PretrainingSampler(len(self.train_data), consumed, self.layout.micro_batch_size,
                                               state.get_sample_parallel_rank(), self.layout.data,
                                               skipped=self.spikes.skipped))   # (spiky batches rolled back)

    def _datasets(self):
        d = self.cfg.data   # checked by _preflight
        n_train = self.layout.train_iters * self.layout.global_batch_size
        evals = self.layout.train_iters // max(self.cfg.train.eval_interval, 1) + 1
        n_valid = evals * self.cfg.train.eval_iters * self.layout.global_batch_size
        if d.source == DataSource.mqar:   # generated; its validation split is another random stream
            self.valid_sets = {}
            if self.mqar.query_window:   # each row its own stream of episodes (carried or not: the same windows)
                rows = self.layout.global_batch_size
                self.valid_data = MQARStreams(self.mqar, n_valid, self.cfg.seed, rows, "valid") if n_valid else None
                return MQARStreams(self.mqar, n_train, self.cfg.seed, rows)
            self.valid_data = MQARDataset(self.mqar, n_valid, self.cfg.seed, "valid") if n_valid else None
            return MQARDataset(self.mqar, n_train, self.cfg.seed)
        cache, patience = self._index_cache(), 60 * self.cfg.train.collective_timeout_minutes
        train, self.valid_data, _ = build_gpt_datasets(d.data_path, d.split, (n_train, n_valid, 0),
                                                       self.cfg.model.seq_length, self.cfg.seed, cache, patience)
        # each named set read whole (its own "valid" split of 100%), as many samples as the split's
        self.valid_sets = {name: build_gpt_datasets(path, "0,100,0", (0, n_valid, 0), self.cfg.model.seq_length,
                                                    self.cfg.seed, cache, patience)[1]
                           for name, path in d.valid_sets.items()}
        if d.carry_state:   # each row of the global batch reads its own stream of consecutive windows
            rows = self.layout.global_batch_size
            train = StreamOrder(train, rows)
            self.valid_data = None if self.valid_data is None else StreamOrder(self.valid_data, rows)
            self.valid_sets = {name: None if data is None else StreamOrder(data, rows)
                               for name, data in self.valid_sets.items()}
        return train

    def _index_cache(self) -> Path:
        return index_cache_dir(self.cfg)

    def _training_loss(self, batch: torch.Tensor) -> torch.Tensor:
        """The loss a training micro-batch steps on: _loss's, or with train.distill the
        distillation loss (validation keeps _loss: the student's own next-token loss)."""
        if self.carry is not None:
            return self._carried_loss(batch)
        if self.distill is None:
            return self._loss(batch)
        return self.guard.observe_loss(self._distillation_loss(batch[:, :-1], batch[:, 1:]))

    def _carried_loss(self, batch: torch.Tensor, carry: CarriedRows | None = None) -> torch.Tensor:
        """data.carry_state: the micro-batch's rows continue from the state their previous windows
        left (training/carry.py; it finds the documents itself, as reset_attention_mask and
        reset_position_ids would). carry: whose rows (a validation round's own; default training's)."""
        carry = carry or self.carry
        inputs, labels = batch[:, :-1], batch[:, 1:]
        mask = self.loss.mask(inputs)
        split = None if self.context is None else (lambda x: split_sequence(x, self.context))
        labels = carry.split_like_outputs(labels, split)
        mask = None if mask is None else carry.split_like_outputs(mask, split)
        with self._autocast(inputs.device):
            if self.loss.fused:
                hidden = carry.forward(self.engine, inputs, split, return_hidden=True)
                loss = self.loss(hidden, labels, mask, lm_head=self.engine.module.lm_head)
            else:
                loss = self.loss(carry.forward(self.engine, inputs, split), labels, mask)
        return self.guard.observe_loss(loss)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        """The forward and self.loss of one micro-batch (the plain engine; PP > 1 runs the same
        loss on its last stage), reported to the non-finite guard."""
        inputs, labels = batch[:, :-1], batch[:, 1:]
        extra, mask = self.documents.model_inputs(inputs), self.loss.mask(inputs)
        if self.context is not None:   # this rank's block of every tensor (documents found on the whole sample)
            inputs, labels = split_sequence(inputs, self.context), split_sequence(labels, self.context)
            extra = {k: split_sequence(v, self.context) for k, v in extra.items()}
            mask = None if mask is None else split_sequence(mask, self.context)
        if self.loss.fused:   # the model returns its final hidden states; the loss applies the LM head
            with self._autocast(inputs.device):   # the head's matmul under autocast, as inside the model
                hidden = self.engine(inputs, return_hidden=True, **extra)
                loss = self.loss(hidden, labels, mask, lm_head=self.engine.module.lm_head)
            return self.guard.observe_loss(loss)
        with self._autocast(batch.device):
            logits = self.engine(inputs, **extra)
        return self.guard.observe_loss(self.loss(logits, labels, mask))

    def _distillation_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """train.distill's loss of one micro-batch (training/distill.py; no pipeline, context
        parallelism or fused loss there: refused at start)."""
        extra, mask = self.documents.model_inputs(inputs), self.loss.mask(inputs)
        with self._autocast(inputs.device):
            if self.distill.stage == DistillStage.layers:
                return self.distill.layers_loss(self.engine.module, inputs, extra)
            logits = self.engine(inputs, **extra)
            return self.distill.logits_loss(logits, inputs, extra, self.loss(logits, labels, mask), mask)

    def _autocast(self, device):
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                              enabled=self.cfg.train.precision.value == "bf16")

    def _pipeline_batches(self, dataset, sampler):
        """(inputs, labels) micro-batches for the PipelineEngine, read lazily: only the first
        and last stages pull from it."""
        for indices in sampler:
            with self.timer.phase("data"):
                batch = self._batch(dataset, indices)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            if not self.documents.active:
                yield inputs, labels
                continue
            # packed documents: the stages pass (h, seq_idx, position_ids) along, the loss gets
            # (labels, mask) (parallel/pipeline.py); both always present, the stages know which count
            seq_idx, position_ids = document_index(inputs, self.documents.eod_id)
            mask = self.loss.mask(inputs)
            yield (inputs, seq_idx, position_ids), (labels, torch.ones_like(inputs, dtype=torch.float)
                                                    if mask is None else mask)

    def evaluate(self) -> float | None:
        """Mean loss over train.eval_iters global batches of the validation split (None without
        one). Each evaluation reads the next batches, so successive evaluations see new data."""
        losses = self.evaluate_all()
        return losses.get(None)

    def evaluate_all(self) -> dict:
        """One validation round: {None: the split's loss, name: each data.valid_sets loss} (a
        missing split or train.eval_iters=0 leaves its entry out). Round r reads samples
        r x eval_iters x global batch onwards of each set."""
        round_ = self.evaluations
        self.evaluations += 1
        sets = {None: self.valid_data, **self.valid_sets}
        return {name: self._evaluate_on(data, round_) for name, data in sets.items()
                if data is not None and self.cfg.train.eval_iters >= 1}

    @torch.no_grad()
    def _evaluate_on(self, dataset, round_: int) -> float:
        per_eval = self.cfg.train.eval_iters * self.layout.global_batch_size
        start = (round_ * per_eval) % max(len(dataset) - per_eval + 1, 1)
        sampler = PretrainingSampler(start + per_eval, start, self.layout.micro_batch_size,
                                     state.get_sample_parallel_rank(), self.layout.data)
        if self.pipelined:   # mean over micro-batches and data-parallel ranks, on every stage
            with self._autocast(self.device):
                loss = self.engine.eval_batch(
                    self._pipeline_batches(dataset, iter(sampler)),
                    num_micro_batches=self.cfg.train.eval_iters * self.layout.gradient_accumulation)
            return loss.item()
        self.engine.eval()
        total, count = torch.zeros(1, device=self.device), 0   # collectives run on the training device
        loss_of = self._loss
        if self.carry is not None:   # as training reads: each row's windows in order, its state carried
            # through the round's eval_iters batches (from zero at the round's start)
            rows = self.carry.fresh()
            loss_of = lambda batch: self._carried_loss(batch, rows)   # noqa: E731
        for indices in sampler:
            total += loss_of(self._batch(dataset, indices)).detach().float()
            count += 1
        dist.all_reduce(total, group=state.get_data_parallel_group())
        self.engine.train()
        return total.item() / (count * self.layout.gradient_replicas)

    def _batch(self, dataset, indices) -> torch.Tensor:
        """One micro-batch on the training device. On CUDA it is staged in pinned memory and
        copied without blocking the host (the caching host allocator keeps the pinned buffer
        until the copy is done), so reading the next batch overlaps this one's compute."""
        host = torch.stack([torch.from_numpy(dataset[i]) for i in indices])
        if self.mqar is None and (host.max() >= self.cfg.model.vocab_size or host.min() < 0):
            # a .bin damaged after the checks at start (or one they could not check): stop, naming where
            check_batch_token_ids(dataset, indices, host.numpy(), self.cfg.model.vocab_size)
        if torch.device(self.device).type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _micro_batches(self, dataset, sampler, count: int):
        """`count` micro-batches, each read and its copy issued one micro-batch ahead of use."""
        with self.timer.phase("data"):
            pending = self._batch(dataset, next(sampler))
        for i in range(count):
            current = pending
            if i + 1 < count:
                with self.timer.phase("data"):
                    pending = self._batch(dataset, next(sampler))
            yield current

    def train_step(self) -> float:
        """One optimizer step; with self.time_next_step set (train() sets it on the steps that log),
        where its time goes is measured into self.last_timing."""
        self.timer.start(self.time_next_step and self.cfg.train.timing_breakdown)
        lr = learning_rate(self.consumed_tokens, self.cfg.optimizer, self.cfg.train.train_tokens,
                           self.layout.tokens_per_step)
        apply_learning_rate(self.optimizer, lr)
        self.last_lr = lr
        updates_before = self.guard.updates
        spike_hooks.arm(self)   # the step's spike limit (training/spikes.py)
        loss = self._train_batch()
        self.last_skipped = self.guard.updates == updates_before and not self.guard.spiked   # non-finite
        self.last_timing = self.timer.result()
        return loss

    def _loss_parts(self) -> dict | None:
        """What the step's loss is made of, for the console and the scalars: with train.distill,
        stage logits' KL and next-token loss, stage layers' MSE (no perplexity); None without."""
        if self.distill is None:
            return None
        if self.distill.stage == DistillStage.layers:
            return {"objective": "mse"}
        return dict(getattr(self, "last_parts", {}), objective="kl")

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step (before clipping); inf if it was skipped."""
        if self.last_skipped:
            return math.inf
        if self.cfg.train.zero_stage == 0:
            return self.guard.last_grad_norm
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def _train_batch(self) -> float:
        if self.pipelined:   # DeepSpeed runs the 1F1B schedule over gradient_accumulation micro-batches
            with self._autocast(self.device), self.timer.phase("pipeline_schedule"):
                self.faults.slow_down(self.step + 1)
                loss = self.engine.train_batch(self._pipeline_batches(self.train_data, self.sampler))
            if "data" in self.timer.phases:   # read inside the schedule: count it once
                self.timer.phases["pipeline_schedule"] -= self.timer.phases["data"]
            self.guard.end_of_step()
            self.step += 1
            return loss.item()
        total = torch.zeros(1, device=self.device)   # NCCL reduces only device tensors
        for batch in self._micro_batches(self.train_data, self.sampler, self.layout.gradient_accumulation):
            with self.timer.phase("forward"):
                self.faults.slow_down(self.step + 1)
                loss = self._training_loss(batch)
            with self.timer.phase("backward"):   # with the gradient reduction at the boundary
                self.engine.backward(loss)
            with self.timer.phase("optimizer"):
                self.engine.step()
            total += loss.detach().float()
        self.guard.end_of_step()
        dist.all_reduce(total, group=state.get_data_parallel_group())
        count = self.layout.gradient_accumulation * self.layout.gradient_replicas
        if self.distill is not None:
            self.last_parts = self.distill.step_parts(state.get_data_parallel_group(), count)
        self.step += 1
        return total.item() / count

    # ------------------------------------------------------------ the loop

    def train(self, max_steps: int | None = None) -> list[float]:
        """Train to train_iters (or max_steps more steps); save every save_interval, and at the
        end or on SIGTERM / SIGUSR1. Returns the losses of the steps run."""
        if self.finished_at is not None:
            self._already_finished()
            return []
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        losses = []
        start_step = self.step
        metrics = Metrics(self.cfg, self.layout, is_logger=dist.get_rank() == 0, start_step=start_step,
                          wandb_run_id=self.wandb_run_id, metrics_record=getattr(self, "metrics_record", None),
                          resumed=self.resumed_locally or (self.resume_from is not None
                                                           and not finetunes(self.cfg, self.resume_from)))
        self.metrics = metrics   # its file's position goes into each checkpoint
        self.wandb_run_id = metrics.wandb_run_id or self.wandb_run_id   # kept in the checkpoints
        metrics.header(self.cfg, start_step)
        attempt = self.attempt
        if attempt:
            metrics.scalars({"train/restarts": attempt}, self.step + 1)   # (with the next step's scalars)
            if dist.get_rank() == 0:
                print(restart_line(self.cfg, attempt), file=sys.stderr, flush=True)
        profile = ProfileWindow(self.cfg, dist.get_rank(), self.device)
        heartbeat = Heartbeat()
        try:
            end = self.layout.train_iters if max_steps is None else min(self.layout.train_iters, self.step + max_steps)
            t = self.cfg.train
            if t.save and self.step == 0 and 0 in t.extra_save_steps and not (Path(t.save) / tag_for(0)).is_dir():
                self.save_checkpoint(t.save)   # the starting weights (train.extra_save_steps: [0])
            stragglers = Stragglers(self, metrics)   # slow ranks named (train.straggler_interval)
            while self.step < end and not self._stop_agreed():
                heartbeat.beat(self.step)
                self.faults.before_step(self.step + 1)
                profile.before_step(self.step + 1)
                self.time_next_step = metrics.logs(self.step + 1)
                with stragglers.step(self.step + 1):
                    losses.append(self.train_step())
                profile.after_step(self.step)
                self._count_nonfinite()
                roll_back = spike_hooks.observe(self, losses[-1], metrics)
                metrics.step(self.step, losses[-1], self.last_lr, self.grad_norm(), start_step,
                             skipped=self.skipped_steps, timing=self.last_timing, parts=self._loss_parts())
                if self.step % self.cfg.train.eval_interval == 0 or self.step == end:
                    for name, loss in self.evaluate_all().items():
                        metrics.validation(self.step, loss, name)
                    self.downstream.run(self, metrics)   # train.eval_tasks, beside the validation
                metrics.end_step(self.step)
                if roll_back:   # M spikes: the latest checkpoint, their batches skipped
                    spike_hooks.roll_back(self)
                    if self.local_saves is not None:   # states past the rollback: a restart must not meet them
                        self.local_saves.remove_all()
                    continue
                if t.save and (self.step % t.save_interval == 0 or self.step in t.extra_save_steps):
                    self.save_checkpoint(t.save)
                elif self.local_saves is not None and self.local_saves.due(self.step):
                    self.save_locally()
            if self.cfg.train.save and self.step != self.saved_step:
                self.save_checkpoint(self.cfg.train.save)
            self.wait_for_saves()   # an asynchronous save finishes before the run says it is done
            if self.local_saves is not None and self.step >= self.layout.train_iters:
                self.local_saves.remove_all()   # the final checkpoint (or the run's end) supersedes them
            if self.cfg.train.export_hf_at_end and self.step >= self.layout.train_iters:
                self._export_at_end()
        except RuntimeError as err:
            if is_peer_gone(err):   # another rank ended first: its own output says why
                raise PeerGoneError(f"rank {dist.get_rank()}: a peer rank ended during step {self.step + 1} "
                                    f"({str(err).splitlines()[0][:160]}); the first rank that failed says why, "
                                    f"above") from None
            if not is_collective_timeout(err):
                raise
            raise collective_timeout_error(err, self.step + 1, self.cfg.train.collective_timeout_minutes,
                                           heartbeat) from None
        finally:
            profile.close(self.step)
            heartbeat.close()
            metrics.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return losses

    def _already_finished(self) -> None:
        """train.load holds the run's last step (or a later one): say so; export only into a folder
        that holds no export yet (an earlier export is kept: it is of this same checkpoint or older)."""
        t, iters = self.cfg.train, self.layout.train_iters
        if dist.get_rank() == 0:
            past = "" if self.step == iters else f", past this run's last step {iters:,} (train.train_tokens)"
            print(f"already finished at step {self.step:,}{past}: train.load={t.load} holds the run's end; nothing "
                  f"to train (raise train.train_tokens to train further, with train.override_scheduler=true where the "
                  f"schedule decays: the decay moves)", file=sys.stderr, flush=True)
            out = t.export_hf_at_end
            if out and Path(out).is_dir() and any(Path(out).iterdir()):
                print(f"train.export_hf_at_end={out}: kept the export there, not exported again (to redo it: "
                      f"megatron-id export-hf --checkpoint {self.resume_from} --output {out} --overwrite)",
                      file=sys.stderr, flush=True)
            elif out:
                done = export_hf(self.resume_from, out, overwrite=True)
                print(f"exported step {self.step} of {self.resume_from} to {done} (train.export_hf_at_end)",
                      file=sys.stderr, flush=True)
        dist.barrier()

    def _export_at_end(self) -> None:
        """train.export_hf_at_end: rank 0 exports the final checkpoint (export-hf's rules; an
        earlier export in that folder is replaced, anything else was refused at start)."""
        if dist.get_rank() == 0:
            out = export_hf(self.cfg.train.save, self.cfg.train.export_hf_at_end, overwrite=True)
            print(f"exported step {self.step} to {out} (train.export_hf_at_end)", file=sys.stderr, flush=True)
        dist.barrier()

    def _count_nonfinite(self) -> None:
        """A skipped step is counted; train.max_nonfinite_in_a_row of them in a row stop the run."""
        if not self.last_skipped:
            self.nonfinite_in_a_row = 0
            return
        self.skipped_steps += 1
        self.nonfinite_in_a_row += 1
        limit = self.cfg.train.max_nonfinite_in_a_row
        if dist.get_rank() == 0:
            print(f"step {self.step}: non-finite loss or gradient norm, update skipped "
                  f"({self.nonfinite_in_a_row} in a row, {self.skipped_steps} in this run)",
                  file=sys.stderr, flush=True)
        if limit > 0 and self.nonfinite_in_a_row >= limit:
            first = self.step - self.nonfinite_in_a_row + 1
            raise NonFiniteTrainingError(
                f"stopping at step {self.step}: {self.nonfinite_in_a_row} steps in a row "
                f"({first}-{self.step}) had a non-finite loss or gradient norm and were skipped "
                f"(train.max_nonfinite_in_a_row={limit}). Last good checkpoint: "
                f"{self._last_checkpoint()}. Resume from it (train.load=...) with a lower "
                f"optimizer.lr (and train.override_scheduler=true) or a stricter optimizer.clip_grad, or inspect "
                f"the data of these steps.")

    def _last_checkpoint(self) -> str:
        for root in (self.cfg.train.save, self.cfg.train.load):
            try:
                folder = latest_folder(root) if root else None
            except CheckpointError as err:   # an empty or dangling `latest`: said, not raised
                return f"none readable ({err})"
            if folder is not None:
                return f"{folder} (step {step_of(folder.name)})"
        t = self.cfg.train
        if not t.save:
            return "none (train.save is unset: set train.save=<folder> to keep checkpoints)"
        return (f"none yet in {t.save} (the first save comes at step {t.save_interval:,}, train.save_interval; "
                f"lower it to save sooner)")

    def _request_stop(self, signum, frame):
        self.stop_requested = signum

    def _stop_agreed(self) -> bool:
        """Every rank stops at the same step if any one of them was signalled; each learns
        the signal (the largest number, if ranks got different ones) for the closing line."""
        flag = torch.tensor([float(int(self.stop_requested or 0))], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stop_signal = int(flag.item())
        return bool(self.stop_signal)

    # ------------------------------------------------------------ checkpoints

    def client_state(self) -> ClientState:
        """What a checkpoint records besides the weights and optimizer state."""
        return ClientState(
            step=self.step, model=model_config_dict(self.cfg.model), layout=engine_io.current_layout(self),
            consumed_samples=self.step * self.layout.global_batch_size,
            tokenizer=str(Path(self.cfg.data.tokenizer).resolve()) if self.cfg.data.tokenizer else None,
            tokenizer_id=self.tokenizer_id,
            evaluations=self.evaluations, skipped_steps=self.skipped_steps, rng=rng_state(),
            data=self.data_record(), wandb_run_id=self.wandb_run_id,
            metrics_file=metrics_position(getattr(getattr(self, "metrics", None), "jsonl", None)),
            optimizer=optimizer_record(self.cfg),   # what a resume continues (check_resume_optimizer)
            spikes=self.spikes.state(),   # the samples skipped after loss spikes, the running window
            # no optimizer state: train.save_optimizer=false, or step 0 (Adam has none yet)
            weights_only=not self.cfg.train.save_optimizer or self.step == 0)

    def save_locally(self) -> None:
        """train.local_save: this rank's shard, for an in-job restart (training/resilience.py)."""
        seconds = self.local_saves.save(self, self.client_state())
        self.last_local_save = seconds
        if dist.get_rank() == 0:
            print(f"local save of step {self.step} in {seconds:.2f} s (train.local_save)", file=sys.stderr, flush=True)

    def save_checkpoint(self, root) -> Path:
        client = self.client_state()
        self.wait_for_saves()   # one save at a time: the previous one is committed first
        if self.cfg.train.async_save:
            started = time.perf_counter()
            self.pending_save = engine_io.save(self, root, client, background=True)
            self.last_save_blocked = time.perf_counter() - started   # the host copy: what the loop waited
            folder = Path(root) / self.pending_save.staged.name      # committed when the write ends
            if dist.get_rank() == 0:
                print(f"checkpoint {folder.name}: copied to host memory in {self.last_save_blocked:.2f} s, "
                      f"writing in the background (train.async_save)", file=sys.stderr, flush=True)
        else:
            folder = engine_io.save(self, root, client)
        if client.weights_only and dist.get_rank() == 0:
            why = "step 0: no optimizer state yet" if self.step == 0 else "train.save_optimizer=false"
            print(f"checkpoint {folder.name}: weights only ({why}); it resumes with fresh Adam state"
                  f"{' (train.load_optimizer=false)' if self.step else ''}", file=sys.stderr, flush=True)
        self.saved_step = self.step
        return folder

    def _apply_optimizer_settings(self) -> None:
        """This run's AdamW settings into every parameter group after a resume: loading the
        optimizer state restored the checkpoint's (torch's load_state_dict takes its param groups).
        They are the same unless train.override_scheduler=true let them change
        (check_resume_optimizer); the learning rate itself is set before every step."""
        o = self.cfg.optimizer
        settings = group_settings(o)
        for group in self.optimizer.param_groups:
            weight_decay, max_lr = settings.get(group.get("name"), (group["weight_decay"], group.get("max_lr")))
            group.update(weight_decay=weight_decay, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
            if max_lr is not None:
                group["max_lr"] = max_lr

    def wait_for_saves(self) -> None:
        """Until the asynchronous save in flight (if any) is written and committed on every rank."""
        pending, self.pending_save = getattr(self, "pending_save", None), None
        if pending is None:
            return
        seconds = pending.wait()
        dist.barrier()   # rank 0's commit is done before any rank goes on
        if dist.get_rank() == 0:
            print(f"checkpoint {pending.staged.name}: written and committed in the background in {seconds:.2f} s",
                  file=sys.stderr, flush=True)

    def data_record(self) -> dict:
        """The data and validation settings a checkpoint records (for megatron-id eval)."""
        d = self.cfg.data
        return {"data_path": [str(x) for x in d.data_path], "split": d.split, "seed": self.cfg.seed,
                "seq_length": self.cfg.model.seq_length, "eval_iters": self.cfg.train.eval_iters,
                "eval_interval": self.cfg.train.eval_interval, "train_iters": self.layout.train_iters,
                "global_batch_size": self.layout.global_batch_size,
                "index_cache_dir": d.index_cache_dir,
                "valid_sets": {name: [str(x) for x in path] for name, path in d.valid_sets.items()},
                "source": d.source.value,
                "carry_state": d.carry_state, "carry_grad_windows": self.cfg.train.carry_grad_windows,
                **({"mqar": dataclasses.asdict(d.mqar)} if d.source == DataSource.mqar else {})}

    def load_checkpoint(self, root) -> None:
        """Resume from `root`/latest, at this or another layout (checkpoint/engine_io.py); with
        train.finetune from another run's folder, its weights only, and the run starts at step 0."""
        if finetunes(self.cfg, root):
            engine_io.load_weights_of(self, root)
            return
        client = engine_io.load(self, root)
        self._apply_optimizer_settings()
        if self.carry is not None:   # each row's state, or (said once) every row from zero
            engine_io.load_carried_state(self, root)
        self._adopt(client)

    def _adopt(self, client: ClientState, rng: bool = True) -> None:
        """Continue from a checkpoint's (or a local save's) client state."""
        self.step, self.evaluations, self.skipped_steps = client.step, client.evaluations, client.skipped_steps
        self.spikes.load(client.spikes)
        self.wandb_run_id = client.wandb_run_id
        self.metrics_record = client.metrics_file   # what a resume may trim of train.metrics_file
        if rng and client.rng is not None:
            set_rng_state(client.rng)
