"""One config schema for the whole stack (omegaconf structured configs).

Defaults live here and nowhere else. YAML files (configs/...) and `key=value` command-line
overrides are merged on top, in that order:

    cfg = load_config(["configs/model/125m.yaml"], ["model.mixer=s4d", "model.n_layers=2"])

An unknown key, a wrong type or an invalid value raises ConfigError naming the key, the value,
where it came from and how to fix it. Switches left at None are resolved per mixer by
`resolve` from each mixer's row of MIXER_SPECS (model/spec.py, which holds the `model`
section: ModelConfig and its enums, re-exported here).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .data.gpt_dataset import Verify  # numpy-only: the data checks' modes
from .errors import UserError
from .model.rope import RopeScalingError, check_scaling
from .model.spec import LETTER_MIXERS, MIXER_SPECS, CoreImpl, Mixer, ModelConfig, Readout, ffn_hidden_size  # noqa: F401


@dataclass
class ParallelConfig:
    """Megatron's names. Data parallelism is what is left: world = TP x CP x PP x DP."""
    tensor_model_parallel_size: int = 1    # ranks that split every layer's heads and SwiGLU columns
    pipeline_model_parallel_size: int = 1  # stages the layers are split into (DeepSpeed's PipelineModule)
    sequence_parallel: bool = False         # with TP: norms and residuals split over tokens (Megatron's)
    # one sequence split into this many contiguous blocks, one per rank (parallel/context_parallel.py;
    # Megatron's --context-parallel-size); model.seq_length must divide by it
    context_parallel_size: int = 1


class Precision(str, Enum):
    bf16 = "bf16"
    fp32 = "fp32"


class DataSource(str, Enum):
    """Where training samples come from."""
    gpt = "gpt"     # preprocessed indexed datasets (data.data_path), Megatron's GPT dataset
    mqar = "mqar"   # generated multi-query associative recall sequences (data/mqar.py, data.mqar)


@dataclass
class MQARDataConfig:
    """data.source=mqar (Zoology's synthetic recall task; data/mqar.py): each sequence opens with
    num_pairs key-value pairs and asks num_queries of the keys again later; the loss counts the
    answers only. Ids: 0 filler, 1..num_keys keys, then num_values values (model.vocab_size must
    hold them). Samples depend on the seed, the split and their index only."""
    num_pairs: int = 8                 # key-value pairs at the start of each sequence
    # fewer queries than pairs [our choice]: with every key asked, the last answer is the one value
    # not yet answered, a shortcut a small softmax model learns instead of recall (configs/replication/mqar.yaml)
    num_queries: int = 4
    num_keys: int = 64                 # distinct key ids
    num_values: int = 64               # distinct value ids (chance: 1 / num_values)
    # > 0: recall across training windows (data.carry_state's test): each episode spans
    # query_window + 1 windows, the pairs in the first, the queries in the last, and ends with
    # the id 1 + num_keys + num_values (model.vocab_size must hold it too)
    query_window: int = 0


@dataclass
class DataConfig:
    """Megatron's --data-path / --split. data_path: [prefix] or [w1, p1, w2, p2, ...]."""
    source: DataSource = DataSource.gpt     # where training samples come from
    mqar: MQARDataConfig = field(default_factory=MQARDataConfig)
    data_path: list[str] = field(default_factory=list)   # [prefix] or [w1, p1, w2, p2, ...] (data_tools' output)
    split: str = "969,30,1"                 # train,valid,test weights of every dataset
    index_cache_dir: Optional[str] = None   # None: <folder of the first prefix>/index-cache
    # the .bin files against the crc32 their .meta.json sidecars recorded, at start: sample (a few
    # 16 MiB chunks at random, ~32 for the whole blend: a fraction of a second), full (every byte;
    # minutes at 100B tokens) or none. Every batch's token ids are checked against the vocabulary
    # whatever this says (a damaged .bin stops the run naming the file, sequence and offset)
    verify: Verify = Verify.sample
    tokenizer: Optional[str] = None          # the data's tokenizer.json: recorded in checkpoints for export
    # train on data (or resume a checkpoint) of different tokenizers on purpose; otherwise the
    # tokenizer identities of the blend, data.tokenizer and the checkpoint must agree
    # (training/agreement.py)
    allow_tokenizer_mismatch: bool = False
    # packed documents, Megatron's switches and meanings (training/documents.py); all off, as there
    reset_attention_mask: bool = False       # no token reads another document (state, convs, attention)
    reset_position_ids: bool = False         # RoPE positions restart in every document
    eod_mask_loss: bool = False              # no loss for the token after an end-of-document token
    # None: the data's own (its .meta.json sidecar); a given id must be the sidecar's, or (data without
    # one) end the data's documents
    eod_token_id: Optional[int] = None
    # each micro-batch row reads consecutive windows of the same documents, step after step, and
    # every fixed-state layer's state (and conv tail) at the end of one window enters the next
    # (truncated backpropagation through time; training/carry.py). Implies reset_attention_mask
    # and reset_position_ids: a document's state and positions run on across windows and restart
    # at its start. Interdomain / S4D layers only; TP, DP, ZeRO and context parallelism, not
    # pipeline parallelism. A resume keeps it as the checkpoint had it (train.load_carried_state)
    carry_state: bool = False
    # held-out sets evaluated beside the split's validation at every train.eval_interval, each a
    # data path (a prefix, or weight/prefix pairs) read whole, logged as valid/<name>/loss
    # (Megatron's --valid-data-path, named): data.valid_sets.wiki=[/data/wiki_text_document]
    valid_sets: dict[str, list[str]] = field(default_factory=dict)


class Schedule(str, Enum):
    """The learning rate after warmup (training/optim.py has the formulas)."""
    cosine = "cosine"       # the paper's: cosine from lr to min_lr over the rest of the run
    wsd = "wsd"             # warmup-stable-decay: lr, then the last decay_fraction decays to min_lr
    linear = "linear"       # linear from lr to min_lr over the rest of the run
    constant = "constant"   # lr to the end


DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


