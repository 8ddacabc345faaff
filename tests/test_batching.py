"""Continuous batching over the fused step's slots (megatron_id/inference/batching.py): more
prompts than slots, of different lengths, join and leave the running batch; each completion is
what generate_ids gives for that prompt alone (greedy, and sampled with the same seed)."""
from __future__ import annotations

import pytest
import torch
from test_fused_decode import VOCAB, tiny

from megatron_id.errors import BadOptionError
from megatron_id.inference.batching import ContinuousBatcher, Request, generate_batch
from megatron_id.inference.generate import generate_ids


def prompts(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("items", [[], ["model.layer_pattern=IAIW", "model.window=6"]], ids=["interdomain", "hybrid"])
def test_batched_completions_equal_one_at_a_time(items):
    model = tiny(items, dtype=torch.float32)
    ps = prompts(5)
    for temperature, top_k in ((0.0, 0), (1.0, 20)):
        batched = generate_batch(model, ps, 8, slots=3, temperature=temperature, top_k=top_k, seed=5,
                                 prefill_chunk_size=8)
        for i, p in enumerate(ps):
            alone = list(generate_ids(model, p, 8, temperature=temperature, top_k=top_k, prefill_chunk_size=8,
                                      generator=torch.Generator().manual_seed(5 + i)))
            assert batched[i] == alone, (temperature, i)


def test_a_sequence_that_ends_frees_its_slot_for_the_next():
    model = tiny([], dtype=torch.float32)
    ps = prompts(5, seed=1)
    # the end-of-document id: the first token greedy decoding gives prompt 0, so it ends at once
    eos = list(generate_ids(model, ps[0], 1))[0]
    batcher = ContinuousBatcher(model, slots=2)
    sequences = [batcher.submit(Request(p, 6, eos_id=eos)) for p in ps]
    slots_seen, steps = set(), 0
    while batcher.busy():
        batcher.step()
        slots_seen.add(tuple(sorted(batcher.running)))
        steps += 1
    assert sequences[0].tokens == [eos] and sequences[0].finish_reason == "stop"
    for s, p in zip(sequences[1:], ps[1:]):
        alone = list(generate_ids(model, p, 6, eos_id=eos))
        assert s.tokens == alone and s.finish_reason == ("stop" if alone[-1] == eos else "length")
    assert steps < 5 * 6 // 2 + 3      # never more than 2 at once, yet no slot idles while work waits
    assert all(len(running) <= 2 for running in slots_seen)


def test_cancelled_sequences_leave_and_requests_that_cannot_fit_are_refused():
    model = tiny(["model.layer_pattern=IA"], dtype=torch.float32, layers=2)
    batcher = ContinuousBatcher(model, slots=2, capacity=20)
    with pytest.raises(BadOptionError, match="prompt's 15 tokens and max_tokens 6 exceed this model's 20-token"):
        batcher.submit(Request([1] * 15, 6))
    with pytest.raises(BadOptionError, match="the prompt is empty"):
        batcher.submit(Request([], 6))
    with pytest.raises(BadOptionError, match="max_tokens 0: at least 1"):
        batcher.submit(Request([1, 2], 0))
    a, b, c = (batcher.submit(Request([1, 2, 3], 10)) for _ in range(3))
    batcher.step()
    batcher.cancel(a)
    batcher.step()
    assert a.finish_reason == "cancelled" and a not in batcher.running.values()
    assert c.slot is not None   # it took the cancelled sequence's slot
    while batcher.busy():
        batcher.step()
    assert len(b.tokens) == len(c.tokens) == 10


def test_a_sequence_moved_into_a_freed_slot_decodes_on_as_alone():
    """Running sequences stay in the first slots: when one leaves, the last moves into its slot
    (states, conv tails, KV caches) and goes on decoding there."""
    model = tiny(["model.layer_pattern=IAIW", "model.window=6"], dtype=torch.float32)
    ps = prompts(4, seed=3)
    budgets = [2, 9, 4, 11]
    batcher = ContinuousBatcher(model, slots=3, capacity=64)
    sequences = [batcher.submit(Request(p, n)) for p, n in zip(ps, budgets)]
    slots = {s.id: set() for s in sequences}
    while batcher.busy():
        batcher.step()
        for slot, s in batcher.running.items():
            slots[s.id].add(slot)
    # a step decodes the running ones, then reads prompts into the free slots: sequence 2 took
    # slot 2 and moved to slot 0 when sequence 0 ended; sequence 3 then took slot 2, and moved to
    # slot 0 when sequence 2 ended
    assert slots == {sequences[0].id: {0}, sequences[1].id: {1}, sequences[2].id: {2, 0},
                     sequences[3].id: {2, 0}}, slots
    for s, p, n in zip(sequences, ps, budgets):
        assert s.tokens == list(generate_ids(model, p, n)), s.id


def test_a_failing_sequence_fails_alone_and_the_others_decode_on_as_alone(monkeypatch):
    """A draw that raises (here: one request's sampling) ends that sequence with finish_reason
    "error" and frees its slot; the sequences beside it give what they give alone; a batch of
    prompts (generate_batch) stops with the error rather than return a partial result."""
    from megatron_id.inference import batching
    model = tiny([], dtype=torch.float32)
    ps = prompts(4, seed=2)
    real = batching.sample_with

    def sample(logits, temperature, top_k, generator, *rest):
        if temperature == 0.5:   # the marked request
            raise RuntimeError("injected")
        return real(logits, temperature, top_k, generator, *rest)
    monkeypatch.setattr(batching, "sample_with", sample)
    batcher = ContinuousBatcher(model, slots=2)
    sequences = [batcher.submit(Request(p, 6, temperature=0.5 if i == 1 else 0.0)) for i, p in enumerate(ps)]
    events = []
    while batcher.busy():
        events += batcher.step()
    assert [s.finish_reason for s in sequences] == ["length", "error", "length", "length"]
    assert str(sequences[1].error) == "injected" and (sequences[1], None, True) in events
    for i in (0, 2, 3):
        assert sequences[i].tokens == list(generate_ids(model, ps[i], 6)), i
    assert not batcher.running and batcher.failed_decodes == 0
    with pytest.raises(RuntimeError, match="injected"):
        generate_batch(model, ps, 4, slots=2, temperature=0.5)


@pytest.mark.parametrize("items", [[], ["model.layer_pattern=IAIW", "model.window=6"]], ids=["interdomain", "hybrid"])
def test_prompts_read_on_the_prefill_thread_take_slots_in_order_and_decode_as_alone(items):
    """prefill_thread=True (the server): prompts are read on a thread of their own while the
    batcher's thread decodes; every step decodes each running sequence; first tokens come in
    order of arrival; a cancelled prompt and one that fails while read leave without a slot;
    every completion is what it is alone."""
    import threading
    model = tiny(items, dtype=torch.float32)
    readers = set()
    forward = model.forward

    def recording(tokens, *args, **kwargs):
        if tokens.shape[1] > 1:   # a prompt being read (decode steps do not call forward)
            readers.add(threading.current_thread().name)
            if tokens[0, 0] == 1:
                raise RuntimeError("injected: this prompt cannot be read")
        return forward(tokens, *args, **kwargs)
    model.forward = recording
    g = torch.Generator().manual_seed(4)
    short = torch.randint(2, VOCAB, (5,), generator=g).tolist()
    longs = [torch.randint(2, VOCAB, (40,), generator=g).tolist() for _ in range(4)]
    batcher = ContinuousBatcher(model, slots=4, capacity=64, prefill_thread=True, prefill_chunk_size=8)
    try:
        first = batcher.submit(Request(short, 30))
        while not first.tokens:
            batcher.step()
        later = [batcher.submit(Request(p, 4)) for p in longs]
        doomed = batcher.submit(Request([1, *longs[0][1:]], 4))   # fails while read
        later[2].cancelled = True
        order = []
        while batcher.busy():
            before = len(first.tokens)
            events = batcher.step()
            if before < 30:
                assert len(first.tokens) == before + 1, "a step did not decode the running sequence"
            order += [s.id for s, token, _ in events if s is not first and len(s.tokens) == 1 and token is not None]
    finally:
        batcher.close()
    assert readers == {"megatron-id-prefill"}, readers
    assert order == [later[i].id for i in (0, 1, 3)], order
    assert later[2].finish_reason == "cancelled" and not later[2].tokens
    assert doomed.finish_reason == "error" and "injected" in str(doomed.error) and doomed.slot is None
    assert first.tokens == list(generate_ids(model, short, 30)), "the running sequence"
    for i in (0, 1, 3):
        assert later[i].tokens == list(generate_ids(model, longs[i], 4)), i


@pytest.mark.parametrize("items", [[], ["model.mixer=s4d"]], ids=["interdomain", "s4d"])
def test_prompts_read_together_left_padded_give_the_logits_and_states_of_each_read_alone(items):
    """read_together (the prefill thread's batched read, issue 55): each row's last logits and
    state equal prefill's of that prompt alone (float64: to 1e-10), padding included."""
    from megatron_id.inference.batching import read_together
    from megatron_id.inference.generate import prefill
    model = tiny(items)
    ps = prompts(5, seed=4)
    with torch.no_grad():
        together = read_together(model, ps)
        for p, (logits, states) in zip(ps, together):
            want_logits, want_states = prefill(model, p, 2048)
            assert torch.allclose(logits, want_logits, atol=1e-10, rtol=0)
            for got, want in zip(states, want_states):
                assert torch.allclose(got["ssm"], want["ssm"], atol=1e-10, rtol=0)
                for name, tail in want["conv"].items():
                    assert torch.allclose(got["conv"][name], tail, atol=1e-10, rtol=0), name


def test_the_prefill_thread_reads_waiting_prompts_together_and_each_completes_as_alone():
    """The prefill thread takes every prompt waiting (up to prefill_batch) and reads them in
    left-padded groups of similar length; greedy and sampled completions equal generate's alone.
    A hybrid (softmax layers keep a KV cache) reads one at a time."""
    model = tiny([], dtype=torch.float32)
    ps = prompts(8, seed=6)
    batcher = ContinuousBatcher(model, slots=8, prefill_thread=True, prefill_batch=8)
    try:
        sequences = [batcher.submit(Request(p, 6, temperature=1.0 if i % 2 else 0.0, seed=i))
                     for i, p in enumerate(ps)]
        while batcher.busy():
            batcher.step()
        assert batcher.batched_reads >= 1
    finally:
        batcher.close()
    for i, (p, sequence) in enumerate(zip(ps, sequences)):
        alone = list(generate_ids(model, p, 6, temperature=1.0 if i % 2 else 0.0,
                                  generator=torch.Generator().manual_seed(i)))
        assert sequence.tokens == alone, i
    hybrid = ContinuousBatcher(tiny(["model.layer_pattern=IAIW", "model.window=6"], dtype=torch.float32), slots=2,
                               capacity=64, prefill_batch=8)
    assert hybrid.prefill_batch == 1


@pytest.mark.parametrize("budget", [1024, 1], ids=["within-budget", "over-budget"])
def test_while_nothing_decodes_the_batchers_thread_reads_waiting_prompts_too(monkeypatch, budget):
    """idle_reads (serve's default): with no sequence to decode, the batcher's thread takes
    waiting prompts off the prefill thread's queue (up to IDLE_READ_TOKENS) and reads them itself;
    every completion still equals generate's alone. A prompt over the budget is left to the prefill
    thread (budget 1: every one)."""
    import threading
    import time

    from megatron_id.inference import batching
    monkeypatch.setattr(batching, "IDLE_READ_TOKENS", budget)
    model = tiny([], dtype=torch.float32)
    ps = prompts(12, seed=9)
    batcher = ContinuousBatcher(model, slots=16, prefill_thread=True, prefill_batch=4, idle_reads=True)
    reads_by_thread = {"megatron-id-prefill": 0, "main": 0}
    own = batcher._read_taken

    def counted(taken, *args):
        name = threading.current_thread().name
        reads_by_thread[name if name in reads_by_thread else "main"] += len(taken)
        if name == "megatron-id-prefill" and budget > 1:
            # hold the prefill thread's first group until the batcher's thread has read one of its own
            deadline = time.monotonic() + 20
            while batcher.idle_reads == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        return own(taken, *args)
    batcher._read_taken = counted
    try:
        sequences = [batcher.submit(Request(p, 5, temperature=1.0 if i % 2 else 0.0, seed=i))
                     for i, p in enumerate(ps)]
        while batcher.busy():
            batcher.step()
    finally:
        batcher.close()
    if budget > 1:
        assert batcher.idle_reads > 0 and reads_by_thread["main"] == batcher.idle_reads
        assert reads_by_thread["megatron-id-prefill"] > 0
    else:
        assert batcher.idle_reads == 0 and reads_by_thread == {"megatron-id-prefill": 12, "main": 0}
    for i, (p, sequence) in enumerate(zip(ps, sequences)):
        alone = list(generate_ids(model, p, 5, temperature=1.0 if i % 2 else 0.0,
                                  generator=torch.Generator().manual_seed(i)))
        assert sequence.tokens == alone, i


def test_without_idle_reads_only_the_prefill_thread_reads():
    model = tiny([], dtype=torch.float32)
    batcher = ContinuousBatcher(model, slots=8, prefill_thread=True, prefill_batch=4)   # idle_reads off
    try:
        for p in prompts(8, seed=10):
            batcher.submit(Request(p, 3))
        while batcher.busy():
            batcher.step()
    finally:
        batcher.close()
    assert batcher.idle_reads == 0
