"""`megatron-id import-hf`: an exported folder, or a pretrained Llama / Qwen2 / Mistral
transformers folder (as a softmax model: hf/llama.py), -> a training checkpoint at any TP/PP."""
from __future__ import annotations

import json
import shlex

from .options import MISMATCH_HELP, add_verify_arg


def add_parser(sub) -> None:
    i = sub.add_parser("import-hf", help="an exported folder, or a pretrained Llama / Qwen2 / Mistral "
                       "transformers folder, -> a training checkpoint at any TP/PP", allow_abbrev=False)
    i.add_argument("--input", "--checkpoint", dest="input", required=True,
                   help="a folder written by megatron-id export-hf, or a transformers folder (save_pretrained) "
                        "whose config.json names LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM: "
                        "imported as model.mixer=softmax")
    i.add_argument("--output", required=True,
                   help="a new or empty folder (a non-empty one is refused: see --overwrite)")
    i.add_argument("--overwrite", action="store_true",
                   help="replace --output when it holds one earlier import and nothing else "
                        "(never a folder with training checkpoints)")
    i.add_argument("--tensor-parallel", type=int, default=1)
    i.add_argument("--pipeline-parallel", type=int, default=1)
    i.add_argument("--allow-tokenizer-mismatch", action="store_true", help=MISMATCH_HELP)
    add_verify_arg(i)
    i.set_defaults(func=run)


def run(args) -> int:
    from ..hf.export import import_hf  # torch: not at import (cli.py)
    out = import_hf(args.input, args.output, args.tensor_parallel, args.pipeline_parallel,
                    overwrite=args.overwrite, allow_tokenizer_mismatch=args.allow_tokenizer_mismatch,
                    verify=args.verify)
    print(f"imported {args.input} -> {out} (TP={args.tensor_parallel}, PP={args.pipeline_parallel}; "
          f"weights only: train with train.load={out} data.tokenizer={recorded_tokenizer(out)} (its copy of the "
          f"tokenizer) and its model: {model_overrides(out)})")
    return 0


def recorded_tokenizer(checkpoint) -> str | None:
    """The tokenizer the import `checkpoint` records (its own copy: hf/export.py IMPORT_TOKENIZER)."""
    from ..checkpoint.files import read_client_state
    from ..checkpoint.read import checkpoint_folder
    return read_client_state(checkpoint_folder(checkpoint)).tokenizer


def model_overrides(checkpoint) -> str:
    """The model.* overrides that give a training config the model of the import `checkpoint`
    (its recorded model config where it differs from the schema's defaults)."""
    # torch: not at import (cli.py)
    from ..checkpoint.files import model_config_dict, read_client_state
    from ..checkpoint.read import checkpoint_folder
    from ..model.spec import ModelConfig

    def said(value) -> str:
        if isinstance(value, dict):   # model.rope_scaling: compact JSON, which the override parser reads
            return shlex.quote(json.dumps(value, separators=(",", ":")))
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    defaults = model_config_dict(ModelConfig())
    model = read_client_state(checkpoint_folder(checkpoint)).model
    return " ".join(f"model.{key}={said(value)}" for key, value in model.items()
                    if key != "core_impl" and value != defaults.get(key))
