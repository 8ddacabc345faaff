"""Optimizer state that loads at any layout: `<checkpoint>/optim/`, one safetensors file per
parameter of the single-device (TP=1, unpadded) model, holding its fp32 master weight and Adam's
exp_avg and exp_avg_sq, plus `optim/meta.json` (Adam's step). Written beside DeepSpeed's own
files when `train.reshardable_optimizer=true`; a later run at another (TP, PP, DP, ZeRO) layout
then resumes WITH its optimizer state instead of refusing (or starting Adam afresh with
train.load_optimizer=false).

Saving: every rank of a stage asks DeepSpeed for the whole (over DP) TP-local tensors of each of
its parameters (`safe_get_full_*`: an all-reduce over DP under ZeRO; our GuardedAdamW's state
directly under ZeRO-0), the TP ranks all-gather them, and the (DP 0, TP 0) rank of the stage
merges them with the partition table that merges weights (tensor_parallel.merge_state_dicts) and
writes the file. No rank holds more than one merged parameter.
Loading: each rank reads only its stage's parameters and, with safetensors' lazy slices, only
its TP rows or columns (the vocabulary zero-padded for its TP), and sets them (`safe_set_full_*`
under ZeRO 1/2, GuardedAdamW's state under ZeRO-0). Adam's step comes from meta.json.

Two DeepSpeed details this relies on (DeepSpeed 0.19; the tests in tests/test_reshardable.py
fail if they change): the ZeRO optimizer links its per-parameter state fragments after the
first parameter group's step only, so our other groups (no decay, SSM) are re-linked here
before reading; and a freshly built engine has no Adam state until its first step, so zero
state holding the saved step is created and linked before setting.
Tied embeddings across pipeline stages are not handled yet (refused with the reason).
Design measured in a spike (issue 12): this format vs DeepSpeed's universal checkpoint, which
needs our partition table injected, folder renames between PP=1 and PP>1, and fails at ZeRO-0.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..parallel import state
from ..parallel.pipeline import to_model_names
from ..parallel.tensor_parallel import VOCAB_PARAMETERS, merge_state_dicts, padded_vocab_size, partition_dim
from .checkpoint import CheckpointError

FOLDER = "optim"
META = "meta.json"
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def has_reshardable_state(checkpoint: Path) -> bool:
    return (Path(checkpoint) / FOLDER / META).is_file()


def _model_name(engine_name: str, pipelined: bool, n_layers: int) -> str:
    """A parameter name of the engine's module (PipelineModule: `<piece>.<rest>`) as the
    single-device model names it."""
    if not pipelined:
        return engine_name
    piece, rest = engine_name.split(".", 1)
    (name,) = to_model_names(int(piece), {rest: None}, n_layers)
    return name


def _local_parameters(trainer) -> list[tuple[str, torch.nn.Parameter]]:
    """(single-device model name, parameter) of this rank, in module order: the same order on
    every DP and TP rank of a stage, which the collectives below need."""
    if trainer.pipelined and trainer.cfg.model.tie_embeddings:
        raise CheckpointError("re-sharding the optimizer state of tied embeddings across pipeline "
                              "stages is not supported yet: load with train.load_optimizer=false, or at "
                              "the saving layout.")
    return [(_model_name(name, trainer.pipelined, trainer.cfg.model.n_layers), p)
            for name, p in trainer.engine.module.named_parameters()]


def _zero_optimizer(trainer):
    return trainer.engine.optimizer if trainer.cfg.train.zero_stage > 0 else None


def _relink(zero) -> None:
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()


def _adam_steps(trainer) -> set[float]:
    zero = _zero_optimizer(trainer)
    if zero is not None:
        return {float(zero.optimizer.state[flat]["step"]) for flat in zero.single_partition_of_fp32_groups
                if flat in zero.optimizer.state}
    return {float(s["step"]) for s in trainer.guard.state.values()}


def save(trainer, folder: Path) -> None:
    """Write `folder`/optim/ (a collective: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file
    out = Path(folder) / FOLDER
    tp_group = trainer.tp_group
    tp, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    writer = tp_rank == 0 and state.get_data_parallel_rank() == 0
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    zero = _zero_optimizer(trainer)
    if zero is not None:
        _relink(zero)
    for name, p in _local_parameters(trainer):
        if zero is not None:
            local = {"fp32": safe_get_full_fp32_param(p),
                     **{k: safe_get_full_optimizer_state(p, k) for k in ADAM_KEYS}}
        else:
            adam = trainer.guard.state[p]
            local = {"fp32": p.detach().float(), **{k: adam[k] for k in ADAM_KEYS}}
        merged = {}
        for key, tensor in local.items():
            tensor = tensor.detach().float().contiguous()
            shards = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(shards, tensor, group=tp_group)
            if writer:
                merged[key] = merge_state_dicts([{name: s.cpu()} for s in shards], trainer.cfg.model)[name]
        if writer:
            save_file(merged, str(out / f"{name}.safetensors"))
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, sorted(_adam_steps(trainer)))
    distinct = {s for part in steps for s in part}
    if len(distinct) != 1:
        raise RuntimeError(f"Adam's step differs between parameter groups or ranks: {sorted(distinct)}")
    if dist.get_rank() == 0:
        (out / META).write_text(json.dumps({"format": "megatron_id.reshardable_optimizer/1",
                                            "adam_step": distinct.pop(), "trainer_step": trainer.step}))
    dist.barrier()


