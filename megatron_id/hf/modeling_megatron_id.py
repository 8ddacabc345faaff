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

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import megatron_id_model as bundled
from .configuration_megatron_id import MegatronIDConfig
from .megatron_id_model import (
    FusedDecoder,
    Group,
    InterdomainMixer,
    LanguageModel,
    ModelConfig,
    fused_decode_refusal,
    model_config_from_values,
    names_in_group,
)


def training_model_config(config: MegatronIDConfig) -> ModelConfig:
    """The training ModelConfig (model/spec.py, bundled) that config.json's `model` section was
    written from: the bundled code reads the same dataclass, enums included, as in training."""
    return model_config_from_values(config.model)


# transformers 5.24 renamed the output field past_key_values to cache; write whichever the
# installed version has (5.0-5.23: past_key_values), and accept both names as input
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class RecurrentCache:
    """Per-layer states of the training model, how many tokens they have seen, and, for a
    left-padded batch, each row's first real position (so that later calls without an
    attention mask still know where each row starts)."""

    is_compileable = False

    def __init__(self, states: list | None, seen_tokens: int, start: torch.Tensor | None = None,
                 fused: FusedDecoder | None = None):
        # once the fused decode step has taken over (fused), the states live in its slots
        self.states, self.seen_tokens, self.start, self.fused = states, seen_tokens, start, fused

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i of the batch continues from row beam_idx[i]. Every per-row tensor
        is indexed along its batch dimension; the parameter-only step tables are shared."""
        if self.fused is not None:
            self.fused.reorder(beam_idx)
        else:
            self.states = _rows(self.states, beam_idx)
        if self.start is not None:
            self.start = _rows(self.start, beam_idx)

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
        if self.fused is not None:   # the fused step's slots (one per row)
            for i, layer in enumerate(self.fused.layers):
                for name, buffer in layer.buffers.items():
                    out[f"fused.{i}.{name}"] = buffer
        return out


_CPP_CORE = []   # [the installed megatron_id's cpu_kernel module or None], decided once


def _cpp_core():
    """megatron_id's C++ core of the fused step (inference/cpu_kernel.py: built once, ~10 s, and
    cached) when megatron_id is installed and is the version that wrote this export: its bundle of
    the model code equal, byte for byte, to megatron_id_model.py here. Else None: the bundled
    torch ops decode (the same numbers, a little slower on a CPU)."""
    if not _CPP_CORE:
        from pathlib import Path
        try:
            from megatron_id.hf.bundle import bundle_source
            from megatron_id.inference import cpu_kernel
            same = bundle_source() == Path(bundled.__file__).read_text()
        except Exception:   # not installed, or another version that cannot bundle
            cpu_kernel, same = None, False
        _CPP_CORE.append(cpu_kernel if same else None)
    return _CPP_CORE[0]


def _rows(x, index: torch.Tensor):
    """The rows `index` of every per-row tensor in a state (beam search; one row for the fused
    step); the parameter-only step tables shared, positions (ints) as they are."""
    if isinstance(x, torch.Tensor):
        return x.index_select(0, index.to(x.device))
    if isinstance(x, dict):
        return {k: (v if k == "tables" else _rows(v, index)) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_rows(y, index) for y in x)
    return x


def padding_of(attention_mask: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """attention_mask [B, L] (1 = real token) -> (start [B]: each row's first real position, or
    None when no row starts with padding; whether some row ends with padding). A row must be
    padding, then tokens, then padding: holes in the middle are refused."""
    real = attention_mask.bool()
    L = real.shape[1]
    if bool(real.all()):
        return None, False
    positions = torch.arange(L, device=real.device)
    first = torch.where(real, positions, L).min(dim=1).values
    last = torch.where(real, positions, -1).max(dim=1).values
    count = real.sum(dim=1)
    if bool(((last - first + 1 != count) & (count > 0)).any()):
        raise ValueError("attention_mask has padding between real tokens in a row: pad only at the start "
                         "(tokenizer.padding_side = 'left', as for generation) or at the end of each row.")
    right = bool(((last < L - 1) & (count > 0)).any())
    return (first if bool((first > 0).any()) else None), right


class MegatronIDForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MegatronIDConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
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
        self._fusable = None   # whether the fused decode step can run this model (decided at first use)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False   # our forward builds its own RecurrentCache

    def _init_weights(self, module):
        pass   # weights always come from model.safetensors

    # gradient_checkpointing_enable() / activation_checkpointing_enable() set this flag (through
    # transformers' _set_gradient_checkpointing): it is the training model's own per-block
    # recomputation (train.activation_checkpointing)
    @property
    def gradient_checkpointing(self) -> bool:
        return self.model.activation_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enable: bool) -> None:
        self.model.activation_checkpointing = bool(enable)

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def resize_token_embeddings(self, *args, **kwargs):
        """transformers' resize, with the training config's vocab_size kept in step (it is what
        the bundled model and megatron-id import-hf read)."""
        out = super().resize_token_embeddings(*args, **kwargs)
        size = self.model.embed.weight.shape[0]
        self.config.model["vocab_size"] = self.config.vocab_size = size
        self.model.cfg.vocab_size = size
        return out

    def _fuses(self, input_ids, cache, length, use_cache, labels, output_hidden_states) -> bool:
        """Whether this call decodes on the fused step (inference/fused_decode.py, bundled): one
        new token per row after a prefill, no gradient, nothing but logits asked for, a model
        whose every layer keeps a fixed-size state (interdomain, S4D) in float32 or float64, and
        config.fused_decode (default true) left on. The step computes what the model's own
        forward computes (tests/test_hf_fused.py compares the two)."""
        if not (getattr(self.config, "fused_decode", True) and use_cache and cache is not None and length == 1
                and input_ids is not None and labels is None and not output_hidden_states
                and not torch.is_grad_enabled() and not self.training):
            return False
        if cache.fused is not None:
            return True
        if self._fusable is None:
            self._fusable = (fused_decode_refusal(self.model) is None
                             and all(block.mixer.decode_facts().fixed_size for block in self.model.layers))
        return self._fusable and all(p.dtype in (torch.float32, torch.float64) for p in self.model.parameters())

    def _fused_decode(self, input_ids, cache: RecurrentCache, start) -> CausalLMOutputWithPast:
        """The next logits of every row by the fused step; its first call loads each row's state
        (left padding: a row's positions count from its first real token, as in forward)."""
        fused = cache.fused
        if fused is None:
            rows = input_ids.shape[0]
            core = _cpp_core()
            if core is not None:   # the bundle's FusedDecoder looks its C++ core up here
                bundled.cpu_kernel = core
            fused = FusedDecoder(self.model, slots=rows, kernel="auto" if core is not None else "torch")
            for row in range(rows):
                state = _rows(cache.states, torch.tensor([row]))
                position = cache.seen_tokens - (int(start[row]) if start is not None else 0)
                fused.load(row, state, position)
        logits = fused.step(input_ids[:, 0])[:, None, :]
        return CausalLMOutputWithPast(logits=logits, **{CACHE_FIELD: RecurrentCache(None, cache.seen_tokens + 1, start,
                                                                                   fused)})

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, inputs_embeds=None, **kwargs):
        """Only the tokens the cache has not seen; inputs_embeds on the first call only."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen = cache.get_seq_length() if cache is not None else 0
        inputs = {"attention_mask": attention_mask, "use_cache": kwargs.get("use_cache"),
                  CACHE_FIELD: cache, "logits_to_keep": kwargs.get("logits_to_keep", 0) or 0}
        if inputs_embeds is not None and seen == 0:
            inputs.update(input_ids=None, inputs_embeds=inputs_embeds)
        else:
            embedded = inputs_embeds.shape[1] if inputs_embeds is not None else 0
            # with inputs_embeds, input_ids holds only the generated tokens: position seen - embedded
            inputs["input_ids"] = input_ids[:, seen - embedded:] if seen else input_ids
        return inputs

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask=None, labels=None,
                cache: RecurrentCache | None = None, use_cache: bool | None = None,
                prefill_chunk_size: int | None = None, logits_to_keep: int = 0,
                inputs_embeds: torch.Tensor | None = None, output_hidden_states: bool | None = None,
                past_key_values: RecurrentCache | None = None, **kwargs) -> CausalLMOutputWithPast:
        """logits_to_keep > 0 returns only the last positions' logits (generate() asks for 1), so
        a chunked prefill never holds the logits of the whole prompt.

        Padding (attention_mask): rows padded on the left run as if alone (each row's state and
        RoPE positions start at its first real token), so batched generation equals generating
        one prompt at a time. Rows padded on the right get the right logits at their real
        positions, but no cache (a recurrent state cannot forget padding it has absorbed)."""
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        inputs = input_ids if input_ids is not None else inputs_embeds
        length = inputs.shape[1]
        states, seen = (cache.states, cache.seen_tokens) if cache is not None else (None, 0)
        start, right_padded = (cache.start if cache is not None else None), False
        if attention_mask is not None:
            if attention_mask.shape[1] not in (length, seen + length):
                raise ValueError(f"attention_mask has {attention_mask.shape[1]} columns for {seen} cached and "
                                 f"{length} new tokens: give it {seen + length} (all tokens) or {length}.")
            new_start, right_padded = padding_of(attention_mask[:, -(seen + length):] if
                                                 attention_mask.shape[1] == seen + length else attention_mask)
            if attention_mask.shape[1] == seen + length:
                start = new_start
            elif new_start is not None:
                raise ValueError("left padding after the first call: pad only the prompt.")
        if self.model.activation_checkpointing and self.training and torch.is_grad_enabled() and use_cache is None:
            use_cache = False   # checkpointing recomputes full sequences; it keeps no state
        if right_padded:
            if use_cache:
                raise ValueError("use_cache=True with rows padded on the right: the state would absorb the "
                                 "padding. Pad on the left (tokenizer.padding_side = 'left') to generate, or "
                                 "pass use_cache=False to score.")
            use_cache = False
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else getattr(self.config, "output_hidden_states", False))
        fused = cache.fused if cache is not None else None
        if self._fuses(input_ids, cache, length, use_cache, labels, output_hidden_states):
            return self._fused_decode(input_ids, cache, start)
        if fused is not None:
            raise ValueError("this cache was advanced by the fused decode step (one token per call, no gradient, "
                             "no hidden states), and this call is not one: set model.config.fused_decode = False "
                             "before generating to keep the cache in the model's own form.")
        chunk = prefill_chunk_size or self.config.prefill_chunk_size
        step = chunk if use_cache and chunk else length
        pieces, hidden = [], []
        for offset in range(0, length, step):
            part = {"tokens": None if input_ids is None else input_ids[:, offset:offset + step],
                    "embeddings": None if inputs_embeds is None else inputs_embeds[:, offset:offset + step],
                    "start": start, "hidden_states": [] if output_hidden_states else None}
            if use_cache:
                logits, states = self.model(**part, states=states, return_states=True)
            else:
                logits = self.model(**part)
            pieces.append(logits)
            hidden.append(part["hidden_states"])
            if logits_to_keep:   # drop what can no longer be among the last positions
                pieces = [torch.cat(pieces, dim=1)[:, -logits_to_keep:]]
        logits = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        loss = None
        if labels is not None and logits.shape[1] != length:
            raise ValueError("labels need the logits of every position: leave logits_to_keep at 0.")
        if labels is not None:   # labels are the inputs (shifted here), -100 ignored: HF's convention
            targets = labels[:, 1:]
            if attention_mask is not None:
                # a padded position is no target, and predicts none: the first real token of a
                # left-padded row has no prediction, as when the row runs alone. So a padded
                # batch's loss is the token-weighted mean of its rows' own losses
                real = attention_mask[:, -length:].bool()
                targets = targets.masked_fill(~(real[:, 1:] & real[:, :-1]), -100)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   targets.reshape(-1), ignore_index=-100)
        hidden_states = None
        if output_hidden_states:   # per layer, the chunks joined along the sequence
            hidden_states = tuple(torch.cat(layer, dim=1) for layer in zip(*hidden))
        new_cache = RecurrentCache(states, seen + length, start) if use_cache else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden_states,
                                      **{CACHE_FIELD: new_cache})