@dataclass
class OptimizerConfig:
    """AdamW with the paper's recipe (section 6 of the spec; betas of Gu & Dao 2024)."""
    lr: float = 3e-3                  # peak learning rate, reached after warmup
    min_lr: float = 1e-5              # where the decay ends
    warmup_tokens: int = 375_000_000  # linear warmup from 0, in tokens
    schedule: Schedule = Schedule.cosine   # the learning rate after warmup
    # wsd: the decay takes the last decay_fraction of the run's steps (rounded, at least one; the
    # last step at min_lr), shaped linear, cosine or 1-sqrt [our choice: 0.2 and 1-sqrt, the
    # cooldown Hagele et al. 2024 found to match cosine; Megatron-LM's --lr-wsd-decay-style has no
    # default to follow]. Other schedules ignore it (a warning says so when it is set)
    decay_fraction: float = 0.2
    decay_shape: str = "1-sqrt"        # wsd: the decay's shape
    weight_decay: float = 0.1         # AdamW's decoupled decay of matrices and embeddings
    adam_beta1: float = 0.9           # AdamW's first-moment decay
    adam_beta2: float = 0.95          # AdamW's second-moment decay
    adam_eps: float = 1e-8            # AdamW's epsilon
    clip_grad: float = 1.0            # global gradient-norm clip (0: off)
    ssm_lr_max: float = 1e-3      # the SSM group runs at min(scheduled LR, this), no weight decay


class WandbMode(str, Enum):
    online = "online"
    offline = "offline"       # written under train.wandb.dir; `wandb sync` uploads it later
    disabled = "disabled"


@dataclass
class WandbConfig:
    """Weights & Biases tracking from rank 0 (training/metrics.py); off while project is None.
    The run id is kept in every checkpoint, so a resumed or requeued job continues the same run."""
    project: Optional[str] = None      # wandb's project; None: no tracking
    entity: Optional[str] = None       # team or user; None: wandb's default
    name: Optional[str] = None         # the run's display name
    group: Optional[str] = None        # groups runs (e.g. a scaling grid)
    tags: list[str] = field(default_factory=list)   # the run's tags
    mode: WandbMode = WandbMode.online  # upload now, later, or not at all
    dir: Optional[str] = None          # where wandb keeps its files; None: wandb's own default (./wandb)


@dataclass
class ProfileConfig:
    """A torch.profiler window (training/profiling.py): steps start_step .. start_step+steps-1 on
    the given ranks, a Chrome/TensorBoard trace per rank under dir; on CUDA also a memory
    snapshot (torch.cuda.memory._dump_snapshot). Off while dir is None."""
    dir: Optional[str] = None          # traces go here; None: no profiling
    start_step: int = 3                # after warm-up steps (allocations, compilation)
    steps: int = 2                     # steps traced
    ranks: list[int] = field(default_factory=lambda: [0])   # global ranks that trace
    memory_snapshot: bool = True       # CUDA only


class DistillStage(str, Enum):
    layers = "layers"   # (a) each converted layer's mixer regressed on the teacher layer's attention output
    logits = "logits"   # (b) KL to the teacher's logits plus the LM loss


class TeacherDtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


@dataclass
class DistillConfig:
    """Distillation from a teacher in the same process (training/distill.py, docs/conversion.md)."""
    # the teacher: a training checkpoint folder (a softmax model: import-hf's, or a run's train.save),
    # or a transformers Llama / Qwen2 / Mistral folder; None: plain training
    teacher: Optional[str] = None
    stage: DistillStage = DistillStage.logits   # layers (a), then logits (b): docs/conversion.md
    temperature: float = 1.0          # stage logits: both distributions at logits / temperature; KL x temperature^2
    kl_weight: float = 1.0            # stage logits: the KL term's weight
    # stage logits: the next-token loss's weight beside the KL [our choice: 0.5, between LoLCATs'
    # pure KL and the even blend of Hinton's recipe; 0 trains on the teacher alone]
    lm_weight: float = 0.5
    # the teacher's weights in bfloat16 (half its memory; its outputs then differ from fp32 at
    # bf16's rounding) or float32 [our choice: float32, the exact target]
    teacher_dtype: TeacherDtype = TeacherDtype.float32


