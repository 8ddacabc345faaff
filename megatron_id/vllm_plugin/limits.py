"""What vLLM cannot run, said before a user finds out from a crash: checked by export-hf (a
warning: the export still serves transformers and megatron-id serve) and by the plugin when vLLM
builds the model (an error). Plain code: no vLLM import (export-hf runs without vLLM).
"""
from __future__ import annotations

from pathlib import Path

# the head sizes vLLM 0.32's CPU attention backend takes (v1/attention/backends/cpu_attn.py);
# its GPU backends take more (FlashAttention: multiples of 8 up to 256)
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def attention_head_size(cfg) -> int | None:
    """The head size of the model's softmax / sliding-window layers; None without such layers."""
    from ..model.pattern import layer_letters
    return cfg.d_model // cfg.n_heads if set(layer_letters(cfg)) & {"A", "W"} else None


def vllm_warnings(cfg) -> list[str]:
    """What export-hf says of an export vLLM's CPU build cannot serve (empty: nothing)."""
    size = attention_head_size(cfg)
    if size is None or size in CPU_ATTENTION_HEAD_SIZES:
        return []
    return [f"its softmax layers' head size is {size} (model.d_model {cfg.d_model} / model.n_heads {cfg.n_heads}): "
            f"vLLM's CPU attention takes {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))} only, so vLLM on a CPU "
            f"cannot serve this export (its GPU backends can, from multiples of 8; transformers and megatron-id "
            f"serve can anywhere)"]


def tokenizer_refusal(cfg, folder) -> str | None:
    """Why vLLM cannot serve the model with `folder`'s tokenizer.json (None: it can, or there is
    none): more ids than the model's vocabulary, which vLLM does not check in a prompt."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    if ids <= cfg.vocab_size:
        return None
    return (f"{path} has {ids} ids, the model's vocabulary {cfg.vocab_size} (config.json model.vocab_size): vLLM "
            f"does not check a prompt's ids and would crash on the first id past {cfg.vocab_size - 1}. Serve it "
            f"with the tokenizer it was trained with (vLLM's --tokenizer)")


def check_servable(cfg, vllm_config) -> None:
    """Raise ValueError naming the setting and the fix where this vLLM cannot serve the export."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ValueError(f"the megatron_id vLLM plugin runs a model in one process: tensor_parallel_size "
                         f"{parallel.tensor_parallel_size}, pipeline_parallel_size {parallel.pipeline_parallel_size} "
                         f"are not supported. Start vLLM without --tensor-parallel-size / --pipeline-parallel-size "
                         f"(or use megatron-id serve).")
    from vllm.platforms import current_platform
    size = attention_head_size(cfg)
    if current_platform.is_cpu() and size is not None and size not in CPU_ATTENTION_HEAD_SIZES:
        raise ValueError(vllm_warnings(cfg)[0].replace("its softmax", "this export's softmax", 1) + ".")
    why = tokenizer_refusal(cfg, str(vllm_config.model_config.tokenizer))
    if why:
        raise ValueError(why + ".")
