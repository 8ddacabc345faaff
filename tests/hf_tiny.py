"""A tiny exported model in a second, without training: a freshly initialised LanguageModel
written as a weights-only checkpoint (the import-hf path) and exported. For tests of the
exported model's behaviour under Hugging Face clients (transformers, lm-evaluation-harness)."""
from __future__ import annotations

from pathlib import Path

import torch
from conftest import CONFIGS, ROOT

from megatron_id.checkpoint.files import ClientState, model_config_dict
from megatron_id.checkpoint.read import write_weights_only
from megatron_id.config import load_config
from megatron_id.hf.export import export_hf, write_folder
from megatron_id.model.language_model import LanguageModel

TOKENIZER = ROOT / "tests/data/gpt2-tokenizer.json"
MIXER_ITEMS = {"interdomain": [], "softmax": ["model.mixer=softmax"], "s4d": ["model.mixer=s4d"],
               # a hybrid with every kind of layer; a window shorter than the prompts
               "hybrid": ["model.layer_pattern=IWAS", "model.n_layers=4", "model.window=3"]}


def tiny_export(folder: Path, mixer: str = "interdomain", items=(), seed: int = 3) -> Path:
    """Export of a random tiny model (GPT-2 vocabulary, init_std 0.2 so that greedy choices are
    far from ties, no parameter left at zero) to `folder`; returns the folder."""
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"],
                      MIXER_ITEMS[mixer] + ["model.vocab_size=50257", "model.chunk_size=8",
                                            "model.init_std=0.2", *items]).model
    model = LanguageModel(cfg, seed=seed)
    # parameters that start at zero (biases, the imaginary part of C) get values too, so that
    # what a test compares does not rest on them being zero: a padded position's key is only
    # zero because the model makes it so, not because k_bias and the conv biases start at zero
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.any():
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    return export_model(model, cfg, folder)


def export_model(model: LanguageModel, cfg, folder: Path, step: int = 0, tokenizer: Path = TOKENIZER) -> Path:
    """`model` written as a weights-only checkpoint (`folder`-ckpt) and exported to `folder`."""
    client = ClientState(step=step, model=model_config_dict(cfg), weights_only=True, tokenizer=str(tokenizer),
                         layout={"tensor": 1, "pipe": 1, "data": 1, "zero_stage": 0})
    shard = {k: v.detach().clone() for k, v in model.state_dict().items()}
    checkpoint = write_folder(Path(folder).with_name(Path(folder).name + "-ckpt"),
                              lambda staging: write_weights_only(staging, [shard], cfg, 1, client))
    return export_hf(checkpoint, folder)