@dataclass
class TrainConfig:
    micro_batch_size: int = 1         # sequences per rank per forward
    global_batch_size: int = 128      # sequences per step (micro x accumulation x DP)
    train_tokens: int = 2_500_000_000  # the run's length; steps = ceil(tokens / (global batch x seq))
    precision: Precision = Precision.bf16   # bf16 mixed precision (fp32 master weights) or fp32
    zero_stage: int = 1               # 0-3; 2 and 3 with pipeline parallel size 1 only (parallel/layout.py)
    activation_checkpointing: bool = False   # recompute each block in backward (less memory)
    # the LM head and the vocab-parallel loss fused and chunked over tokens, so a micro-batch's
    # [tokens, vocabulary] logits never exist (parallel/fused_cross_entropy.py; Liger-Kernel's
    # fused linear cross entropy); not with train.zero_stage=3 [our choice: off until timed on a
    # GPU. On this CPU (4K tokens, d 768, GPT-2 vocabulary) the head's peak memory falls 15x
    # (fp32) / 8x (bf16) at the same speed (fp32 14.5 vs 14.1 s, bf16 7.5 vs 8.2 s: within the
    # noise of a shared machine); off keeps ZeRO-3 and every existing run's numbers unchanged]
    fused_lm_head_loss: bool = False
    # run the model under torch.compile (inductor; module compiled in place, so checkpoint keys
    # do not change; training/compilation.py) [our choice: off: the first step waits for the
    # compilation (1-2.5 min on a 2-core CPU for the tiny and 22M models), losses match eager
    # only to float rounding, and on that CPU it gained 0-14% (benchmarks/training.py --compile)
    # but lost ~20% while other processes shared the cores]
    compile: bool = False
    log_interval: int = 10            # steps between console lines (a run's first and last step print one too)
    eval_interval: int = 1000         # steps between validations
    eval_iters: int = 10              # global batches per validation (0: none)
    # downstream evaluations of the model in training at every validation, logged as
    # eval/<task>/<metric> (training/downstream.py, docs/training-loop.md): each entry a
    # `megatron-id eval` command without --checkpoint ('recall --task passkey --samples 8',
    # 'length --text val.jsonl --max-tokens 4096', 'mqar --samples 256'), or 'lm-eval --include-path
    # DIR --tasks NAME ...' (lm-evaluation-harness, local YAML); the same numbers as that command
    # on the checkpoint saved at that step. Empty: none (GPT-NeoX's eval_tasks)
    eval_tasks: list[str] = field(default_factory=list)
    save_interval: int = 1000         # steps between checkpoints (and one at the end)
    save: Optional[str] = None        # checkpoint folder
    load: Optional[str] = None        # checkpoint folder to resume from
    load_optimizer: bool = True       # false: weights only, Adam starts afresh
    # a resume continues its checkpoint's schedule (optimizer.lr, min_lr, warmup_tokens, schedule,
    # decay_fraction, decay_shape, ssm_lr_max, train.train_tokens) and AdamW settings (weight_decay,
    # betas, eps): one that changes any of them is refused naming each; true applies this run's
    # values from the resumed step on, each change said in the log (Megatron's
    # --override-opt_param-scheduler). Not checked with train.load_optimizer=false or train.finetune
    override_scheduler: bool = False
    # false: checkpoints hold the weights, step, data position and RNG but no optimizer state
    # (Megatron's --no-save-optim, NeoX's no_save_optim): 1/3 of the disk of an fp32 ZeRO
    # checkpoint. Such a checkpoint past step 0 loads with train.load_optimizer=false (Adam
    # fresh) and is refused otherwise, as Megatron refuses it; not with ZeRO-3 (its optimizer
    # files hold the weights) nor train.reshardable_optimizer (docs/checkpoints.md)
    save_optimizer: bool = True
    # steps saved besides every train.save_interval (GPT-NeoX's extra_save_iters); 0 saves the
    # starting weights before the first step of a run that starts at step 0 (from scratch, or
    # from import-hf's weights), as a weights-only checkpoint: Adam has no state yet
    extra_save_steps: list[int] = field(default_factory=list)
    # also save the optimizer state per parameter in single-device form (<checkpoint>/optim/,
    # checkpoint/reshard.py), so that the checkpoint resumes WITH it at any other TP/PP/DP/ZeRO
    # layout; costs 3 x fp32 parameters of disk per checkpoint, written by one rank per stage
    # [our choice: off; `megatron-id convert-checkpoint` adds optim/ offline when a layout changes]
    reshardable_optimizer: bool = False
    keep_last: int = 3                # checkpoints kept in train.save (0: all)
    tensorboard_dir: Optional[str] = None   # TensorBoard event files (rank 0); None: off
    peak_tflops: float = 989.0        # per device, for MFU (H100 SXM dense bf16)
    max_nonfinite_in_a_row: int = 5   # stop after this many skipped non-finite steps in a row (0: never)
    # loss spikes (training/spikes.py; docs/training-loop.md): a step whose loss is above this
    # multiple of the median of the last train.spike_window steps' losses, or not finite, has its
    # update skipped on every rank and is logged with its batch's global sample indices.
    # [our choice: 0, off: a skip changes what the model learns from, so a run opts in; Megatron-LM's
    # spiky-loss check is off by default too. A pretraining spike is a jump of 2-10x the running
    # loss (llm-foundry's KillLossSpike flags 2x its window's median); 3-5 is a usual setting]
    spike_factor: float = 0.0
    # steps whose losses the median is over; detection starts once that many steps were accepted
    # [100, llm-foundry's KillLossSpike window: a median of 100 steps is steady, and the first 100
    # steps, where the loss falls fastest, are never judged]
    spike_window: int = 100
    # after this many spikes within train.spike_rollback_window steps: reload the latest checkpoint
    # of train.save and go on with those spikes' batches skipped (recorded in every later
    # checkpoint: a resume skips them too); 0: never roll back, only skip the updates
    # [3 in 100: PaLM restarted ~100 steps before spikes that came again; one isolated spike is
    # only skipped]
    spike_rollback_after: int = 3
    spike_rollback_window: int = 100   # steps within which train.spike_rollback_after spikes roll back
    # slow ranks (training/stragglers.py): every this many steps the ranks gather their time per step
    # split into compute, data wait and communication, and rank 0 names each rank whose compute +
    # data wait is train.straggler_factor x the other ranks' median or more (log, TensorBoard, JSONL,
    # wandb); 0: off. [our choice: 100: a window long enough that one slow step (a checkpoint, a
    # hiccup) does not name a rank, short enough to see a slow node within minutes; its cost is a
    # few clock reads per step and one all-gather of 4 numbers per window]
    straggler_interval: int = 100
    # how much slower than the other ranks' median a rank must be to be named [our choice: 1.5: far
    # above the few percent ranks of one job differ by, and a rank at 1.5x already costs the job a
    # third of its speed]
    straggler_factor: float = 1.5
    # every collective's timeout: a hung rank ends the job after this long instead of stalling
    # it. 10 as Megatron's --distributed-timeout-minutes. The data index is not under it: rank 0
    # builds it while the others wait on its files, as long as rank 0 shows signs of life
    # (data/index_cache.py; 5-8 s for the paper's 26B tokens, ~25 s for a 100B-token run:
    # benchmarks/data_scale.py)
    collective_timeout_minutes: float = 10.0
    # on CPU, refuse a run whose planned memory (megatron-id plan) x the ranks on this host is
    # above the host's available memory: the kernel's OOM killer would end it without a word
    check_host_memory: bool = True
    deepspeed: dict = field(default_factory=dict)   # raw DeepSpeed config overrides
    # one JSON line per step with every scalar TensorBoard gets (train/*, valid/*), for scripts and
    # plots without a service; rank 0. Appended to; only a resume of the run that wrote it drops
    # that run's lines after its checkpoint's step (training/metrics.py)
    metrics_file: Optional[str] = None
    wandb: WandbConfig = field(default_factory=WandbConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # where each logged step's time went (data wait, forward, backward incl. gradient reduction,
    # optimizer): a log line and train/time_* scalars on the logged steps (train.log_interval); on
    # CUDA it synchronises the device between phases on those steps only
    timing_breakdown: bool = True
    # checkpoints: copy to host memory, then write in the background (the same staging, manifest
    # and `latest` protocol; the next save, and the end of the run, wait for it)
    async_save: bool = False
    # in-job restarts (training/resilience.py): when a rank exits, is killed, raises or hangs past
    # train.collective_timeout_minutes, every rank is restarted in the same job or allocation and
    # resumes from the newest checkpoint (train.local_save's, else train.save's), up to this many
    # times; then the run ends with the failed rank's status as without restarts. Under
    # `megatron-id train --nproc`, launch/local.sh and launch/slurm/train.sbatch the ranks then run
    # under torch.distributed.elastic (torchrun's agent and c10d rendezvous) [our choice: 0, off:
    # a deterministic error would be repeated this many times before it ends the run]
    max_restarts: int = 0
    # cheap frequent saves for in-job restarts (Megatron's non-persistent local checkpoints): each
    # rank writes its own shard of the model, optimizer and RNG into this node-local folder every
    # train.local_save_interval steps, keeping its two newest; read back only by a restart of the
    # same run at the same layout and config, never by another layout (then train.save's
    # checkpoint is the fallback). Not with ZeRO-3 or data.carry_state. None: off
    local_save: Optional[str] = None
    local_save_interval: int = 0      # steps between local saves (with train.local_save; at least 1)
    # data.carry_state: each row's model.seq_length tokens run as this many windows in order, the
    # state carried between them with its gradient (the gradient reaches back that many windows;
    # between steps it always stops). Same function as one window of seq_length; a knob of the
    # state's gradient reach against the window the core sees at once
    carry_grad_windows: int = 1
    # false: a resume starts every row's carried state from zero (data.carry_state), on purpose.
    # Needed to resume when the rows cannot continue as saved: data.carry_state other than the
    # checkpoint's (the state dropped, or rows from zero, and the data order changes), another
    # TP / DP / micro-batch layout, another train.train_tokens (other streams); refused otherwise
    load_carried_state: bool = True
    # at the end of a run that reached train_iters: export the last checkpoint to this Hugging
    # Face folder (the rules of megatron-id export-hf; needs train.save and data.tokenizer)
    export_hf_at_end: Optional[str] = None
    # train.load's weights start a new run at step 0: no optimizer state, step, data position or
    # RNG are taken from it (Megatron's --finetune, NeoX's finetune). Only where train.load is
    # another run's folder: a run resuming its own history (train.load = train.save) resumes as usual
    finetune: bool = False
    distill: DistillConfig = field(default_factory=DistillConfig)   # distillation from a teacher (docs/conversion.md)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 42                    # initialisation, the data order and MQAR's generated samples


class ConfigError(UserError, ValueError):
    """A config problem, phrased for the user: which key, which value, how to fix it."""

    same_on_every_rank = True


def _suggest(key: str, node) -> str:
    leaf = key.rsplit(".", 1)[-1]
    valid = list(node.keys()) if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(leaf, valid, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{hint} Valid keys here: {', '.join(valid)}." if valid else hint


def _describe_error(err: OmegaConfBaseException, source: str, schema, other=None) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    msg = str(err).splitlines()[0]
    if "not in" in msg or ("Key '" in msg and "not" in msg):
        parent = OmegaConf.select(schema, key.rsplit(".", 1)[0]) if "." in key else schema
        return ConfigError(f"{source}: unknown config key '{key}'.{_suggest(key, parent)}")
    value = getattr(err, "value", None)
    if not key or "subclass of" in msg:   # a value where a group of keys goes: omegaconf names neither
        key, value = _container_mismatch(schema, other) or (key or "?", value)
    expects = _expects(schema, key, value)
    if expects and ("AnyNode" in msg or "subclass of" in msg or "Cannot assign" in msg
                    or "incompatible container" in msg or "Cannot convert 'ListConfig'" in msg):
        return ConfigError(f"{source}: invalid value {_plain(value)!r} for '{key}': {expects}.")
    enum_hint = ""
    target = OmegaConf.select(schema, key, default=None) if key != "?" else None
    if isinstance(target, Enum) and "expected one of" not in msg:
        enum_hint = f" Allowed values: {', '.join(m.value for m in type(target))}."
    if expects and not isinstance(target, Enum):
        return ConfigError(f"{source}: invalid value {_plain(value)!r} for '{key}' ({msg.rstrip('.')}): {expects}.")
    return ConfigError(f"{source}: invalid value {_plain(value)!r} for '{key}' ({msg}).{enum_hint}")


def _plain(value):
    """A config value as plain Python (a ListConfig as a list), for messages."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value)
    return value


def _schema_node(schema, key: str):
    """The schema's node of dotted `key` (None if there is none)."""
    parent, _, leaf = key.rpartition(".")
    try:
        holder = OmegaConf.select(schema, parent) if parent else schema
        return holder._get_node(leaf) if isinstance(holder, DictConfig) else None
    except Exception:   # omegaconf's lookups raise several types for a missing key
        return None


def _container_mismatch(schema, other, prefix: str = ""):
    """(key, value) of the first place where `other` (what a file or override gives) holds a list
    or a plain value where the schema has a group of keys, or a group where it has a list or a
    value: where omegaconf's merge stops with a message naming neither."""
    if other is None:
        return None
    items = other.items() if isinstance(other, (dict, DictConfig)) else ()
    for k, v in items:
        key = f"{prefix}{k}"
        node = _schema_node(schema, key)
        if node is None:
            continue
        if OmegaConf.is_dict(node) and not isinstance(v, (dict, DictConfig)):
            return key, v
        if OmegaConf.is_list(node) and isinstance(v, (dict, DictConfig)):
            return key, v
        if isinstance(v, (dict, DictConfig)) and OmegaConf.is_dict(node) \
                and dataclasses.is_dataclass(node._metadata.ref_type):
            found = _container_mismatch(schema, v, key + ".")
            if found:
                return found
    return None


# keys whose example is not made from the schema alone
EXAMPLES = {"data.valid_sets": "data.valid_sets.wiki=[/data/wiki_text_document] (one key per named set; "
                               "its value a data path)",
            "train.deepspeed": "train.deepspeed.steps_per_print=100 (DeepSpeed's own config keys)",
            "data.data_path": "data.data_path=[data/fineweb_text_document] or data.data_path='[0.3, data/a, "
                              "0.7, data/b]'"}


def _expects(schema, key: str, value) -> str:
    """What `key` takes, with an example: for a message about a value of the wrong kind."""
    if key.startswith("data.valid_sets.") and key.count(".") == 2:   # a named set: its own key
        return (f"{key} takes a data path, a prefix or weight/prefix pairs, e.g. "
                f"{key}=[/data/{key.rsplit('.', 1)[1]}_text_document]")
    node = _schema_node(schema, key)
    if node is None:
        return ""
    value = _plain(value)
    ref = node._metadata.ref_type
    if key == "data.valid_sets" and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        name = Path(value[0]).name.removesuffix("_text_document") or "wiki"
        return (f"data.valid_sets names its sets, a key each: data.valid_sets.{name}=[{value[0]}] "
                f"(Megatron's --valid-data-path, named; a set's value is a prefix or weight/prefix pairs)")
    if key in EXAMPLES:
        kind = "a list" if OmegaConf.is_list(node) else "named entries"
        return f"{key} takes {kind}, e.g. {EXAMPLES[key]}"
    if OmegaConf.is_list(node):
        element = node._metadata.element_type
        what = "whole numbers" if element is int else "numbers" if element is float else "text values"
        scalar = value is not None and not isinstance(value, (list, dict))
        example = f"[{value}]" if scalar else ("[1, 2]" if element in (int, float) else "[a, b]")
        return f"{key} takes a list of {what}, e.g. {key}={example}"
    if OmegaConf.is_dict(node):
        if dataclasses.is_dataclass(ref):
            fields = list(node.keys())
            first = fields[0]
            default = getattr(OmegaConf.select(schema, f"{key}.{first}"), "value",
                              OmegaConf.select(schema, f"{key}.{first}"))
            shown = value if isinstance(value, str) and value else default
            listed = ", ".join(fields[:8]) + (f", ... ({len(fields)} keys)" if len(fields) > 8 else "")
            return f"{key} is a group of keys ({listed}), not a value: set one of them, e.g. {key}.{first}={shown}"
        return f"{key} takes named entries, e.g. {key}.<name>=<value>"
    current = OmegaConf.select(schema, key, default=None)
    current = getattr(current, "value", current)
    if isinstance(ref, type) and issubclass(ref, Enum):
        return f"{key} takes one of {', '.join(m.value for m in ref)}, e.g. {key}={current or next(iter(ref)).value}"
    if ref is bool:
        return f"{key} takes true or false, e.g. {key}={str(not current).lower() if current is not None else 'true'}"
    if ref is int:
        return f"{key} takes a whole number, e.g. {key}={current if current is not None else 1}"
    if ref is float:
        return f"{key} takes a number, e.g. {key}={current if current is not None else 0.5}"
    if ref is str:
        return f"{key} takes one text value, e.g. {key}={current if current is not None else 'runs/x'}"
    return ""


def _merge(base, other, source: str):
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as err:
        raise _describe_error(err, source, base, other) from None
    except TypeError as err:   # omegaconf's "Cannot merge incompatible container types": no key named
        found = _container_mismatch(base, other)
        if found is None:
            raise ConfigError(f"{source}: {err}: a value where the schema has a group of keys, or the reverse; "
                              f"see docs/reference/config.md.") from None
        key, value = found
        raise ConfigError(f"{source}: invalid value {_plain(value)!r} for '{key}': "
                          f"{_expects(base, key, value)}.") from None


_SCHEMA = []   # OmegaConf.structured(Config), made once per process (~17 ms each time)


def _schema() -> DictConfig:
    """The schema's defaults. OmegaConf.merge copies its first argument, so merging onto this
    never changes it."""
    if not _SCHEMA:
        _SCHEMA.append(OmegaConf.structured(Config))
    return _SCHEMA[0]


def load_config(files=(), overrides=()) -> Config:
    """Schema defaults <- each YAML file in order <- `key=value` overrides; then validate."""
    cfg = _schema()
    given: set[str] = set()
    for path in files:
        path = Path(path)
        loaded = _read_config_file(path)
        cfg = _merge(cfg, loaded, str(path))
        given.update(_dotted_keys(OmegaConf.to_container(loaded)) if isinstance(loaded, DictConfig) else ())
    seen: dict[str, str] = {}
    parsed_overrides = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command-line override '{item}' is not of the form key=value "
                              f"(for example model.mixer=softmax).")
        key, value = (part.strip() for part in item.split("=", 1))
        # the same key twice with two values: the last wins, as in Megatron's argparse, because
        # scripts put their own overrides before the user's (quickstart.sh, local.sh, the SLURM
        # job); but it is said, so that a typo or a pasted line does not train unread
        if key in seen and seen[key] != value and os.environ.get("RANK", "0") == "0":
            print(f"warning: override {key} given twice, as {key}={seen[key]} and then {key}={value}: "
                  f"the last one, {value}, is used.", file=sys.stderr, flush=True)
        seen[key] = value
        parsed = _parse_override(item)
        parsed_overrides.append((item, parsed))
        given.update(_dotted_keys(OmegaConf.to_container(parsed)))
    # the overrides in one merge (one copy of the config, not one per override: 20 -> 4 ms for six);
    # one at a time only when it fails, to name the override that does
    try:
        cfg = OmegaConf.merge(cfg, *(parsed for _, parsed in parsed_overrides))
    except (OmegaConfBaseException, TypeError):
        for item, parsed in parsed_overrides:
            cfg = _merge(cfg, parsed, f"override '{item}'")
        raise
    out = resolve(OmegaConf.to_object(cfg), given=given)
    out.given_keys = frozenset(given)   # what a file or an override set (the rest: schema defaults)
    return out


SECTIONS = tuple(f.name for f in dataclasses.fields(Config))   # a config file's top-level keys


def _read_config_file(path: Path) -> DictConfig:
    """One --config file as a mapping of sections; anything else (a folder, a list, a JSON file
    of another kind: an export's config.json, a tokenizer, a metrics file) is named as what it is."""
    if path.is_dir():
        yamls = sorted(p.name for p in path.glob("*.yaml"))[:5]
        raise ConfigError(f"config file '{path}' is a folder: give a YAML file"
                          f"{' in it, e.g. ' + str(path / yamls[0]) if yamls else ''}.")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist "
                          f"(looked for {path.resolve()}); pass an existing YAML file.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{path}' is not text (not UTF-8): a config is a YAML file such as "
                          f"configs/model/tiny.yaml.") from None
    stripped = text.lstrip()
    if path.suffix in (".json", ".jsonl") or stripped[:1] == "{":
        import json
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = _NOT_JSON
        if data is not _NOT_JSON or path.suffix in (".json", ".jsonl"):
            what = _json_kind(data, path)
            if what:   # JSON holding config sections is YAML too: read below
                raise ConfigError(f"--config {path} is {what}, not a megatron_id config: a config is a YAML "
                                  f"file of the sections {', '.join(SECTIONS)} (e.g. configs/model/tiny.yaml); "
                                  f"single keys go as overrides (model.d_model=256).")
    try:
        loaded = OmegaConf.create(text) if stripped else OmegaConf.create({})
    except Exception as err:   # yaml errors come in several types
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(loaded, DictConfig):
        kind = "a list" if isinstance(loaded, ListConfig) else f"a {type(loaded).__name__}"
        raise ConfigError(f"{path}: its top level is {kind}, not a mapping of sections: a config file holds "
                          f"{', '.join(SECTIONS)} keys, e.g. 'model:' then '  d_model: 256' on the next line.")
    if not stripped or not len(loaded):
        if os.environ.get("RANK", "0") == "0":
            print(f"warning: config file {path} is empty: it sets nothing.", file=sys.stderr, flush=True)
    return loaded


