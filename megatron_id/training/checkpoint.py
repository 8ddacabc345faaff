"""Reading our DeepSpeed checkpoints at any layout: one TP=1 model state dict from the files of
whatever TP x PP layout wrote them, and the check that decides how a checkpoint can be loaded.

A checkpoint folder `iter_XXXXXXX/` holds DeepSpeed's files:
  PP = 1   mp_rank_{tp:02d}_model_states.pt        {"module": state dict of TP rank tp, ...}
  PP > 1   layer_{i:02d}-model_{tp:02d}-model_states.pt   one per pipeline piece i and TP rank
           (piece 0 = embedding, 1..L = blocks, L+1 = final norm, L+2 = LM head, absent when
           tied to the embedding; see parallel/pipeline.py)
           and mp_rank_{r:02d}_model_states.pt per stage x TP rank (DeepSpeed's bookkeeping)
  ZeRO     zero_pp_rank_{dp}_mp_rank_{r:02d}_optim_states.pt (optimizer partitions)
and ours, client_state.pt: step, the layout that wrote the checkpoint, model config, tokenizer,
RNG (DeepSpeed keeps a copy in its mp_rank files; this one is read without loading weights).
A checkpoint root holds iter_XXXXXXX folders and `latest`, the name of the newest complete one;
`commit` moves a finished folder into place and only then replaces `latest` (atomically).

Weights can be re-sharded to any layout (merge_state_dicts -> split_state_dict). The optimizer
state cannot: its ZeRO partitions are flat buffers cut by the writer's DP x TP x PP layout, and
DeepSpeed's universal checkpoint conversion is not wired up. Loading at another layout therefore
needs train.load_optimizer=false (Megatron's --no-load-optim); the error says so.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, ModelConfig
from ..parallel.pipeline import saved_pieces, to_model_names
from ..parallel.tensor_parallel import merge_state_dicts


def model_config_dict(cfg: ModelConfig) -> dict:
    """The model config as plain values (enums as strings): loads with weights_only=True."""
    import dataclasses
    from enum import Enum
    return {k: (v.value if isinstance(v, Enum) else v) for k, v in dataclasses.asdict(cfg).items()}


def model_config_from_dict(values: dict) -> ModelConfig:
    from omegaconf import OmegaConf
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), values))


def layout_record(layout, zero_stage: int) -> dict:
    return {"tensor": layout.tensor, "pipe": layout.pipe, "data": layout.data, "zero_stage": zero_stage}


def describe(record: dict) -> str:
    return (f"TP={record['tensor']}, PP={record['pipe']}, DP={record['data']}, "
            f"ZeRO-{record['zero_stage']}")


def optimizer_state_loadable(saved: dict, current: dict) -> bool:
    """DeepSpeed can restore its optimizer files only into the layout that wrote them (the DP
    size matters only when ZeRO partitions the state over it)."""
    keys = ["tensor", "pipe", "zero_stage"] + (["data"] if current["zero_stage"] > 0 else [])
    return all(saved[k] == current[k] for k in keys)


def cross_layout_error(path: Path, saved: dict, current: dict) -> ConfigError:
    return ConfigError(
        f"checkpoint {path} was saved at {describe(saved)}; this run is {describe(current)}. "
        f"The weights can be re-sharded to this layout but the optimizer state cannot (DeepSpeed "
        f"partitions it by the saving layout). Set train.load_optimizer=false to load the weights "
        f"with fresh optimizer state (the step, data position and LR schedule continue), or "
        f"run at the saved layout to resume exactly.")


CLIENT_STATE = "client_state.pt"


def module_file(tp: int) -> str:
    return f"mp_rank_{tp:02d}_model_states.pt"


def layer_file(piece: int, tp: int) -> str:
    return f"layer_{piece:02d}-model_{tp:02d}-model_states.pt"


def latest_folder(root) -> Path | None:
    """The folder `root`/latest names (None when there is no `latest`)."""
    root = Path(root)
    if not (root / "latest").is_file():
        return None
    tag = (root / "latest").read_text().strip()
    if not (root / tag).is_dir():
        raise FileNotFoundError(f"{root}/latest names '{tag}' but {root / tag} does not exist.")
    return root / tag


def commit(staged: Path, root: Path) -> Path:
    """Rename the complete folder `staged` to `root`/<its name>, then point `latest` at it: a
    kill at any moment leaves `latest` on a complete checkpoint."""
    final = root / staged.name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staged, final)
    tmp = root / ".latest.tmp"
    tmp.write_text(staged.name)
    os.replace(tmp, root / "latest")   # the commit point
    return final


def _load(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing: the checkpoint is incomplete "
                                f"or was written by another layout than its record says.")
    return torch.load(path, map_location="cpu", weights_only=True)


def write_client_state(ckpt: Path, client: dict) -> None:
    torch.save(client, Path(ckpt) / CLIENT_STATE)


def read_client_state(ckpt: Path) -> dict:
    """Our client state (step, layout, model config, RNG...)."""
    return _load(Path(ckpt) / CLIENT_STATE)


def read_model_state(ckpt: Path, cfg: ModelConfig, saved: dict) -> dict:
    """The TP=1, unpadded LanguageModel state dict held by checkpoint folder `ckpt`."""
    ckpt = Path(ckpt)
    shards = []
    for tp in range(saved["tensor"]):
        if saved["pipe"] == 1:
            shards.append(dict(_load(ckpt / module_file(tp))["module"]))
            continue
        shard = {}
        for piece in saved_pieces(cfg):
            shard.update(to_model_names(piece, _load(ckpt / layer_file(piece, tp)), cfg.n_layers))
        shards.append(shard)
    return merge_state_dicts(shards, cfg)


# RNG states as tensors and ints, so the files load with weights_only=True.
def rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
