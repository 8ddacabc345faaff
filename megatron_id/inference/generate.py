"""Text generation with the training model itself, from a training checkpoint or an exported
folder, streaming tokens as they are produced.

    megatron-id generate --checkpoint runs/x/checkpoints --prompt "The water cycle" --max-new-tokens 50

The prompt is prefilled in chunks of --prefill-chunk-size tokens (memory bounded by the chunk),
then each new token is one decode step on the per-layer state: constant memory for the
interdomain and S4D-only mixers, a growing KV cache for softmax. Greedy by default;
--temperature > 0 samples (with --top-k). --device (default: cuda when available) holds the
model, the tokens and the sampler; --cuda-graph replays the decode step as a CUDA graph
(StaticDecodeStep; fixed-state models).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..checkpoint.read import read_checkpoint
from ..data.tokenizer import check_tokenizer_for_model, eod_id, find_tokenizer, load_tokenizer
from ..errors import BadOptionError
from ..hf.export import TOKENIZER_ID_KEY, read_hf_folder
from ..model import LanguageModel
from ..model.pattern import layer_letters
from .fused_decode import FusedDecoder


class Trained:
    """A model loaded for inference: the LanguageModel (eval mode, TP=1), its tokenizer, the
    end-of-document id, the model config and the checkpoint's client state (None for exports)."""

    def __init__(self, model, tokenizer, eod: int, cfg, client, tokenizer_path: Path, tokenizer_id: str):
        self.model, self.tokenizer, self.eod, self.cfg, self.client = model, tokenizer, eod, cfg, client
        self.tokenizer_path, self.tokenizer_id = tokenizer_path, tokenizer_id


def load_trained(source, tokenizer=None, allow_tokenizer_mismatch: bool = False, verify: str = "sample") -> Trained:
    """From a training checkpoint (root or iter folder, any layout) or an exported Hugging Face
    folder (it has config.json). The tokenizer (given, or the one recorded) is checked against
    the model before the weights are read: the identity recorded at training or export, and a
    vocabulary the embedding table holds. An export's files are checked against its manifest
    first (`verify`: "sample" or "full", hf/export.py verify_export); a training checkpoint's
    are checked whole, as always."""
    source = Path(source)
    client = None
    if (source / "config.json").is_file():
        _, cfg, weights = read_hf_folder(source, verify)
        recorded_path = source / "tokenizer.json"
        tokenizer = find_tokenizer(tokenizer, str(recorded_path), source)
        recorded = json.loads((source / "config.json").read_text()).get(TOKENIZER_ID_KEY)
    else:
        _, client, cfg, weights = read_checkpoint(source, also_export=True)
        recorded_path = client.tokenizer
        tokenizer = find_tokenizer(tokenizer, client.tokenizer, source)
        recorded = client.tokenizer_id
    tok = load_tokenizer(str(tokenizer))
    identity = check_tokenizer_for_model(tok, tokenizer, cfg.vocab_size, recorded, source,
                                         allow=allow_tokenizer_mismatch, recorded_path=recorded_path)
    model = LanguageModel(cfg, seed=None)
    model.load_state_dict(weights, strict=True)
    return Trained(model.eval(), tok, eod_id(tok), cfg, client, Path(tokenizer), identity)


def load_model_and_tokenizer(source, tokenizer=None, allow_tokenizer_mismatch: bool = False, verify: str = "sample"):
    """(LanguageModel in eval mode, tokenizers.Tokenizer, eos id): see load_trained."""
    trained = load_trained(source, tokenizer, allow_tokenizer_mismatch, verify)
    return trained.model, trained.tokenizer, trained.eod