_NOT_JSON = object()


def _json_kind(data, path: Path) -> str:
    """What a JSON (or JSON Lines) file given as --config is, '' when it holds config sections."""
    if data is _NOT_JSON:
        return ("a JSON Lines file (one object per line, e.g. a train.metrics_file)" if path.suffix == ".jsonl"
                else "not valid JSON")
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}"
    keys = set(data)
    if keys and keys <= set(SECTIONS):
        return ""
    if {"architectures", "model_type"} & keys:
        return "a Hugging Face model config (an export's config.json)"
    if {"added_tokens", "normalizer", "pre_tokenizer"} & keys:
        return "a tokenizer (tokenizer.json)"
    if {"train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization"} & keys:
        return "a DeepSpeed config (give its keys as train.deepspeed.<key>=<value>)"
    if "step" in keys:
        return "a metrics line (train.metrics_file)"
    shown = ", ".join(sorted(map(str, keys))[:6]) or "none"
    return f"a JSON file whose top-level keys ({shown}) are not config sections"


def defaulted_keys(cfg: Config, keys) -> list[str] | None:
    """Those of `keys` (dotted) that no config file or override set, so the schema's default
    decided them; None for a config not made by load_config (its origin is unknown)."""
    given = getattr(cfg, "given_keys", None)
    return None if given is None else [k for k in keys if k not in given]


