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
chunked forward), before the sequence takes a slot: on the batcher's thread between steps, or
(prefill_thread=True, the server) on a thread of its own, beside the decode steps.
"""
from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from ..errors import BadOptionError
from .fused_decode import FusedDecoder
from .generate import NEUTRAL_SAMPLING, Sampling, sample_with
from .prefix_cache import map_state, prefill_cached


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    eos_id: int | None = None
    name: str = ""          # how logs name it (the server's completion id)
    ignore_eos: bool = False   # the server gives it no eos_id (vLLM's ignore_eos: it runs to max_new_tokens)
    sampling: Sampling = NEUTRAL_SAMPLING   # top_p, min_p, penalties, logit_bias (generate.py)
    logprobs: int | None = None   # score each token: its log-probability and this many likeliest (Sequence.scored)


@dataclass
class Sequence:
    request: Request
    id: int
    tokens: list[int] = field(default_factory=list)    # generated so far
    finish_reason: str | None = None                    # "stop" (end of document), "length", "cancelled", "error"
    slot: int | None = None
    cancelled: bool = False
    error: BaseException | None = None                  # what failed it (finish_reason "error")
    reading: bool = False                               # its prompt is with the prefill thread
    scored: list = field(default_factory=list)          # with request.logprobs: token_scores(...) per token


class ToRead:
    """The prompts handed to be read, oldest first: the prefill thread waits on it, the
    batcher's thread puts to it and, while nothing decodes, takes from it too. None: the
    closing mark."""
    NOTHING = object()

    def __init__(self):
        self._items: deque = deque()
        self._ready = threading.Condition()

    def put(self, *items) -> None:
        if items:
            with self._ready:
                self._items.extend(items)
                self._ready.notify()

    def get(self):
        with self._ready:
            while not self._items:
                self._ready.wait()
            return self._items.popleft()

    def take_first(self, fits):
        """The first item if fits(it), else NOTHING (also when none waits); never waits."""
        with self._ready:
            if self._items and fits(self._items[0]):
                return self._items.popleft()
            return ToRead.NOTHING


# [our choice] the most prompt tokens the batcher's thread reads at a time when nothing decodes
# (_read_while_idle): 8 prompts of ~128 tokens, ~0.2 s on one core of the d 256 x 4 benchmark model
IDLE_READ_TOKENS = 1024


class ContinuousBatcher:
    """prefill_thread [our choice, measured; the server's default]: prompts are read on a thread
    of their own, oldest first, while the batcher's thread goes on decoding the running
    sequences; a prompt read whole takes a free slot at the next step and yields its first token.
    On a CPU the two share the cores (torch ops release the GIL): 8 streams of the d 256 x 4
    benchmark model decode at 13.9 ms per step (p99 18.3) while 1,024-token prompts are read
    beside them, against 12.5 ms alone (1 torch thread each, idle 2-core machine); read between
    steps instead, every 1,024-token prompt stalled all streams ~170 ms, and read in chunks of
    ~120 tokens per step, a chunk cost ~94 ms against a ~20 ms decode step (both measured on a
    loaded machine). On CUDA the prefill runs on its own stream.
    idle_reads [our choice, measured; the server's default]: while nothing decodes, this thread
    reads waiting prompts too (_read_while_idle): 64 clients' first tokens came 1.5x sooner than
    with the prefill thread alone (benchmarks/serve_load.py, docs/inference.md).
    Without it (a batch of prompts, generate --input-file), waiting prompts are read whole on the
    batcher's thread when a slot frees (Sarathi-Serve's stall-free batching, Agrawal et al. 2024,
    is the GPU engines' answer to the same stall, by a token budget per step)."""

    def __init__(self, model, slots: int, capacity: int | None = None, prefill_chunk_size: int = 2048,
                 compile: bool = False, prefill_thread: bool = False, prefix_cache=None, prefill_batch: int = 1,
                 idle_reads: bool = False):
        self.model, self.prefill_chunk_size = model, prefill_chunk_size
        self.prefix_cache = prefix_cache   # inference/prefix_cache.py (megatron-id serve), or None
        # prompts the prefill thread reads in one call (read_together), where every layer keeps a
        # fixed-size state (a softmax layer's KV cache of a left-padded row is not one the decoder loads)
        self.prefill_batch = prefill_batch if all(
            hasattr(block.mixer, "decode_facts") and block.mixer.decode_facts().fixed_size
            for block in model.layers) else 1
        self.batched_reads = 0    # calls that read more than one prompt (a test's and a benchmark's count)
        self.idle_reads = 0       # prompts this thread read while nothing decoded (_read_while_idle)
        self.device = next(model.parameters()).device
        self.decoder = FusedDecoder(model, slots=slots, capacity=capacity, compile=compile)
        self.capacity = capacity if self.decoder.unbounded else None
        self.waiting: deque[Sequence] = deque()             # not yet in a slot, oldest first
        self.running: dict[int, Sequence] = {}              # slot -> sequence
        self.generators: dict[int, torch.Generator] = {}
        self.next_token = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._ids = itertools.count()
        self.failed_decodes = 0   # decode steps in a row that failed (the server stops past a few)
        self.reading = 0          # prompts with the prefill thread
        self._reader, self._idle_reader = None, False
        if prefill_thread:
            self._to_read = ToRead()
            self._read: queue.Queue = queue.Queue()
            self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            # idle_reads on a CPU only (a GPU reads on its own stream: this thread would queue behind it)
            self._idle_reader = idle_reads and self._stream is None
            self._reader = threading.Thread(target=self._read_prompts, name="megatron-id-prefill", daemon=True)
            self._reader.start()

    def close(self) -> None:
        """Stop the prefill thread (if any)."""
        if self._reader is not None:
            self._to_read.put(None)
            self._reader.join(timeout=60)
            self._reader = None

    def _read_prompts(self) -> None:
        """The prefill thread: (sequence, logits, states, error) for each prompt handed to it."""
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        while True:
            sequence = self._to_read.get()
            if sequence is None:
                return
            taken, closing = self._take_waiting([sequence], self.prefill_batch)
            self._read_taken(taken, stream)
            if closing:
                return

    def _take_waiting(self, taken: list, most: int, budget: int | None = None) -> tuple[list, bool]:
        """`taken` and whatever else waits to be read, oldest first, up to `most` prompts (with
        `budget`: while their tokens stay within it, and never the closing mark, which is the
        prefill thread's); True once the closing mark was taken."""
        tokens = sum(len(s.request.prompt) for s in taken)
        while len(taken) < most:
            # (looked at before it is taken: a prompt over the budget stays first in line)
            more = self._to_read.take_first(lambda s: budget is None or s is not None and
                                            tokens + len(s.request.prompt) <= budget)
            if more is ToRead.NOTHING:
                break
            if more is None:
                return taken, True
            taken.append(more)
            tokens += len(more.request.prompt)
        return taken, False

    def _read_taken(self, taken: list, stream=contextlib.nullcontext()) -> None:
        """Read the prompts `taken` from the queue (the fixed-state ones of a similar length
        together, the others alone) and hand each result to the batcher's thread."""
        alone, together = [], []
        for sequence in taken:
            if sequence.cancelled:
                self._read.put((sequence, None, None, None))
                continue
            prompt = sequence.request.prompt
            plan = self.prefix_cache.plan(prompt) if self.prefix_cache is not None else None
            # from a saved prefix, saving one, or longer than a chunk: read alone
            if len(taken) > 1 and len(prompt) <= self.prefill_chunk_size and (plan is None or plan[0] == 0
                                                                               and plan[2] is None):
                together.append((sequence, plan))
            else:
                alone.append((sequence, plan))
        for group in padded_groups(together, length=lambda item: len(item[0].request.prompt)):
            try:
                with torch.no_grad(), stream:
                    read = read_together(self.model, [s.request.prompt for s, _ in group])
                if self._stream is not None:
                    self._stream.synchronize()
                self.batched_reads += len(group) > 1
                for (sequence, _), (logits, states) in zip(group, read):
                    self._read.put((sequence, logits, states, None))
            except Exception:   # each alone (its plan kept: not counted twice): the one at fault fails alone
                alone += group
        for sequence, plan in alone:
            try:
                with torch.no_grad(), stream:   # (grad mode is per thread)
                    logits, states = prefill_cached(self.model, sequence.request.prompt,
                                                    self.prefill_chunk_size, self.prefix_cache, plan)
                if self._stream is not None:
                    self._stream.synchronize()   # the decode stream reads these states next
                self._read.put((sequence, logits, states, None))
            except Exception as error:
                self._read.put((sequence, None, None, error))

    def _read_while_idle(self) -> None:
        """With nothing to decode, this thread reads waiting prompts too, beside the prefill
        thread: the decode side's cores would idle otherwise (on a CPU each side has its half,
        server.default_threads). At most IDLE_READ_TOKENS at a time: a prompt read here holds
        back the first tokens of those the prefill thread reads meanwhile (they take their slots
        on this thread), so a longer one is left to the prefill thread."""
        taken, _ = self._take_waiting([], self.prefill_batch, IDLE_READ_TOKENS)
        if taken:
            self.idle_reads += len(taken)
            self._read_taken(taken)

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
        return bool(self.waiting or self.running)   # (a prompt being read stays in waiting)

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

    def _emit(self, sequence: Sequence, token: int, events: list, logits=None) -> None:
        sequence.tokens.append(token)
        request = sequence.request
        if request.logprobs is not None:
            sequence.scored.append(token_scores(logits, token, request.logprobs))
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
    def _admit(self, sequence: Sequence, logits, states, events: list) -> None:
        """The prompt read: the sequence takes the next slot and yields its first token."""
        request = sequence.request
        self.waiting.remove(sequence)
        sequence.slot = len(self.running)
        self.decoder.load(sequence.slot, states, len(request.prompt))
        self.running[sequence.slot] = sequence
        generator = None
        if request.temperature > 0:
            generator = self.generators[sequence.id] = torch.Generator(device=self.device).manual_seed(request.seed)
        self._emit(sequence, sample_with(logits[0, -1], request.temperature, request.top_k, generator,
                                         request.sampling, request.prompt, sequence.tokens), events, logits[0, -1])

    def _failed_reading(self, sequence: Sequence, error: BaseException, events: list) -> None:
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        self._fail(sequence, error, events)

    def step(self, deliver=None) -> list:
        """One decode step for every running sequence, then the prompts read take free slots
        (each yields its first token). Returns (sequence, token, finished) events in the order
        they happened; token None with finish_reason "error" for a sequence that failed.
        deliver(events), when given, receives the decode step's events before any prompt is
        read on this thread (the server sends them at once). A failure fails only the sequences
        it touched: a prompt's reading or a draw its own sequence, the shared decode step every
        running one; the batcher goes on."""
        events = []
        for sequence in [s for s in self.running.values() if s.cancelled]:
            self._finish(sequence, "cancelled")
        for sequence in [s for s in self.waiting if s.cancelled and not s.reading]:
            self.waiting.remove(sequence)
            sequence.finish_reason = "cancelled"
        if self.running:
            self._decode(events)
        if deliver is not None and events:
            deliver(events)
            events = []
        if self._reader is not None:
            self._collect_read(events)
        else:
            for sequence in list(self.waiting)[:self.decoder.slots - len(self.running)]:
                try:
                    with torch.no_grad():   # (as on the prefill thread: no graph for a prompt)
                        logits, states = prefill_cached(self.model, sequence.request.prompt,
                                                        self.prefill_chunk_size, self.prefix_cache)
                    self._admit(sequence, logits, states, events)
                except Exception as error:
                    self._failed_reading(sequence, error, events)
        return events

    @torch.no_grad()
    def _collect_read(self, events: list) -> None:
        """Prompts the prefill thread has read take their slots; more are handed to it, oldest
        first, while slots remain for them. With nothing to decode, waits a moment for a read."""
        wait = not self.running and self.reading > 0
        if wait and self._idle_reader:
            self._read_while_idle()
        while self.reading:
            try:
                sequence, logits, states, error = self._read.get(timeout=0.05) if wait else self._read.get_nowait()
            except queue.Empty:
                break
            wait = False
            self.reading -= 1
            sequence.reading = False
            try:
                if error is not None:
                    raise error
                if sequence.cancelled:
                    self.waiting.remove(sequence)
                    sequence.finish_reason = "cancelled"
                    continue
                self._admit(sequence, logits, states, events)
                if self._stream is not None:
                    # the states were allocated on the prefill stream: let the copy into the slot
                    # finish before they are freed and that stream may reuse their memory
                    torch.cuda.current_stream(self.device).synchronize()
            except Exception as failure:
                self._failed_reading(sequence, failure, events)
        handed = []
        for sequence in self.waiting:
            if len(self.running) + self.reading >= self.decoder.slots:
                break
            if not sequence.reading:
                sequence.reading = True
                self.reading += 1
                handed.append(sequence)
        self._to_read.put(*handed)   # at once: the prefill thread's first group is whole, not one prompt

    def _decode(self, events: list) -> None:
        try:
            logits = self.decoder.step(self.next_token[:len(self.running)])
        except Exception as error:
            self.failed_decodes += 1
            for sequence in list(self.running.values()):
                self._fail(sequence, error, events)
            return
        self.failed_decodes = 0
        for slot, sequence in sorted(self.running.items()):   # (a finishing one moves another: by object)
            if sequence.cancelled:
                continue
            request = sequence.request
            try:
                token = sample_with(logits[slot], request.temperature, request.top_k,
                                    self.generators.get(sequence.id), request.sampling, request.prompt, sequence.tokens)
            except Exception as error:
                self._fail(sequence, error, events)
                continue
            self._emit(sequence, token, events, logits[slot])


def token_scores(logits, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` and the `top` likeliest tokens with theirs, from one
    position's logits [V] (the model's own distribution: before temperature, penalties and
    top_k, as vLLM and OpenAI give them)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = []
    if top:
        values, indices = logprobs.topk(top)
        best = list(zip(indices.tolist(), values.tolist()))
    return logprobs[token].item(), best


def padded_groups(items: list, waste: float = 0.25, length=len) -> list[list]:
    """Prompts (items whose `length` is their tokens) in groups to read as left-padded batches:
    longest first, one joins the current group while the group's padding stays within `waste` of
    its real tokens (a 1,000-token prompt and a 5-token one are not padded to one size)."""
    groups, group, real = [], [], 0
    for item in sorted(items, key=length, reverse=True):
        n = length(item)
        if group and (len(group) + 1) * length(group[0]) > (1 + waste) * (real + n):
            groups.append(group)
            group, real = [], 0
        group.append(item)
        real += n
    return groups + [group] if group else groups


def read_together(model, prompts: list[list[int]]) -> list[tuple]:
    """Prompts read in one call, left-padded to the longest (`start`: each row's first real token;
    the mixers leave no trace of padding in a row's state, model/mixers), -> (logits [1, 1, V] at
    each prompt's last token, its states, batch 1) per prompt, as prefill gives them alone."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    starts = [width - len(p) for p in prompts]
    for row, (prompt, start) in enumerate(zip(prompts, starts)):
        tokens[row, start:] = torch.tensor(prompt, device=device)
    hidden, states = model(tokens, start=torch.tensor(starts, device=device), return_states=True,
                           return_hidden=True)
    logits = model.lm_head(hidden[:, -1:])

    def row(j):   # row j of every batch tensor of the states
        return lambda t: t[j:j + 1] if t.dim() and t.shape[0] == len(prompts) else t
    return [(logits[j:j + 1], map_state(states, row(j))) for j in range(len(prompts))]


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
