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

from .errors import BadOptionError
from .model import LanguageModel


class Trained:
    """A model loaded for inference: the LanguageModel (eval mode, TP=1), its tokenizer, the
    end-of-document id, the model config and the checkpoint's client state (None for exports)."""

    def __init__(self, model, tokenizer, eod: int, cfg, client, tokenizer_path: Path):
        self.model, self.tokenizer, self.eod, self.cfg, self.client = model, tokenizer, eod, cfg, client
        self.tokenizer_path = tokenizer_path


def load_trained(source, tokenizer=None) -> Trained:
    """From a training checkpoint (root or iter folder, any layout) or an exported Hugging Face
    folder (it has config.json)."""
    from .checkpoint.read import read_checkpoint
    from .data.tokenizer import eod_id, find_tokenizer, load_tokenizer
    from .hf.export import read_hf_folder
    source = Path(source)
    client = None
    if (source / "config.json").is_file():
        _, cfg, weights = read_hf_folder(source)
        tokenizer = find_tokenizer(tokenizer, str(source / "tokenizer.json"), source)
    else:
        _, client, cfg, weights = read_checkpoint(source, also_export=True)
        tokenizer = find_tokenizer(tokenizer, client.tokenizer, source)
    model = LanguageModel(cfg, seed=None)
    model.load_state_dict(weights, strict=True)
    tok = load_tokenizer(str(tokenizer))
    return Trained(model.eval(), tok, eod_id(tok), cfg, client, Path(tokenizer))


def load_model_and_tokenizer(source, tokenizer=None):
    """(LanguageModel in eval mode, tokenizers.Tokenizer, eos id): see load_trained."""
    trained = load_trained(source, tokenizer)
    return trained.model, trained.tokenizer, trained.eod


def check_options(max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                  prefill_chunk_size: int = 2048) -> None:
    """Refuse values that would silently generate nothing or fail deep inside the model."""
    rules = [("--max-new-tokens", max_new_tokens, max_new_tokens >= 0, "at least 0 (tokens to generate)"),
             ("--temperature", temperature, temperature >= 0, "at least 0 (0: greedy)"),
             ("--top-k", top_k, top_k >= 0, "at least 0 (0: no top-k filter)"),
             ("--prefill-chunk-size", prefill_chunk_size, prefill_chunk_size >= 1,
              "at least 1 (tokens per prefill chunk; default 2048)")]
    for option, value, ok, rule in rules:
        if not ok:   # (a NaN temperature fails its comparison too)
            raise BadOptionError(f"{option} {value} is invalid: it must be {rule}.")


@torch.no_grad()
def generate_ids(model: LanguageModel, prompt: list[int], max_new_tokens: int, *, eos_id: int | None = None,
                 temperature: float = 0.0, top_k: int = 0, prefill_chunk_size: int = 2048,
                 generator: torch.Generator | None = None) -> Iterator[int]:
    """Yield new token ids one at a time."""
    if not prompt:
        raise BadOptionError("the prompt is empty (no tokens): give a prompt with some text.")
    check_options(max_new_tokens, temperature, top_k, prefill_chunk_size)
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
