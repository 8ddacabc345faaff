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
Tied embeddings across pipeline stages: one file (embed.weight), written by the first stage,
read by the first and the last.
Design measured in a spike (issue 12): this format vs DeepSpeed's universal checkpoint, which
needs our partition table injected, folder renames between PP=1 and PP>1, and fails at ZeRO-0.
"""
from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import BadOptionError, OutputExistsError, refuse_output_inside
from ..parallel import state
from ..parallel.layout import LayoutError, check_model_split
from ..parallel.pipeline import to_model_names
from ..parallel.tensor_parallel import merge_state_dicts
from .deepspeed_files import load_deepspeed_file, zero_optim_file
from .files import commit, finish_staging, module_file, read_client_state, staging_folder
from .integrity import CheckpointError, checkpoint_files, manifest_entries, verify_checkpoint, write_manifest
from .read import checkpoint_folder, local_slice, merged_tensor, saved_shards

FOLDER = "optim"
META = "meta.json"
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def has_reshardable_state(checkpoint: Path) -> bool:
    return (Path(checkpoint) / FOLDER / META).is_file()


def _model_name(engine_name: str, pipelined: bool, n_layers: int) -> str:
    """A parameter name of the engine's module (PipelineModule: `<piece>.<rest>`, or
    `tied_modules.<key>.<rest>` for the embedding shared with the LM head) as the single-device
    model names it."""
    if not pipelined:
        return engine_name
    piece, rest = engine_name.split(".", 1)
    if piece == "tied_modules":   # TiedEmbeddingStage: its names are piece 0's
        return rest.split(".", 1)[1]
    (name,) = to_model_names(int(piece), {rest: None}, n_layers)
    return name


def _local_parameters(trainer) -> list[tuple[str, torch.nn.Parameter]]:
    """(single-device model name, parameter) of this rank, in module order: the same order on
    every DP and TP rank of a stage, which the collectives below need. With tied embeddings
    across stages the first and the last stage both hold the matrix (DeepSpeed keeps the two
    copies equal: one init, summed gradients): both read it, the first stage writes it."""
    return [(_model_name(name, trainer.pipelined, trainer.cfg.model.n_layers), p)
            for name, p in trainer.engine.module.named_parameters()]


def _writes(trainer, engine_name: str) -> bool:
    """Whether this stage writes the file of `engine_name` (a tied copy: the first stage only)."""
    return not engine_name.startswith("tied_modules.") or state.get_pipe_parallel_rank() == 0


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
    # deepspeed where it is used, as everywhere in the package: its import takes seconds, which
    # convert-checkpoint's refusals (all made before a DeepSpeed file is read) and the modules that
    # import this one for its names should not wait for; a run that saves has imported it already
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
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
    engine_names = [name for name, _ in trainer.engine.module.named_parameters()]
    for (name, p), engine_name in zip(_local_parameters(trainer), engine_names):
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
        if writer and _writes(trainer, engine_name):
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


def load(trainer, folder: Path) -> None:
    """Set this rank's weights and optimizer state from `folder`/optim/ (no collective needed:
    each rank reads only what it holds)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state  # as in save
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
            values = {}
            for key in ("fp32", *ADAM_KEYS):   # one stored TP=1 tensor, read lazily: only this rank's rows
                stored = handle.get_slice(key)
                part = (tuple(stored.get_shape()), stored.__getitem__)
                values[key] = local_slice(name, cfg, tp, tp_rank, [part]).to(p.device)
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

def _fragments(fragments: list, shape) -> dict:
    """{fp32, exp_avg, exp_avg_sq} of one parameter from its DP fragments [(flat tensors of a
    DP rank's group, fragment_address)]: views of the memory-mapped files where the parameter
    lies in one partition, else the fragments concatenated (this parameter only)."""
    out = {}
    for key in ("fp32", *ADAM_KEYS):
        parts = [flat[key].narrow(0, fragment.start, fragment.numel) for flat, fragment in fragments]
        out[key] = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(shape)
    return out