def _dotted_keys(tree, prefix: str = "") -> set[str]:
    """{'model': {'d_model': 64}} -> {'model.d_model'} (dict values of free dict keys, such as
    train.deepspeed, count as their key)."""
    keys = set()
    for k, v in (tree.items() if isinstance(tree, dict) else ()):
        name = f"{prefix}{k}"
        keys.add(name)
        if isinstance(v, dict):
            keys |= _dotted_keys(v, name + ".")
    return keys


LIST_KEYS = ("data.data_path",)


# keys whose values are plain text, never YAML: a layer pattern may begin with | (a YAML block scalar)
TEXT_KEYS = ("model.layer_pattern",)


def _parse_override(item: str) -> DictConfig:
    """`key=value` -> the nested config it sets (the value read as YAML, as Hydra and OmegaConf do)."""
    key, value = (part.strip() for part in item.split("=", 1))
    if key in TEXT_KEYS and value and value.lower() not in ("null", "none", "~") and value[0] not in "\"'":
        parsed = OmegaConf.create()
        OmegaConf.update(parsed, key, value, force_add=True)
        return parsed
    try:
        return OmegaConf.from_dotlist([_as_list_override(item)])
    except OmegaConfBaseException as err:
        raise ConfigError(f"override '{item}' is not understood: {' '.join(str(err).split())}") from None
    except Exception as err:   # the YAML reader's own errors come in several types
        raise ConfigError(f"override '{item}': its value is not valid YAML ({' '.join(str(err).split())[:200]}); "
                          f"quote it, e.g. {key}='\"{value}\"'.") from None


