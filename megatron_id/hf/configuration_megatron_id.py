"""Hugging Face configuration of an exported megatron_id model (standalone: transformers only).

`model` holds the training config's `model` section verbatim (megatron_id/config.py); the
standard names (vocab_size, hidden_size, ...) are derived from it for tools that read them.
`prefill_chunk_size` bounds prefill memory: longer prompts run through the model in chunks of
this many tokens, carrying the recurrent state (or KV cache) from chunk to chunk.
"""
from transformers import PretrainedConfig

# what each letter of model.layer_pattern (model/pattern.py) is called in `layer_types`, the
# per-layer list transformers' hybrid configs (Qwen3-Next, LFM2) carry and vLLM reads to size
# its KV cache: interdomain and S4D-only layers keep a fixed-size state, as linear attention does
LAYER_TYPES = {"I": "linear_attention", "S": "linear_attention", "A": "full_attention", "W": "sliding_attention"}
UNIFORM_LETTERS = {"interdomain": "I", "s4d": "S", "softmax": "A"}


class MegatronIDConfig(PretrainedConfig):
    model_type = "megatron_id"

    def __init__(self, model: dict | None = None, prefill_chunk_size: int = 2048, **kwargs):
        self.model = dict(model or {})
        self.prefill_chunk_size = prefill_chunk_size
        self.use_cache = kwargs.pop("use_cache", True)
        m = self.model
        self.vocab_size = m.get("vocab_size")
        self.hidden_size = m.get("d_model")
        self.num_hidden_layers = m.get("n_layers")
        self.num_attention_heads = m.get("n_heads")
        # the key/value heads of softmax layers (model.n_kv_heads; unset: n_heads, no GQA)
        self.num_key_value_heads = m.get("n_kv_heads") or m.get("n_heads")
        # one entry per layer (derived, as the names above; layer_pattern without its stage marks),
        # only where every layer is of a known kind: transformers refuses a list of another length
        # or with another name in it (a mixer added after this file, docs/adding-a-mixer.md)
        letters = (m.get("layer_pattern") or "").replace("|", "") or \
            UNIFORM_LETTERS.get(m.get("mixer"), "?") * (m.get("n_layers") or 0)
        kwargs.pop("layer_types", None)   # (written by to_dict: always derived again)
        if letters and len(letters) == m.get("n_layers") and set(letters) <= set(LAYER_TYPES):
            self.layer_types = [LAYER_TYPES[letter] for letter in letters]
        kwargs.setdefault("tie_word_embeddings", bool(m.get("tie_embeddings", False)))
        super().__init__(**kwargs)