def _read_tp_slice(handle, key: str, name: str, cfg, tp: int, rank: int) -> torch.Tensor:
    """This rank's rows / columns of a stored TP=1 tensor, the vocabulary padded for this TP."""
    lazy = handle.get_slice(key)
    shape = lazy.get_shape()
    dim = partition_dim(name)
    vocab = name in VOCAB_PARAMETERS
    if dim is None:
        return lazy[:]
    rows = padded_vocab_size(cfg, tp) if vocab else shape[dim]
    per = rows // tp
    start, stop = rank * per, min((rank + 1) * per, shape[dim])
    if stop > start:
        tensor = lazy[tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))]
    else:   # a rank holding only padding rows
        tensor = torch.zeros([0 if d == dim else s for d, s in enumerate(shape)])
    if tensor.shape[dim] < per:   # vocabulary padding rows (dim 0)
        tensor = torch.nn.functional.pad(tensor, (0, 0, 0, per - tensor.shape[dim]))
    return tensor


def load(trainer, folder: Path) -> None:
    """Set this rank's weights and optimizer state from `folder`/optim/ (no collective needed:
    each rank reads only what it holds)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from safetensors import safe_open
    source = Path(folder) / FOLDER
    meta = json.loads((source / META).read_text())
    step = torch.tensor(float(meta["adam_step"]))
    cfg = trainer.cfg.model
    tp, tp_rank = dist.get_world_size(trainer.tp_group), dist.get_rank(trainer.tp_group)
    zero = _zero_optimizer(trainer)
    if zero is not None:   # somewhere to write: zero Adam state holding the saved step, linked
        for flat in zero.single_partition_of_fp32_groups:
            zero.optimizer.state[flat] = {"step": step.clone(), "exp_avg": torch.zeros_like(flat),
                                          "exp_avg_sq": torch.zeros_like(flat)}
        _relink(zero)
    for name, p in _local_parameters(trainer):
        path = source / f"{name}.safetensors"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the re-shardable optimizer state of {folder} is "
                                  f"incomplete (no file for parameter {name}).")
        with safe_open(str(path), framework="pt") as handle:
            values = {k: _read_tp_slice(handle, k, name, cfg, tp, tp_rank).to(p.device)
                      for k in ("fp32", *ADAM_KEYS)}
        if values["fp32"].shape != p.shape:
            raise CheckpointError(f"{path}: shape {tuple(values['fp32'].shape)} for this rank's "
                                  f"{tuple(p.shape)}: the checkpoint is of another model.")
        with torch.no_grad():
            p.data.copy_(values["fp32"])
        if zero is not None:
            safe_set_full_fp32_param(p, values["fp32"])
            for key in ADAM_KEYS:
                safe_set_full_optimizer_state(p, values[key], key)
        else:
            trainer.guard.state[p] = {"step": step.clone(), **{k: values[k] for k in ADAM_KEYS}}


# ------------------------------------------------------------ offline: from DeepSpeed's files

# the only non-tensor objects in DeepSpeed's ZeRO optimizer files (0.19): allowed explicitly so
# that they load with weights_only=True
def _deepspeed_safe_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


def _load_deepspeed_file(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete or its layout record is wrong.")
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


def extract_from_deepspeed(checkpoint: Path, client: dict, out: Path) -> int:
    """Write `out` (an optim/ folder) from the ZeRO-1/2 optimizer files DeepSpeed wrote into
    `checkpoint`: each rank's flat partitions are cut back into parameters with DeepSpeed's own
    slice mappings, the DP fragments concatenated, the TP shards merged with our partition
    table. One pipeline stage and TP rank at a time is in memory. Returns the parameter count."""
    from collections import defaultdict

    from safetensors.torch import save_file

    from .checkpoint import model_config_from_dict
    layout = client["layout"]
    tp, pp, dp = layout["tensor"], layout["pipe"], layout["data"]
    cfg = model_config_from_dict(client["model"])
    out.mkdir(parents=True, exist_ok=True)
    steps, written = set(), 0
    for stage in range(pp):
        shards = defaultdict(lambda: [None] * tp)   # model name -> per TP rank {key: tensor}
        for t in range(tp):
            mp = stage * tp + t
            shapes = {}
            for group in _load_deepspeed_file(checkpoint / f"mp_rank_{mp:02d}_model_states.pt")["param_shapes"]:
                shapes.update(group)
            pieces = defaultdict(lambda: defaultdict(list))   # engine name -> key -> DP fragments
            for d in range(dp):
                saved = _load_deepspeed_file(checkpoint / f"zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt")
                saved = saved["optimizer_state_dict"]
                for g, mapping in enumerate(saved["param_slice_mappings"]):
                    adam = saved["base_optimizer_state"]["state"][g]
                    flat = {"fp32": saved["single_partition_of_fp32_groups"][g], **{k: adam[k] for k in ADAM_KEYS}}
                    steps.add(float(adam["step"]))
                    for name, fragment in mapping.items():
                        for key, values in flat.items():
                            pieces[name][key].append(values.narrow(0, fragment.start, fragment.numel))
            for name, by_key in pieces.items():
                shards[_model_name(name, pp > 1, cfg.n_layers)][t] = {k: torch.cat(v).view(shapes[name]) for k, v in by_key.items()}
        for name, per_tp in shards.items():
            merged = {k: merge_state_dicts([{name: s[k]} for s in per_tp], cfg)[name] for k in ("fp32", *ADAM_KEYS)}
            save_file(merged, str(out / f"{name}.safetensors"))
            written += 1
    if len(steps) != 1:
        raise CheckpointError(f"{checkpoint}: Adam's step differs between parameter groups ({sorted(steps)}).")
    (out / META).write_text(json.dumps({"format": "megatron_id.reshardable_optimizer/1",
                                        "adam_step": steps.pop(), "trainer_step": client["step"]}))
    return written


def convert(source: Path, output: Path) -> Path:
    """`megatron-id convert-checkpoint`: a new train.save folder `output` holding the checkpoint
    `source` (a train.save folder: its `latest`; or an iter_ folder) plus its re-shardable
    optimizer state, so that it resumes WITH its optimizer state at any layout. The source is
    only read; its files are hard-linked into `output` where the file system allows, else
    copied. Returns the new iter_ folder."""
    import os
    import shutil

    from ..errors import OutputExistsError
    from .checkpoint import (checkpoint_files, commit, latest_folder, manifest_entries, read_client_state,
                             verify_checkpoint, write_manifest)
    source, output = Path(source), Path(output)
    folder = source if (source / "client_state.pt").is_file() else latest_folder(source)
    if folder is None:
        raise CheckpointError(f"{source} holds no checkpoint (no `latest`, no client_state.pt): give a "
                              f"train.save folder or an iter_XXXXXXX folder.")
    if output.exists() and any(output.iterdir()):
        raise OutputExistsError(f"{output} exists and is not empty: give a new folder for the converted checkpoint.")
    problems = verify_checkpoint(folder)
    if problems:
        raise CheckpointError(f"{folder} is damaged, not converted: {problems[0]}")
    client = read_client_state(folder)
    if has_reshardable_state(folder):
        raise CheckpointError(f"{folder} already holds re-shardable optimizer state ({FOLDER}/): it "
                              f"resumes at any layout as it is; nothing to convert.")
    if client.get("weights_only"):
        raise CheckpointError(f"{folder} holds weights only (an import): there is no optimizer state to convert.")
    if client["layout"]["zero_stage"] == 0:
        raise CheckpointError(f"{folder} was saved at ZeRO-0, whose optimizer file does not name its "
                              f"parameters: resume it once at its saving layout with "
                              f"train.reshardable_optimizer=true and save, instead of converting.")
    staging = output / ".incomplete" / folder.name
    created = not output.exists()
    staging.mkdir(parents=True)
    try:
        for name in checkpoint_files(folder):
            if name.startswith(f"{FOLDER}/"):
                continue
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(folder / name, target)
            except OSError:
                shutil.copy2(folder / name, target)
        extract_from_deepspeed(folder, client, staging / FOLDER)
        write_manifest(staging, manifest_entries(staging, checkpoint_files(staging)))
        final = commit(staging, output)
        shutil.rmtree(output / ".incomplete", ignore_errors=True)
        return final
    except BaseException:
        shutil.rmtree(output if created else staging, ignore_errors=True)
        raise