def resolve_device(name: str) -> torch.device:
    """--device: "auto" (cuda when available), cpu, cuda or cuda:N, checked against this machine."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BadOptionError(f"--device {name!r} is not a device: give cpu, cuda or cuda:N.") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise BadOptionError(f"--device {name}: no CUDA device here; use --device cpu.")
        if device.index is not None and device.index >= count:
            raise BadOptionError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to "
                                 f"cuda:{count - 1}.")
    elif device.type != "cpu":
        raise BadOptionError(f"--device {name}: only cpu and cuda devices are supported.")
    return device


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


class StaticDecodeStep:
    """One decode step on fixed buffers: the token, its position, every layer's state and the
    logits live in tensors allocated once, and the step updates them in place, so the same
    memory serves every token and a CUDA graph can replay the step (`graph=True`: captured
    once with torch.cuda.CUDAGraph, then one replay per token: the paper's Appendix C decodes
    1.3B at batch 1 in 12.5 ms this way instead of 30). Without `graph` the same step runs
    eagerly (how the CPU tests check it against the dynamic decode).

    Only fixed-size states can be static: models of interdomain and S4D-only layers (a softmax
    layer's KV cache grows with every token: static_decode_refusal)."""

    def __init__(self, model: LanguageModel, states: list, position: int, graph: bool = False):
        why = static_decode_refusal(model.cfg)
        if why:
            raise BadOptionError(f"a static (CUDA graph) decode step needs fixed-size states: {why}; "
                                 f"decode it without --cuda-graph.")
        if graph and not next(model.parameters()).is_cuda:
            raise BadOptionError("--cuda-graph needs the model on a CUDA device (--device cuda).")
        self.model, self.graph = model, None
        device = next(model.parameters()).device
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.position = torch.full((1, 1), position, dtype=torch.long, device=device)
        self.states = [_static_copy(state) for state in states]
        self.logits = None
        if graph:
            # warm up on a side stream (first-call allocations and the decode tables), then capture
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            saved = ([_static_copy(s) for s in self.states], self.position.clone())
            with torch.cuda.stream(stream):
                self._step()
            torch.cuda.current_stream(device).wait_stream(stream)
            for state, before in zip(self.states, saved[0]):   # the warm-up step must not count
                _copy_into(state, before)
            self.position.copy_(saved[1])
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step()

    def _step(self) -> None:
        logits, fresh = self.model(self.token, states=self.states, return_states=True, position_ids=self.position)
        for state, new in zip(self.states, fresh):
            _copy_into(state, new)
        self.position.add_(1)
        if self.logits is None:
            self.logits = torch.empty_like(logits[0, -1])
        self.logits.copy_(logits[0, -1])

    def __call__(self, token: int) -> torch.Tensor:
        """The logits [V] after `token` (a view of the step's buffer: read it before the next call)."""
        self.token.fill_(token)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        return self.logits


def static_decode_refusal(cfg) -> str | None:
    """Why a model's decode state cannot live in fixed buffers (None: it can): softmax layers'
    KV caches grow with every token (A), or until they hold their window (W)."""
    letters = layer_letters(cfg)
    if "A" in letters:
        return "its softmax layers' KV cache grows with every token"
    if "W" in letters:
        return "its sliding-window layers' KV cache grows until it holds the window"
    return None


def _static_copy(state):
    """A fresh copy of a layer's state: its tensors cloned (the buffers the static step owns),
    the parameter-only decode tables shared, integers kept."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: (v if k == "tables" else _static_copy(v)) for k, v in state.items()}
    return state


def _copy_into(state, new) -> None:
    """Write a step's new state into the static buffers (same shapes: fixed-size states). The
    decode tables need no copy: the mixer keeps them in the very state dict it was given."""
    for key, value in new.items():
        if isinstance(value, torch.Tensor):
            state[key].copy_(value)
        elif isinstance(value, dict) and key != "tables":
            _copy_into(state[key], value)


DECODES = ("eager", "static", "graph", "fused")


def prefill(model: LanguageModel, prompt: list[int], chunk_size: int):
    """(logits [1, 1, V] at the prompt's last token, every layer's state) after `prompt`, run in
    chunks of `chunk_size` tokens (memory bounded by the chunk; the LM head runs on the last
    position only: at a 50K vocabulary it was most of a prefill's time and memory)."""
    tokens, states = torch.tensor([prompt], device=next(model.parameters()).device), None
    for start in range(0, tokens.shape[1], chunk_size):
        hidden, states = model(tokens[:, start:start + chunk_size], states=states, return_states=True,
                               return_hidden=True)
    return model.lm_head(hidden[:, -1:]), states


GREEDY_BELOW = 1e-5   # temperatures below this draw greedily (logits / 1e-40 overflow to inf, softmax to NaN)


def sample(logits: torch.Tensor, temperature: float, top_k: int, generator, top_p: float = 1.0,
           min_p: float = 0.0) -> int:
    """The next token from logits [V]: greedy at temperature 0 (and below GREEDY_BELOW, where
    the distribution is the argmax's to float precision; vLLM draws the same line), else
    softmax(logits / temperature) over the top_k largest (0: all), then, when below 1 / above 0,
    only the smallest set of likeliest tokens whose probability reaches top_p and the tokens of at
    least min_p x the likeliest's probability, drawn with `generator`."""
    logits = logits.float()
    if temperature < GREEDY_BELOW:
        return int(logits.argmax())
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        before = ordered.cumsum(0) - ordered   # the probability of the likelier tokens
        probs[order[before >= top_p]] = 0.0   # (the likeliest always stays)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters beyond temperature and top_k (OpenAI's and vLLM's), neutral by
    default: logit_bias {token id: added to its logit}; repetition_penalty (vLLM's and
    transformers': a seen token's logit divided by it when positive, multiplied when negative;
    prompt and output), frequency_penalty (subtracted once per time a token was generated) and
    presence_penalty (once if it was); then, when sampling, top_p (the smallest set of likeliest
    tokens whose probability reaches it) and min_p (tokens at least min_p x the likeliest's
    probability). Greedy (temperature 0) takes the argmax after the bias and the penalties."""
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = ()   # ((token id, bias), ...)


NEUTRAL_SAMPLING = Sampling()


def sample_with(logits: torch.Tensor, temperature: float, top_k: int, generator, sampling: Sampling,
                prompt: list[int], output: list[int]) -> int:
    """`sample` after `sampling`'s logit_bias and penalties (vLLM's order: bias, penalties,
    temperature, top_k, top_p, min_p); with neutral ones, exactly `sample`. prompt / output: the
    sequence's tokens so far, for the penalties."""
    if sampling.logit_bias or sampling.repetition_penalty != 1.0 or sampling.frequency_penalty or \
            sampling.presence_penalty:
        logits = logits.float().clone()
        for token, bias in sampling.logit_bias:
            logits[token] += bias
        if sampling.repetition_penalty != 1.0 and (prompt or output):
            seen = torch.tensor(sorted(set(prompt) | set(output)), device=logits.device)
            values = logits[seen]
            penalty = sampling.repetition_penalty
            logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if output and (sampling.frequency_penalty or sampling.presence_penalty):
            counts = torch.bincount(torch.tensor(output, device=logits.device),
                                    minlength=logits.numel())[:logits.numel()]
            logits -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0)
    return sample(logits, temperature, top_k, generator, sampling.top_p, sampling.min_p)


