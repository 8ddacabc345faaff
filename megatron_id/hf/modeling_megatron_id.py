"""Hugging Face model of an exported megatron_id checkpoint (standalone: torch, transformers and
the bundled training code in megatron_id_model.py beside this file).

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    out = model(input_ids, labels=input_ids)          # out.loss, out.logits
    model.generate(input_ids, max_new_tokens=100)     # with a constant-size state (interdomain, s4d)

The cache is the training model's own per-layer state: for interdomain and S4D-only mixers the
recurrent state and short-conv tails, whose size does not depend on the context; for softmax a
KV cache. Prompts longer than config.prefill_chunk_size are prefilled chunk by chunk, so prefill
memory is bounded by the chunk, not the prompt.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megatron_id import MegatronIDConfig
from .megatron_id_model import Group, InterdomainMixer, LanguageModel, names_in_group


class _Choice(str):
    """A string with `.value`, as the training config's enums (mixer, readout) have."""

    @property
    def value(self) -> str:
        return str(self)


def training_model_config(config: MegatronIDConfig) -> SimpleNamespace:
    m = dict(config.model)
    for key in ("mixer", "readout"):
        m[key] = _Choice(m[key])
    return SimpleNamespace(**m)


class RecurrentCache:
    """Per-layer states of the training model, and how many tokens they have seen."""

    is_compileable = False

    def __init__(self, states: list, seen_tokens: int):
        self.states, self.seen_tokens = states, seen_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the cache holds, by path (to measure its size or compare two caches)."""
        out = {}

        def walk(x, path):
            if isinstance(x, torch.Tensor):
                out[path] = x
            elif isinstance(x, (list, tuple)):
                for i, y in enumerate(x):
                    walk(y, f"{path}.{i}")
            elif isinstance(x, dict):
                for k, y in x.items():
                    walk(y, f"{path}.{k}")
            elif hasattr(x, "__dict__"):
                for k, y in vars(x).items():
                    walk(y, f"{path}.{k}")
        walk(self.states, "layers")
        return out


class MegatronIDForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MegatronIDConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    # applied by transformers only when config.tie_word_embeddings (model.tie_embeddings) is set:
    # loading builds the modules on the meta device, which unties the training model's own tie
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}
    # The SSM parameters (those the mixer declares in the ssm optimizer group, model/roles.py)
    # stay float32 when the model is loaded in bf16 or fp16: a_im reaches ~1e3, where bf16
    # steps by 8, and rounding Delta, A or C changes every output; the core computes in float32
    # anyway. transformers 5 matches each entry against the parameter names (a regex search),
    # so these names (log_dt, a_im, k_norm, ...) select exactly the mixers' SSM parameters
    # (tests/test_hf_safety.py checks the set).
    _keep_in_fp32_modules_strict = names_in_group(InterdomainMixer, Group.SSM)

    def __init__(self, config: MegatronIDConfig):
        super().__init__(config)
        self.model = LanguageModel(training_model_config(config), form="chunked", seed=None)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False   # our forward builds its own RecurrentCache

    def _init_weights(self, module):
        pass   # weights always come from model.safetensors

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.lm_head

    def forward(self, input_ids: torch.LongTensor, attention_mask=None, labels=None,
                cache: RecurrentCache | None = None, use_cache: bool | None = None,
                prefill_chunk_size: int | None = None, logits_to_keep: int = 0,
                **kwargs) -> CausalLMOutputWithPast:
        """logits_to_keep > 0 returns only the last positions' logits (generate() asks for 1), so
        a chunked prefill never holds the logits of the whole prompt."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported: the recurrent state would absorb the "
                             "padding. Generate one prompt at a time or left-trim to equal lengths.")
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        chunk = prefill_chunk_size or self.config.prefill_chunk_size
        states, seen = (cache.states, cache.seen_tokens) if cache is not None else (None, 0)
        pieces = []
        for start in range(0, input_ids.shape[1], chunk if use_cache and chunk else input_ids.shape[1]):
            part = input_ids[:, start:start + chunk] if use_cache and chunk else input_ids
            if use_cache:
                logits, states = self.model(part, states=states, return_states=True)
            else:
                logits = self.model(part)
            pieces.append(logits)
            if logits_to_keep:   # drop what can no longer be among the last positions
                pieces = [torch.cat(pieces, dim=1)[:, -logits_to_keep:]]
        logits = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        loss = None
        if labels is not None and logits.shape[1] != input_ids.shape[1]:
            raise ValueError("labels need the logits of every position: leave logits_to_keep at 0.")
        if labels is not None:   # labels are the inputs (shifted here), -100 ignored: HF's convention
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        new_cache = RecurrentCache(states, seen + input_ids.shape[1]) if use_cache else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=new_cache)
