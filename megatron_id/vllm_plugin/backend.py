"""The state backend of the fixed-state layers (interdomain, S4D-only) in vLLM: vLLM builds, once
per engine step, the metadata every such layer reads (which requests decode and which prefill,
where each prefill's tokens lie, which state slot is each request's, whether a prefill continues
a state). The generic Mamba metadata is all it takes; the causal-conv1d kernels' extras are not
needed (the layers run their own short convs).
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm.model_executor.models.config import MambaModelConfig
from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadata, BaseMambaAttentionMetadataBuilder
from vllm.v1.attention.backends.short_conv_attn import ShortConvAttentionBackend


@dataclass
class FixedStateMetadata(BaseMambaAttentionMetadata):
    pass


class FixedStateMetadataBuilder(BaseMambaAttentionMetadataBuilder[FixedStateMetadata]):
    metadata_cls = FixedStateMetadata
    needs_causal_conv1d_metadata = False


class FixedStateBackend(ShortConvAttentionBackend):
    """(A subclass of the in-tree short-conv backend: the same kind of state, our own name.)"""

    @staticmethod
    def get_name() -> str:
        return "MEGATRON_ID_FIXED_STATE"

    @staticmethod
    def get_builder_cls() -> type[FixedStateMetadataBuilder]:
        return FixedStateMetadataBuilder


class FixedStateModelConfig(MambaModelConfig):
    """vLLM's settings for a model with Mamba-style layers (the state's block size, prefix
    caching's "align" mode), and one fix for a model with no attention layer at all.

    With prefix caching, vLLM caches a state at every `mamba_block_size` tokens and its scheduler
    ends prefill chunks on multiples of `block_size` so that those states exist. vLLM 0.32 sets
    mamba_block_size from block_size (16) here, after which the CPU platform raises block_size to
    128 for its attention kernel; the engine reconciles the two in its own process but not in the
    scheduler's copy when the engine runs in a process of its own (the API server, LLM by
    default). The scheduler then let chunks end between the 16-token boundaries, while the cache
    still recorded a state at each: a later prompt sharing 64 tokens started from a state of 63
    (tests/test_vllm.py found it: the 32-request round after the 8-request one). Without
    attention layers nothing needs 128, so block_size stays mamba_block_size, as if given."""

    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        hf_config = vllm_config.model_config.hf_config
        types = getattr(hf_config, "layer_types", None) or []
        if types and "linear_attention" not in types:
            # softmax and sliding-window layers only: an attention model to vLLM, not a hybrid with
            # no state layer (which it cannot size: "'NoneType' object is not iterable"); each
            # layer's window is its Attention's own (per_layer_sliding_window)
            hf_config.layer_types = ["full_attention"] * len(types)
            return
        super().verify_and_update_config(vllm_config)
        cache = vllm_config.cache_config
        attention_free = not any(t in ("full_attention", "sliding_attention") for t in types)
        if attention_free and cache.mamba_cache_mode == "align" and not cache.user_specified_block_size:
            cache.block_size = cache.mamba_block_size
            cache.user_specified_block_size = True
