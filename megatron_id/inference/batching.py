"""Continuous batching over the fused decode step's slots: sequences join the running batch as
slots free up and leave it at the token that ends them (end of document, their token budget),
so a long completion never holds the short ones back (Orca's iteration-level scheduling, Yu et
al. 2022, as vLLM and Megatron-LM's inference engine do it; here over constant-size state slots).

    batcher = ContinuousBatcher(model, slots=8, capacity=4096)
    ids = [batcher.submit(Request(prompt, max_new_tokens=50)) for prompt in prompts]
    while batcher.busy():
        for event in batcher.step():      # (sequence, token, finished) per slot that advanced
            ...

Each sequence samples with its own generator (seeded by its request), so its tokens do not
depend on what else shares the batch: greedy completions equal `generate_ids` one at a time, and
so do sampled ones for the same seed. The prompt is prefilled alone, in chunks (the model's own
chunked forward), when the sequence takes a slot.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from ..errors import BadOptionError
from .fused_decode import FusedDecoder
from .generate import prefill, sample


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    eos_id: int | None = None
    name: str = ""          # how logs name it (the server's completion id)


@dataclass
class Sequence:
    request: Request
    id: int
    tokens: list[int] = field(default_factory=list)    # generated so far
    finish_reason: str | None = None                    # "stop" (end of document), "length", "cancelled", "error"
    slot: int | None = None
    cancelled: bool = False
    error: BaseException | None = None                  # what failed it (finish_reason "error")


class ContinuousBatcher:
    def __init__(self, model, slots: int, capacity: int | None = None, prefill_chunk_size: int = 2048,
                 compile: bool = False):
        self.model, self.prefill_chunk_size = model, prefill_chunk_size
        self.device = next(model.parameters()).device
        self.decoder = FusedDecoder(model, slots=slots, capacity=capacity, compile=compile)
        self.capacity = capacity if self.decoder.unbounded else None
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}              # slot -> sequence
        self.generators: dict[int, torch.Generator] = {}
        self.next_token = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._ids = itertools.count()
        self.failed_decodes = 0   # decode steps in a row that failed (the server stops past a few)

    def check(self, request: Request) -> None:
        """Refuse what could never be served (before it is queued)."""
        if not request.prompt:
            raise BadOptionError("the prompt is empty (no tokens): give a prompt with some text.")
        if request.max_new_tokens < 1:
            raise BadOptionError(f"max_tokens {request.max_new_tokens}: at least 1.")
        if not request.temperature >= 0 or request.top_k < 0:   # (a NaN temperature fails the comparison)
            raise BadOptionError(f"temperature {request.temperature}, top_k {request.top_k}: both at least 0.")
        if not 0 <= request.seed < 2**64:
            raise BadOptionError(f"seed {request.seed}: from 0 to 2^64 - 1 (torch.Generator's range).")
        if self.capacity is not None and len(request.prompt) + request.max_new_tokens > self.capacity:
            raise BadOptionError(f"the prompt's {len(request.prompt)} tokens and max_tokens "
                                 f"{request.max_new_tokens} exceed this model's {self.capacity}-token KV cache: "
                                 f"ask for fewer tokens.")

    def submit(self, request: Request) -> Sequence:
        self.check(request)
        sequence = Sequence(request, next(self._ids))
        self.waiting.append(sequence)
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """Stop a sequence (its client went away); its slot frees at the next step."""
        sequence.cancelled = True

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, sequence: Sequence, reason: str) -> None:
        """The sequence leaves; the last running one moves into its slot, so that the running
        sequences stay in slots 0..n-1 and a step computes only those."""
        sequence.finish_reason = reason
        slot, last = sequence.slot, len(self.running) - 1
        del self.running[slot]
        self.generators.pop(sequence.id, None)
        if slot != last:
            moved = self.running.pop(last)
            self.decoder.move(last, slot)
            self.next_token[slot] = self.next_token[last]
            moved.slot = slot
            self.running[slot] = moved
        self.decoder.clear(last)

    def _emit(self, sequence: Sequence, token: int, events: list) -> None:
        sequence.tokens.append(token)
        request = sequence.request
        if token == request.eos_id:
            self._finish(sequence, "stop")
        elif len(sequence.tokens) >= request.max_new_tokens:
            self._finish(sequence, "length")
        else:
            self.next_token[sequence.slot] = token
        events.append((sequence, token, sequence.finish_reason is not None))

    def _fail(self, sequence: Sequence, error: BaseException, events: list) -> None:
        """This sequence ends with finish_reason "error" (its slot freed, the others untouched)."""
        sequence.error = error
        if sequence.slot is not None and self.running.get(sequence.slot) is sequence:
            self._finish(sequence, "error")
        else:   # failed while being admitted: its slot may hold part of its state
            if sequence.slot is not None:
                self.decoder.clear(sequence.slot)
            sequence.finish_reason = "error"
            self.generators.pop(sequence.id, None)
        events.append((sequence, None, True))

    @torch.no_grad()
    def _admit(self, sequence: Sequence, slot: int, events: list) -> None:
        request = sequence.request
        logits, states = prefill(self.model, request.prompt, self.prefill_chunk_size)
        sequence.slot = slot
        self.decoder.load(slot, states, len(request.prompt))
        self.running[slot] = sequence
        generator = None
        if request.temperature > 0:
            generator = self.generators[sequence.id] = torch.Generator(device=self.device).manual_seed(request.seed)
        self._emit(sequence, sample(logits[0, -1], request.temperature, request.top_k, generator), events)

    def step(self) -> list:
        """Admit waiting sequences into free slots (each yields its first token from its
        prefill), then one decode step for every running one. Returns (sequence, token,
        finished) events in the order they happened; token None with finish_reason "error" for
        a sequence that failed. A failure fails only the sequences it touched: a prefill or a
        draw its own sequence, the shared decode step every running one; the batcher goes on."""
        events = []
        for sequence in [s for s in self.running.values() if s.cancelled]:
            self._finish(sequence, "cancelled")
        while self.waiting and len(self.running) < self.decoder.slots:
            sequence = self.waiting.popleft()
            if sequence.cancelled:
                sequence.finish_reason = "cancelled"
                continue
            try:
                self._admit(sequence, len(self.running), events)
            except Exception as error:
                self._fail(sequence, error, events)
        if not self.running:
            return events
        try:
            logits = self.decoder.step(self.next_token[:len(self.running)])
        except Exception as error:
            self.failed_decodes += 1
            for sequence in list(self.running.values()):
                self._fail(sequence, error, events)
            return events
        self.failed_decodes = 0
        for slot, sequence in sorted(self.running.items()):   # (a finishing one moves another: by object)
            if sequence.cancelled:
                continue
            request = sequence.request
            try:
                token = sample(logits[slot], request.temperature, request.top_k, self.generators.get(sequence.id))
            except Exception as error:
                self._fail(sequence, error, events)
                continue
            self._emit(sequence, token, events)
        return events


def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, *, slots: int = 8, eos_id=None,
                   temperature: float = 0.0, top_k: int = 0, seed: int = 0, prefill_chunk_size: int = 2048,
                   on_finish=None) -> list[list[int]]:
    """Every prompt's completion (token ids, in the prompts' order), `slots` at a time with
    continuous batching; prompt i samples with seed + i. on_finish(index, tokens) is called as
    each completes (in completion order)."""
    capacity = max(len(p) for p in prompts) + max_new_tokens
    batcher = ContinuousBatcher(model, slots=min(slots, len(prompts)), capacity=capacity,
                                prefill_chunk_size=prefill_chunk_size)
    requests = [Request(p, max_new_tokens, temperature, top_k, seed + i, eos_id) for i, p in enumerate(prompts)]
    for r in requests:
        batcher.check(r)
    sequences = [batcher.submit(r) for r in requests]
    order = {s.id: i for i, s in enumerate(sequences)}
    while batcher.busy():
        for sequence, _, finished in batcher.step():
            if sequence.error is not None:   # (the batcher goes on; a batch of prompts stops, naming it)
                raise sequence.error
            if finished and on_finish is not None:
                on_finish(order[sequence.id], sequence.tokens)
    return [s.tokens for s in sequences]
