"""Prefix caching of the model's state for `megatron-id serve` (issue 55): a prompt that begins
with a prefix read before (a system prompt, few-shot examples, lm-eval's shared contexts) starts
from the state saved after that prefix instead of reading it again.

A fixed-state model's state after a prefix is the same size at any length (interdomain and S4D
layers: the complex S4D state and the short convs' tails; softmax layers of a hybrid add their
KV cache, which grows with the prefix), so an entry costs the same for a 50-token prefix as for a
50,000-token one: 9.4 MB at the 125M width (12 layers x 12 heads x M 64 x 128 complex64), 1 MB
for serve_vllm.py's d 256 x 4 model. vLLM caches a state at every block of every prompt; at
this cost a cache of that kind fills with states nobody asks for again. Ours [our choice]:

- prefixes are cut at whole blocks of `block` tokens (the model's chunk size: the chunked form's
  own boundaries, so a read split there computes what one read does); a chain of hashes names
  each block boundary of a prompt;
- every boundary a prompt passes is remembered (a key, 16 bytes); a prompt that passes a
  boundary remembered from an earlier prompt shares that prefix with it, and the state there is
  saved while the prompt is read (its read is split at that one boundary): a state is kept only
  for a prefix seen twice, and only its longest shared block boundary;
- a prompt starts from the longest saved boundary it begins with (at least one token is always
  read: the first generated token needs the last prompt position's logits);
- entries are bounded in bytes and evicted least recently used.

It hits at any block boundary (vLLM's hybrid caching misses prompts under its 528-token block,
vLLM #40696). Reading the prompt from a saved state gives the tokens reading it whole gives
(tested)."""
from __future__ import annotations

import array
import hashlib
import threading
from collections import OrderedDict

import torch

MAX_REMEMBERED = 200_000   # block boundaries remembered (16-byte keys), least recently seen forgotten


def map_state(value, fn):
    """A model state (lists and dicts of tensors, as model(..., return_states=True) gives them)
    with fn applied to each tensor; "tables", parameter-only, left out (None: rebuilt when needed)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: (None if k == "tables" else map_state(v, fn)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_state(v, fn) for v in value)
    return value


def clone_state(value):
    """A deep copy of a model state (map_state)."""
    return map_state(value, torch.Tensor.clone)


def state_bytes(value) -> int:
    """The bytes of a model state's tensors ("tables" not counted: map_state)."""
    sizes = []
    map_state(value, lambda t: sizes.append(t.numel() * t.element_size()))
    return sum(sizes)


class PrefixCache:
    """The states after shared prompt prefixes (see the module's text). Thread-safe: the prefill
    thread reads and writes it, the HTTP side reads its counters."""

    def __init__(self, block: int, max_bytes: int):
        if block < 1 or max_bytes < 0:
            raise ValueError(f"prefix cache: block {block} (at least 1), max_bytes {max_bytes} (at least 0)")
        self.block, self.max_bytes = block, max_bytes
        self.entries: OrderedDict[bytes, tuple[list, int]] = OrderedDict()   # key -> (states, bytes)
        self.remembered: OrderedDict[bytes, None] = OrderedDict()
        self.bytes = self.hits = self.misses = self.tokens_saved = 0
        self.lock = threading.Lock()

    def boundaries(self, prompt: list[int]) -> list[tuple[int, bytes]]:
        """(length, key) of each whole-block prefix of `prompt` shorter than the prompt."""
        out, digest = [], hashlib.blake2b(digest_size=16)
        for end in range(self.block, len(prompt), self.block):
            digest.update(array.array("q", prompt[end - self.block:end]).tobytes())
            out.append((end, digest.copy().digest()))
        return out

    def plan(self, prompt: list[int]) -> tuple[int, list | None, tuple[int, bytes] | None]:
        """(tokens to skip, the saved state there or None, the boundary whose state to save
        while reading the rest or None); remembers the prompt's boundaries."""
        marks = self.boundaries(prompt)
        with self.lock:
            start, states = 0, None
            for end, key in reversed(marks):
                if key in self.entries:
                    self.entries.move_to_end(key)
                    start, states = end, clone_state(self.entries[key][0])
                    break
            save = None
            for end, key in reversed(marks):   # the longest boundary an earlier prompt passed, not saved yet
                if end <= start:
                    break
                if key in self.remembered and key not in self.entries:
                    save = (end, key)
                    break
            for _, key in marks:
                self.remembered[key] = None
                self.remembered.move_to_end(key)
            while len(self.remembered) > MAX_REMEMBERED:
                self.remembered.popitem(last=False)
            if start:
                self.hits += 1
                self.tokens_saved += start
            else:
                self.misses += 1
        return start, states, save

    def put(self, key: bytes, states: list) -> None:
        size = state_bytes(states)
        if size > self.max_bytes:
            return
        states = clone_state(states)
        with self.lock:
            if key in self.entries:
                return
            self.entries[key] = (states, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, evicted) = self.entries.popitem(last=False)
                self.bytes -= evicted

    def counters(self) -> dict:
        with self.lock:
            return {"entries": len(self.entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "block": self.block, "hits": self.hits, "misses": self.misses, "tokens_saved": self.tokens_saved}


def prefill_cached(model, prompt: list[int], chunk_size: int, cache: PrefixCache | None, plan=None):
    """generate.prefill through the cache: from the longest saved prefix, the rest read in chunks
    of `chunk_size`, split once more where a shared prefix's state is to be saved. Returns
    (logits at the last token, the states after the prompt). plan: cache.plan(prompt), if the
    caller made it already."""
    from .generate import prefill
    if cache is None:
        return prefill(model, prompt, chunk_size)
    start, states, save = plan if plan is not None else cache.plan(prompt)
    tokens = torch.tensor([prompt], device=next(model.parameters()).device)
    position = start
    while position < len(prompt):
        end = min(position + chunk_size, len(prompt))
        if save is not None and position < save[0] < end:
            end = save[0]
        hidden, states = model(tokens[:, position:end], states=states, return_states=True, return_hidden=True)
        if save is not None and end == save[0]:
            cache.put(save[1], states)
        position = end
    return model.lm_head(hidden[:, -1:]), states