def _as_list_override(item: str) -> str:
    """Megatron's habit `--data-path PREFIX` (or 'W1 P1 W2 P2'): a plain value for a list key
    becomes the list, split at whitespace (`data.data_path=data/x_text_document`)."""
    key, value = item.split("=", 1)
    is_list = key.strip() in LIST_KEYS or key.strip().startswith("data.valid_sets.")
    if is_list and value.strip() and not value.lstrip().startswith("["):
        return f"{key}=[{', '.join(value.split())}]"
    return item


def resolve(cfg: Config, given=None) -> Config:
    """Fill mixer-dependent defaults and check the values that types alone cannot. `given`:
    the keys a file or override set (load_config), to tell a chosen model.mixer from the default."""
    m = cfg.model
    _resolve_pattern(m, given)
    spec = MIXER_SPECS[m.mixer]
    for key, fixed in spec.fixed.items():
        value = getattr(m, key)
        if value is not None and value != fixed:
            raise ConfigError(
                f"model.{key}={getattr(value, 'value', value)} contradicts model.mixer={m.mixer.value}, "
                f"which fixes it to {getattr(fixed, 'value', fixed)}; use model.mixer=interdomain "
                f"to change {key}.")
    for key, default in spec.defaults.items():
        if getattr(m, key) is None:
            setattr(m, key, default)
    checks = [
        ("d_model", m.d_model > 0 and m.d_model % m.n_heads == 0,
         f"must be a positive multiple of model.n_heads={m.n_heads}"),
        ("n_heads", m.n_heads > 0, "must be positive"),
        ("n_kv_heads", m.n_kv_heads is None or (m.n_kv_heads > 0 and m.n_heads % m.n_kv_heads == 0),
         f"must divide model.n_heads={m.n_heads} (each key/value head serves n_heads / n_kv_heads query heads)"),
        ("n_layers", m.n_layers > 0, "must be positive"),
        ("vocab_size", m.vocab_size > 0, "must be positive"),
        ("state_size", m.state_size > 0, "must be positive"),
        ("conv_kernel", m.conv_kernel >= 1, "must be at least 1"),
        ("chunk_size", m.chunk_size >= 1, "must be at least 1"),
        ("seq_length", m.seq_length >= 1, "must be at least 1"),
        ("norm_eps", m.norm_eps > 0, "must be positive"),
        ("dt_min", 0 < m.dt_min <= m.dt_max, "must be positive and at most model.dt_max"),
        ("make_vocab_size_divisible_by", m.make_vocab_size_divisible_by >= 0,
         "must be >= 0 (0 turns vocabulary padding off)"),
    ]
    if (m.d_model // max(m.n_heads, 1)) % 2 and (m.rope or m.mixer == Mixer.hybrid and
                                                  set(m.layer_pattern) & set("AW")):
        checks.append(("n_heads", False, "must leave an even head width for RoPE"))
    for key, ok, why in checks:
        if not ok:
            raise ConfigError(f"model.{key}={getattr(m, key)} is invalid: it {why}.")
    try:
        check_scaling(m.rope_scaling)
    except RopeScalingError as err:
        raise ConfigError(str(err)) from None
    _check_attention_switches(m)
    _check_ranges(cfg)
    p = cfg.parallel
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key}={getattr(p, key)} is invalid: it must be at least 1.")
    return cfg


