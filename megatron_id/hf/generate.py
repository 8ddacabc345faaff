"""Text generation with the training model itself, from a training checkpoint or an exported
folder, streaming tokens as they are produced.

    megatron-id generate --checkpoint runs/x/checkpoints --prompt "The water cycle" --max-new-tokens 50

The prompt is prefilled in chunks of --prefill-chunk-size tokens (memory bounded by the chunk),
then each new token is one decode step on the per-layer state: constant memory for the
interdomain and S4D-only mixers, a growing KV cache for softmax. Greedy by default;
--temperature > 0 samples (with --top-k).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import torch

from ..model import LanguageModel


def load_model_and_tokenizer(source, tokenizer=None):
    """(LanguageModel in eval mode, tokenizers.Tokenizer, eos id) from a training checkpoint
    (root or iter folder) or an exported Hugging Face folder."""
    from data_tools.tokenizer import eod_id, load_tokenizer
    from .export import read_checkpoint, read_hf_folder
    source = Path(source)
    if (source / "config.json").is_file() and (source / "model.safetensors").is_file():
        _, cfg, weights = read_hf_folder(source)
        tokenizer = tokenizer or source / "tokenizer.json"
    else:
        _, client, cfg, weights = read_checkpoint(source)
        tokenizer = tokenizer or client.get("tokenizer")
    if not tokenizer or not Path(tokenizer).is_file():
        raise FileNotFoundError(f"tokenizer {tokenizer!r} not found: pass --tokenizer path/to/tokenizer.json.")
    model = LanguageModel(cfg, seed=None)
    model.load_state_dict(weights, strict=True)
    tok = load_tokenizer(str(tokenizer))
    return model.eval(), tok, eod_id(tok)


@torch.no_grad()
def generate_ids(model: LanguageModel, prompt: list[int], max_new_tokens: int, *, eos_id: int | None = None,
                 temperature: float = 0.0, top_k: int = 0, prefill_chunk_size: int = 2048,
                 generator: torch.Generator | None = None) -> Iterator[int]:
    """Yield new token ids one at a time."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token.")
    tokens, states = torch.tensor([prompt]), None
    for start in range(0, tokens.shape[1], prefill_chunk_size):
        logits, states = model(tokens[:, start:start + prefill_chunk_size], states=states, return_states=True)
    for _ in range(max_new_tokens):
        last = logits[0, -1].float()
        if temperature > 0:
            if top_k > 0:
                kth = torch.topk(last, min(top_k, last.numel())).values[-1]
                last = last.masked_fill(last < kth, float("-inf"))
            token = int(torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=generator))
        else:
            token = int(last.argmax())
        yield token
        if token == eos_id:
            return
        logits, states = model(torch.tensor([[token]]), states=states, return_states=True)


def stream_text(tokenizer, ids: Iterator[int], out=sys.stdout) -> list[int]:
    """Print the text of `ids` as it grows (whole characters only) and return the ids."""
    done, printed = [], ""
    for token in ids:
        done.append(token)
        text = tokenizer.decode(done)
        if not text.endswith("\ufffd"):   # wait for the rest of a multi-byte character
            out.write(text[len(printed):])
            out.flush()
            printed = text
    return done