def _zero12_stage(checkpoint: Path, layout: dict, cfg, stage: int, steps: set) -> dict:
    """{model name: per TP rank a function () -> {fp32, exp_avg, exp_avg_sq}} of pipeline stage
    `stage` from DeepSpeed's ZeRO-1/2 optimizer files: each DP rank's flat partitions cut back
    into parameters with DeepSpeed's own slice mappings, the DP fragments concatenated. The
    files are memory-mapped: a parameter is read only when its function is called."""
    tp, pp, dp = layout["tensor"], layout["pipe"], layout["data"]
    shards = defaultdict(lambda: [None] * tp)
    for t in range(tp):
        mp = stage * tp + t
        shapes = {}
        for group in load_deepspeed_file(checkpoint / module_file(mp))["param_shapes"]:
            shapes.update(group)
        pieces = defaultdict(list)   # engine name -> [(flat tensors of a DP rank's group, fragment)]
        for d in range(dp):
            saved = load_deepspeed_file(checkpoint / zero_optim_file(d, mp))
            saved = saved["optimizer_state_dict"]
            for g, mapping in enumerate(saved["param_slice_mappings"]):
                adam = saved["base_optimizer_state"]["state"][g]
                flat = {"fp32": saved["single_partition_of_fp32_groups"][g], **{k: adam[k] for k in ADAM_KEYS}}
                steps.add(float(adam["step"]))
                for name, fragment in mapping.items():
                    pieces[name].append((flat, fragment))
        for name, fragments in pieces.items():
            shards[_model_name(name, pp > 1, cfg.n_layers)][t] = partial(_fragments, fragments, shapes[name])
    return shards


def _zero0_stage(checkpoint: Path, layout: dict, cfg, stage: int, steps: set, weights: list) -> dict:
    """The same from a ZeRO-0 checkpoint: GuardedAdamW's own state dict (in DeepSpeed's
    mp_rank file), whose parameter groups name their parameters (`param_names`: the engine
    module's names, given to the optimizer at ZeRO-0 for this), and the weights themselves
    (fp32 at ZeRO-0: there is no separate master copy). `weights`: per TP rank {model name:
    tensor}, memory-mapped."""
    tp, pp = layout["tensor"], layout["pipe"]
    shards = defaultdict(lambda: [None] * tp)
    for t in range(tp):
        path = checkpoint / module_file(stage * tp + t)
        optimizer = load_deepspeed_file(path).get("optimizer")
        groups = (optimizer or {}).get("param_groups", [])
        if not groups or any("param_names" not in g for g in groups):
            raise CheckpointError(f"{path}: its ZeRO-0 optimizer state does not name its parameters "
                                  f"(written before megatron_id named them): resume it once at its saving "
                                  f"layout with train.reshardable_optimizer=true and save, instead of converting.")
        for group in groups:
            for index, engine_name in zip(group["params"], group["param_names"], strict=True):
                adam = optimizer["state"].get(index)
                if adam is None:
                    raise CheckpointError(f"{path}: no Adam state for {engine_name}: the checkpoint was "
                                          f"saved before the first optimizer step; there is nothing to convert.")
                steps.add(float(adam["step"]))
                name = _model_name(engine_name, pp > 1, cfg.n_layers)
                values = {"fp32": weights[t][name], **{k: adam[k] for k in ADAM_KEYS}}
                shards[name][t] = lambda values=values: values
    return shards


def extract_from_deepspeed(checkpoint: Path, client, out: Path) -> int:
    """Write `out` (an optim/ folder) from the optimizer files DeepSpeed wrote into
    `checkpoint` (ZeRO-0, 1 or 2), the TP shards merged with our partition table. The files are
    memory-mapped and one parameter is read, merged and written at a time (its file written
    straight from the mapping where nothing needs merging): the conversion holds at most one
    merged parameter's three tensors in memory (benchmarks/checkpoint_memory.py). Returns the
    number of parameter files written."""
    layout = client.layout
    cfg = client.model_config()
    out.mkdir(parents=True, exist_ok=True)
    weights = saved_shards(checkpoint, cfg, layout) if layout["zero_stage"] == 0 else None
    steps, written = set(), 0
    for stage in range(layout["pipe"]):
        if weights is None:
            shards = _zero12_stage(checkpoint, layout, cfg, stage, steps)
        else:
            shards = _zero0_stage(checkpoint, layout, cfg, stage, steps, weights)
        for name, per_tp in shards.items():
            if (out / f"{name}.safetensors").exists():   # a tied copy on the last stage: written by the first
                continue
            if any(s is None for s in per_tp):
                raise CheckpointError(f"{checkpoint}: {name} is missing from some TP ranks' optimizer state.")
            per_tp = [read() for read in per_tp]
            merged = {k: merged_tensor(name, [s[k].float() for s in per_tp], cfg)[0].contiguous()
                      for k in ("fp32", *ADAM_KEYS)}
            save_file(merged, str(out / f"{name}.safetensors"))
            written += 1
            del per_tp, merged
    if len(steps) != 1:
        raise CheckpointError(f"{checkpoint}: Adam's step differs between parameter groups ({sorted(steps)}).")
    (out / META).write_text(json.dumps({"format": "megatron_id.reshardable_optimizer/1",
                                        "adam_step": steps.pop(), "trainer_step": client.step}))
    return written