PATTERN_LETTERS = {letter: Mixer(mixer) for letter, mixer in LETTER_MIXERS.items()}
LETTERS_SAID = ", ".join(f"{letter} ({MIXER_SPECS[mixer].letters[letter].name})"
                         for letter, mixer in LETTER_MIXERS.items())


def _resolve_pattern(m: ModelConfig, given) -> None:
    """Check model.layer_pattern and model.window, and set model.mixer from the pattern: the one
    mixer it uses, or hybrid (model/pattern.py has the letters)."""
    example = f"e.g. model.layer_pattern=IIIAIIIAIIIA (letters: {LETTERS_SAID})"
    if m.layer_pattern is None:
        if m.mixer == Mixer.hybrid:
            raise ConfigError(f"model.mixer=hybrid needs model.layer_pattern, one letter per layer: {example}.")
        if m.window is not None:
            raise ConfigError(f"model.window={m.window} is the window of W (sliding-window softmax) layers, and "
                              f"this model has none: set model.layer_pattern with W layers (e.g. "
                              f"model.layer_pattern={'W' * m.n_layers}) or remove model.window.")
        return
    pattern = m.layer_pattern.strip().upper().replace(" ", "")
    where = f"model.layer_pattern={m.layer_pattern!r}"
    wrong = sorted(set(pattern) - set(PATTERN_LETTERS) - {"|"})
    if wrong:
        raise ConfigError(f"{where} has {', '.join(repr(c) for c in wrong)}: the letters are {LETTERS_SAID} "
                          f"and | (a pipeline-stage boundary).")
    if not pattern.replace("|", "") or any(not part for part in pattern.split("|")):
        raise ConfigError(f"{where}: every pipeline stage needs at least one layer (no empty pattern, no "
                          f"leading, trailing or doubled |); {example}.")
    letters = pattern.replace("|", "")
    if len(letters) != m.n_layers:
        raise ConfigError(f"{where} has {len(letters)} layers but model.n_layers={m.n_layers}: set "
                          f"model.n_layers={len(letters)} or give {m.n_layers} letters.")
    kinds = {PATTERN_LETTERS[c] for c in letters}
    mixer = kinds.pop() if len(kinds) == 1 else Mixer.hybrid
    if given is not None and "model.mixer" in given and m.mixer != mixer:
        raise ConfigError(f"model.mixer={m.mixer.value} contradicts {where}, whose layers make it "
                          f"{mixer.value}: remove model.mixer (the pattern decides the mixers) or the pattern.")
    m.layer_pattern, m.mixer = pattern, mixer
    if "W" in letters and (m.window is None or m.window < 1):
        raise ConfigError(f"{where} has W (sliding-window softmax) layers but model.window={m.window}: set "
                          f"model.window to the tokens each query sees (itself included), e.g. model.window=1024.")
    if "W" not in letters and m.window is not None:
        raise ConfigError(f"model.window={m.window} is the window of W layers, and {where} has none: remove "
                          f"model.window or use W in the pattern.")


def _check_attention_switches(m: ModelConfig) -> None:
    """model.n_kv_heads and model.qkv_bias shape softmax attention layers (A, W) only; in a
    hybrid its other layers ignore them (as W's model.window), and a model without a softmax
    layer refuses a value that would change nothing."""
    letters = m.layer_pattern.replace("|", "") if m.layer_pattern else next(iter(MIXER_SPECS[m.mixer].letters), "")
    if any(LETTER_MIXERS[c] == Mixer.softmax.value for c in letters):
        return
    given = [f"model.{key}={value}" for key, value, default in (
        ("n_kv_heads", m.n_kv_heads, (None, m.n_heads)), ("qkv_bias", str(m.qkv_bias).lower(), ("false",)))
        if value not in default]
    if given:
        raise ConfigError(f"{' and '.join(given)} shape{'s' if len(given) == 1 else ''} softmax attention layers "
                          f"(grouped-query attention, q/k/v biases), and this model (model.mixer={m.mixer.value}) "
                          f"has none: remove {' and '.join(g.split('=')[0] for g in given)}, or use "
                          f"model.mixer=softmax (or A / W layers in model.layer_pattern).")