@torch.no_grad()
def generate_ids(model: LanguageModel, prompt: list[int], max_new_tokens: int, *, eos_id: int | None = None,
                 temperature: float = 0.0, top_k: int = 0, prefill_chunk_size: int = 2048,
                 generator: torch.Generator | None = None, decode: str = "eager") -> Iterator[int]:
    """Yield new token ids one at a time. Everything runs on the model's device (the sampler's
    `generator` must be on it too). decode: "eager" (a model call per token), "static" (fixed
    buffers updated in place: StaticDecodeStep), "graph" (that step under a CUDA graph) or
    "fused" (fused_decode.py: every layer's step in few ops on preallocated buffers)."""
    if not prompt:
        raise BadOptionError("the prompt is empty (no tokens): give a prompt with some text.")
    if decode not in DECODES:
        raise BadOptionError(f"decode={decode!r}: expected one of {', '.join(DECODES)}.")
    check_options(max_new_tokens, temperature, top_k, prefill_chunk_size)
    device = next(model.parameters()).device
    logits, states = prefill(model, prompt, prefill_chunk_size)
    last = logits[0, -1]
    step = None
    if decode == "fused":
        fused = FusedDecoder(model, slots=1, capacity=len(prompt) + max(max_new_tokens, 1))
        fused.load(0, states, len(prompt))
        step = lambda token: fused.step(torch.tensor([token], device=device))[0]   # noqa: E731
    elif decode != "eager":
        step = StaticDecodeStep(model, states, len(prompt), graph=decode == "graph")
    for _ in range(max_new_tokens):
        token = sample(last, temperature, top_k, generator)
        yield token
        if token == eos_id:
            return
        if step is None:
            logits, states = model(torch.tensor([[token]], device=device), states=states, return_states=True)
            last = logits[0, -1]
        else:
            last = step(token)


def stream_text(tokenizer, ids: Iterator[int], out=None) -> list[int]:
    """Print the text of `ids` as it grows (whole characters only) to `out` (default: sys.stdout as
    it is when called, not when this module was imported) and return the ids."""
    out = sys.stdout if out is None else out
    done, printed = [], ""
    for token in ids:
        done.append(token)
        text = tokenizer.decode(done)
        if not text.endswith("\ufffd"):   # wait for the rest of a multi-byte character
            out.write(text[len(printed):])
            out.flush()
            printed = text
    return done