def check_target_layout(cfg, tensor_parallel: int | None, pipeline_parallel: int | None, folder: Path) -> None:
    for option, value in (("--tensor-parallel", tensor_parallel), ("--pipeline-parallel", pipeline_parallel)):
        if value is not None and value < 1:
            raise BadOptionError(f"{option} {value} is invalid: it must be at least 1.")
    try:
        check_model_split(cfg, tensor_parallel or 1, pipeline_parallel or 1)
    except LayoutError as err:
        raise BadOptionError(f"the model of {folder} cannot be loaded at --tensor-parallel "
                             f"{tensor_parallel or 1} --pipeline-parallel {pipeline_parallel or 1}: {err}") from None


def convert(source: Path, output: Path, tensor_parallel: int | None = None,
            pipeline_parallel: int | None = None) -> Path:
    """`megatron-id convert-checkpoint`: a new train.save folder `output` holding the checkpoint
    `source` (a train.save folder: its `latest`; or an iter_ folder) plus its re-shardable
    optimizer state, so that it resumes WITH its optimizer state at any layout. The source is
    only read; its files are hard-linked into `output` where the file system allows, else
    copied. `tensor_parallel` / `pipeline_parallel`: the layout the user means to load at (the
    result loads at any): checked against the model first, so that a size that cannot split it
    fails now and not when the job starts. Returns the new iter_ folder."""
    source, output = Path(source), Path(output).resolve()
    folder = checkpoint_folder(source)
    sources = {source.resolve(), folder.resolve()}
    if (folder.parent / "latest").is_file():   # an iter_ folder: its train.save root is the source too
        sources.add(folder.parent.resolve())
    for checkpoint in sorted(sources, key=lambda p: len(p.parts)):
        refuse_output_inside(output, checkpoint, "the checkpoint being converted", "converted")
    if output.exists() and not output.is_dir():
        raise OutputExistsError(f"--output {output} is a file: give a new folder for the converted checkpoint.")
    if output.exists() and any(output.iterdir()):
        raise OutputExistsError(f"{output} exists and is not empty: give a new folder for the converted checkpoint.")
    problems = verify_checkpoint(folder)
    if problems:
        raise CheckpointError(f"{folder} is damaged, not converted: {problems[0]}")
    client = read_client_state(folder)
    if has_reshardable_state(folder):
        raise CheckpointError(f"{folder} already holds re-shardable optimizer state ({FOLDER}/): it "
                              f"resumes at any layout as it is; nothing to convert.")
    check_target_layout(client.model_config(), tensor_parallel, pipeline_parallel, folder)
    if client.weights_only:
        raise CheckpointError(f"{folder} holds weights only (written by import-hf, with train.save_optimizer=false "
                              f"or at step 0): there is no optimizer state to convert; it loads at any layout as "
                              f"it is.")
    if client.layout is None:
        raise CheckpointError(f"{folder} has no layout record (written before records existed): resume it "
                              f"once at its saving layout with train.reshardable_optimizer=true and save, "
                              f"instead of converting.")
    if client.layout["zero_stage"] == 3:
        raise CheckpointError(f"{folder} was saved at ZeRO-3, whose optimizer files hold flat partitions "
                              f"without parameter boundaries: resume it at its saving layout, or load its "
                              f"weights at another layout with train.load_optimizer=false.")
    created = not output.exists()
    staging = staging_folder(output, folder.name)
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
        finish_staging(output)
        return final
    except BaseException:
        shutil.rmtree(output if created else staging, ignore_errors=True)
        raise