def _check_ranges(cfg: Config) -> None:
    """Optimizer and training values that cannot be right (a negative LR trains backwards)."""
    o, t = cfg.optimizer, cfg.train
    checks = [
        ("optimizer.lr", o.lr, o.lr > 0 and math.isfinite(o.lr), "must be a positive number (e.g. 3e-4)"),
        ("optimizer.min_lr", o.min_lr, 0 <= o.min_lr <= o.lr, f"must be between 0 and optimizer.lr={o.lr}"),
        ("optimizer.warmup_tokens", o.warmup_tokens, o.warmup_tokens >= 0, "must be >= 0"),
        ("optimizer.weight_decay", o.weight_decay, 0 <= o.weight_decay < 1,
         "must be in [0, 1) (AdamW's decoupled decay; the paper uses 0.1)"),
        ("optimizer.adam_beta1", o.adam_beta1, 0 <= o.adam_beta1 < 1, "must be in [0, 1) (e.g. 0.9)"),
        ("optimizer.adam_beta2", o.adam_beta2, 0 <= o.adam_beta2 < 1, "must be in [0, 1) (e.g. 0.95)"),
        ("optimizer.adam_eps", o.adam_eps, 0 < o.adam_eps < 1, "must be a small positive number (e.g. 1e-8)"),
        ("optimizer.clip_grad", o.clip_grad, o.clip_grad >= 0, "must be >= 0 (0 turns clipping off)"),
        ("optimizer.ssm_lr_max", o.ssm_lr_max, o.ssm_lr_max > 0, "must be positive"),
        ("optimizer.decay_fraction", o.decay_fraction, 0 < o.decay_fraction <= 1,
         "must be in (0, 1]: the share of train.train_tokens the wsd decay takes (e.g. 0.2)"),
        ("optimizer.decay_shape", o.decay_shape, o.decay_shape in DECAY_SHAPES,
         f"must be one of {', '.join(DECAY_SHAPES)}"),
        ("train.micro_batch_size", t.micro_batch_size, t.micro_batch_size >= 1, "must be at least 1"),
        ("train.global_batch_size", t.global_batch_size, t.global_batch_size >= 1, "must be at least 1"),
        ("train.train_tokens", t.train_tokens, t.train_tokens >= 1, "must be positive"),
        ("train.log_interval", t.log_interval, t.log_interval >= 1, "must be at least 1"),
        ("train.eval_interval", t.eval_interval, t.eval_interval >= 1, "must be at least 1"),
        ("train.eval_iters", t.eval_iters, t.eval_iters >= 0, "must be >= 0 (0: no validation)"),
        ("train.save_interval", t.save_interval, t.save_interval >= 1, "must be at least 1"),
        ("train.keep_last", t.keep_last, t.keep_last >= 0, "must be >= 0 (0 keeps every checkpoint)"),
        ("train.extra_save_steps", list(t.extra_save_steps), all(s >= 0 for s in t.extra_save_steps),
         "must hold steps >= 0 (0: the starting weights, before the first step)"),
        ("train.peak_tflops", t.peak_tflops, t.peak_tflops > 0, "must be positive (per device, for MFU)"),
        ("train.max_nonfinite_in_a_row", t.max_nonfinite_in_a_row, t.max_nonfinite_in_a_row >= 0,
         "must be >= 0 (0: never stop)"),
        ("train.spike_factor", t.spike_factor,
         t.spike_factor == 0 or (t.spike_factor > 1 and math.isfinite(t.spike_factor)),
         "must be 0 (off) or above 1 (a loss this many times the running median is a spike; e.g. 4)"),
        ("train.spike_window", t.spike_window, t.spike_window >= 1, "must be at least 1 (steps of the running median)"),
        ("train.spike_rollback_after", t.spike_rollback_after, t.spike_rollback_after >= 0,
         "must be >= 0 (0: never roll back)"),
        ("train.spike_rollback_window", t.spike_rollback_window, t.spike_rollback_window >= 1,
         "must be at least 1 (steps)"),
        ("train.straggler_interval", t.straggler_interval, t.straggler_interval >= 0,
         "must be >= 0 (steps between the slow-rank reports; 0: off)"),
        ("train.straggler_factor", t.straggler_factor, t.straggler_factor > 1 and math.isfinite(t.straggler_factor),
         "must be a number above 1 (how many times the other ranks' median time names a rank, e.g. 1.5)"),
        ("train.profile.start_step", t.profile.start_step, t.profile.start_step >= 1,
         "must be at least 1 (the first step)"),
        ("train.profile.steps", t.profile.steps, t.profile.steps >= 1, "must be at least 1"),
        ("train.distill.temperature", t.distill.temperature,
         t.distill.temperature > 0 and math.isfinite(t.distill.temperature), "must be a positive number (e.g. 1.0)"),
        ("train.distill.kl_weight", t.distill.kl_weight,
         t.distill.kl_weight >= 0 and math.isfinite(t.distill.kl_weight), "must be >= 0"),
        ("train.distill.lm_weight", t.distill.lm_weight,
         t.distill.lm_weight >= 0 and math.isfinite(t.distill.lm_weight), "must be >= 0 (0: the teacher alone)"),
        ("train.max_restarts", t.max_restarts, t.max_restarts >= 0, "must be >= 0 (0: a failed rank ends the run)"),
        ("train.local_save_interval", t.local_save_interval,
         t.local_save_interval >= 1 if t.local_save else t.local_save_interval >= 0,
         "must be at least 1 with train.local_save set (steps between local saves)" if t.local_save else
         "must be >= 0"),
        ("train.collective_timeout_minutes", t.collective_timeout_minutes,
         0 < t.collective_timeout_minutes and math.isfinite(t.collective_timeout_minutes),
         "must be a positive number of minutes"),
    ]
    for key, value, ok, why in checks:
        if not ok:
            raise ConfigError(f"{key}={value} is invalid: it {why}.")


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# ------------------------------------------------------------ sizes on the command line

GiB = 1024 ** 3


def parse_size(text: str, option: str = "memory size", allow_zero: bool = False) -> float:
    """'80GiB', '80GB', '80G' (binary), '81920MiB', '1024B' -> bytes (here, not in training/plan.py:
    `megatron-id plan` checks its options before it imports torch). A bare number is refused:
    '80' is 80 GiB to the user who typed it and 80 bytes to a parser, so neither is guessed."""
    units = {"tib": 1024 ** 4, "tb": 1024 ** 4, "t": 1024 ** 4, "gib": GiB, "gb": GiB, "g": GiB,
             "mib": 1024 ** 2, "mb": 1024 ** 2, "m": 1024 ** 2, "b": 1}
    s = text.strip().lower()
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = None
    if value == 0 and not unit and allow_zero:   # a bare 0 is 0 in any unit
        return 0.0
    out_of_range = value is not None and (value < 0 or (value == 0 and not allow_zero))
    if value is not None and not unit and not out_of_range:   # (a bare 0 once got the advice "Write 0GiB")
        raise ConfigError(f"{option} '{text}' has no unit: {number} what? Write {number}GiB (or {number}GB, "
                          f"{number}MiB).")
    if (unit and unit not in units) or value is None or value != value or value == float("inf"):
        raise ConfigError(f"{option} '{text}' is not understood; write e.g. 80GiB or 81920MiB.")
    if out_of_range:
        raise ConfigError(f"{option} '{text}' must be {'at least 0' if allow_zero else 'more than 0'} "
                          f"(e.g. 80GiB).")
    return value * units[unit]
