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


def tokenizer_size(folder) -> int | None:
    """How many ids the export's tokenizer.json can produce (None: no such file)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


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
    model = vllm_config.model_config
    ids = tokenizer_size(model.tokenizer) if Path(str(model.tokenizer)).is_dir() else None
    if ids is not None and ids > cfg.vocab_size:
        raise ValueError(f"{model.tokenizer}/tokenizer.json has {ids} ids, the model's vocabulary {cfg.vocab_size} "
                         f"(config.json model.vocab_size): vLLM does not check a prompt's ids and would crash on the "
                         f"first id past {cfg.vocab_size - 1}. Serve it with the tokenizer it was trained with "
                         f"(--tokenizer).")
