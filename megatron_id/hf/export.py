"""Training checkpoints <-> Hugging Face folders.

export_hf: any checkpoint (any TP/PP/ZeRO layout, any mixer) -> a folder that
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and `AutoTokenizer` load
offline: config.json (with auto_map), configuration_megatron_id.py, modeling_megatron_id.py,
megatron_id_model.py (the training model code, bundled), model.safetensors (TP=1, vocabulary
padding removed, keys `model.<training name>`), the tokenizer files and generation_config.json.

import_hf: such a folder -> a training checkpoint at any TP/PP, holding weights only (the
trainer loads it at any layout and starts the optimizer fresh).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..parallel.pipeline import from_model_names, saved_pieces
from ..parallel.tensor_parallel import split_state_dict
from ..training.checkpoint import (CLIENT_STATE, commit, latest_folder, layer_file, model_config_dict,
                                   model_config_from_dict, module_file, read_client_state,
                                   read_model_state, write_client_state)
from .bundle import bundle_source

HERE = Path(__file__).resolve().parent
CODE_FILES = ("configuration_megatron_id.py", "modeling_megatron_id.py")


def checkpoint_folder(path) -> Path:
    """A checkpoint root (with `latest`) or one iter_XXXXXXX folder -> the folder."""
    path = Path(path)
    folder = latest_folder(path)
    if folder is not None:
        return folder
    if (path / CLIENT_STATE).is_file():
        return path
    raise FileNotFoundError(f"{path} is not a checkpoint: expected a folder with `latest` (a train.save "
                            f"folder) or an iter_XXXXXXX folder with {CLIENT_STATE}.")


def read_checkpoint(path):
    """A training checkpoint -> (its folder, client state, ModelConfig, TP=1 weights)."""
    folder = checkpoint_folder(path)
    client = read_client_state(folder)
    cfg = model_config_from_dict(client["model"])
    return folder, client, cfg, read_model_state(folder, cfg, client["layout"])


def read_hf_folder(folder):
    """An exported folder -> (its config.json, ModelConfig, TP=1 weights with training names)."""
    from safetensors.torch import load_file
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    weights = {k.removeprefix("model."): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    return config, model_config_from_dict(config["model"]), weights


def _tokenizer_ids(tokenizer_file: Path) -> dict:
    from data_tools.tokenizer import eod_id, load_tokenizer
    tok = load_tokenizer(str(tokenizer_file))
    eos = eod_id(tok)
    return {"eos_token": tok.id_to_token(eos), "eos_token_id": eos}


def export_hf(checkpoint, output, tokenizer=None, prefill_chunk_size: int = 2048) -> Path:
    """Write the Hugging Face folder `output` (atomically: built beside it, then renamed)."""
    from safetensors.torch import save_file
    folder, client, cfg, weights = read_checkpoint(checkpoint)
    tokenizer = tokenizer or client.get("tokenizer")
    if not tokenizer or not Path(tokenizer).is_file():
        raise FileNotFoundError(f"tokenizer {tokenizer!r} not found: pass --tokenizer path/to/tokenizer.json "
                                f"(the one the data was preprocessed with; data.tokenizer records it).")
    ids = _tokenizer_ids(Path(tokenizer))
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        save_file({f"model.{k}": v.contiguous().clone() for k, v in weights.items()},
                  str(staging / "model.safetensors"), metadata={"format": "pt"})
        for name in CODE_FILES:
            shutil.copy(HERE / name, staging / name)
        (staging / "megatron_id_model.py").write_text(bundle_source())
        config = {
            "model_type": "megatron_id", "architectures": ["MegatronIDForCausalLM"],
            "auto_map": {"AutoConfig": "configuration_megatron_id.MegatronIDConfig",
                         "AutoModelForCausalLM": "modeling_megatron_id.MegatronIDForCausalLM"},
            "model": model_config_dict(cfg), "prefill_chunk_size": prefill_chunk_size,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "tie_word_embeddings": cfg.tie_embeddings,
            "eos_token_id": ids["eos_token_id"], "pad_token_id": ids["eos_token_id"],
            "bos_token_id": ids["eos_token_id"], "torch_dtype": "float32", "use_cache": True,
            "megatron_id": {"step": client.get("step"), "saved_layout": client["layout"]},
        }
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": ids["eos_token_id"], "pad_token_id": ids["eos_token_id"],
             "bos_token_id": ids["eos_token_id"], "do_sample": False}, indent=2) + "\n")
        shutil.copy(tokenizer, staging / "tokenizer.json")
        (staging / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": ids["eos_token"],
             "bos_token": ids["eos_token"], "pad_token": ids["eos_token"], "unk_token": ids["eos_token"],
             "model_max_length": 10**9}, indent=2) + "\n")
        if output.exists():
            shutil.rmtree(output)
        os.replace(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


def import_hf(folder, output, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> Path:
    """An exported folder -> `output`/iter_0000000 (+ `latest`), weights only, at TP x PP."""
    folder, output = Path(folder), Path(output)
    _, cfg, full = read_hf_folder(folder)
    shards = split_state_dict(full, cfg, tensor_parallel)
    layout = {"tensor": tensor_parallel, "pipe": pipeline_parallel, "data": 1, "zero_stage": 0}
    client = {"step": 0, "layout": layout, "model": model_config_dict(cfg), "weights_only": True,
              "tokenizer": str(folder / "tokenizer.json")}
    staging = output / ".incomplete" / "iter_0000000"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for tp, shard in enumerate(shards):
        if pipeline_parallel == 1:
            torch.save({"module": shard}, staging / module_file(tp))
            continue
        for piece in saved_pieces(cfg):
            torch.save(from_model_names(shard, piece, cfg.n_layers, cfg.tie_embeddings),
                       staging / layer_file(piece, tp))
    write_client_state(staging, client)
    commit(staging, output)
    return output
