"""The mixers' decode interface (megatron_id/model/mixers/decode.py), through which the fused
decoder composes mixers (issue 42): it reads nothing else of a mixer (a wrapper that hides the
mixer's attributes behind the interface decodes bit for bit the same), the interface is optional
(a mixer without it generates through its own forward), and the cache sizes the memory check
reads come from the mixers' own allocation."""
from __future__ import annotations

import pytest
import torch
from test_fused_decode import VOCAB, tiny
from torch import nn

from megatron_id.inference.fused_decode import FusedDecodeError, FusedDecoder, fused_decode_refusal, kv_cache_bytes
from megatron_id.inference.generate import generate_ids
from megatron_id.model.mixers.decode import DecodeFacts
from megatron_id.model.rope import Rope


class Hidden(nn.Module):
    """A mixer that holds another under a private name and offers only its forward and its decode
    interface: any other attribute the decoder asked for (q_proj, log_dt, window, ...) would fail."""

    def __init__(self, inner):
        super().__init__()
        self._wrapped = inner

    def forward(self, x, state=None, return_state=False, **kwargs):
        return self._wrapped(x, state=state, return_state=return_state, **kwargs)

    def decode_facts(self):
        return self._wrapped.decode_facts()

    def decode_tables(self, real_update=False):
        return self._wrapped.decode_tables(real_update=real_update)

    def allocate_decode_state(self, n_slots, capacity=None, device=None):
        return self._wrapped.allocate_decode_state(n_slots, capacity, device=device)

    def load_decode_state(self, buffers, slot, state):
        self._wrapped.load_decode_state(buffers, slot, state)

    @property
    def decode_step(self):
        return self._wrapped.decode_step


class ForwardOnly(nn.Module):
    """A mixer without the decode interface (as the toy of docs/adding-a-mixer.md)."""

    def __init__(self, inner):
        super().__init__()
        self._wrapped = inner

    def forward(self, x, state=None, return_state=False, **kwargs):
        return self._wrapped(x, state=state, return_state=return_state, **kwargs)


def hide(model, wrapper):
    for block in model.layers:
        block.mixer = wrapper(block.mixer)
    return model


CASES = {"hybrid IAWS, window 5": ["model.layer_pattern=IAWS", "model.window=5"],
         "s4d-only, output gate": ["model.mixer=s4d", "model.output_gate=true"],
         "single input, contraction": ["model.dual_kv_input=false", "model.query_readout=false"]}


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_fused_decoder_reads_only_the_decode_interface(case, kernel):
    """The same logits, bit for bit, with every mixer's attributes hidden behind the interface;
    slots of different lengths, a move and a clear on the way."""
    model, hidden = tiny(CASES[case]), hide(tiny(CASES[case]), Hidden)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (11, 4, 7)]
    new = torch.randint(0, VOCAB, (3, 6), generator=g)
    with torch.no_grad():
        decoders = [FusedDecoder(m, slots=3, capacity=24, kernel=kernel) for m in (model, hidden)]
        for m, decoder in zip((model, hidden), decoders):
            for slot, prompt in enumerate(prompts):
                decoder.load(slot, m(prompt, return_states=True)[1], prompt.shape[1])
        for t in range(6):
            if t == 3:
                for decoder in decoders:
                    decoder.move(2, 0)
                    decoder.clear(2)
            n = 3 if t < 3 else 2
            a, b = (decoder.step(new[:n, t]) for decoder in decoders)
            assert torch.equal(a, b), (case, t)
    assert decoders[1].kernel == kernel


def test_the_compiled_step_reads_only_the_decode_interface():
    model, hidden = tiny(["model.layer_pattern=IS"], layers=2), hide(tiny(["model.layer_pattern=IS"], layers=2), Hidden)
    prompt, new = torch.arange(1, 8)[None], torch.tensor([3, 5, 7])
    with torch.no_grad():
        decoders = [FusedDecoder(m, slots=1, compile=True) for m in (model, hidden)]
        for m, decoder in zip((model, hidden), decoders):
            decoder.load(0, m(prompt, return_states=True)[1], 7)
        for token in new:
            a, b = (decoder.step(token[None]) for decoder in decoders)
            assert torch.equal(a, b)


def test_a_mixer_without_the_interface_generates_through_its_own_forward():
    """The interface is optional: such a model has no fused step (refused, naming the mixer) and
    generates eagerly, the same tokens as the model's own mixers give."""
    model = tiny(["model.layer_pattern=IA"], dtype=torch.float32, layers=2)
    plain = hide(tiny(["model.layer_pattern=IA"], dtype=torch.float32, layers=2), ForwardOnly)
    assert fused_decode_refusal(plain) == "layer 0's mixer (ForwardOnly) has no fused decode step"
    with pytest.raises(FusedDecodeError, match=r"ForwardOnly\) has no fused decode step"):
        FusedDecoder(plain, capacity=16)
    want = list(generate_ids(model, [5, 6, 7], 6, decode="fused"))
    assert list(generate_ids(plain, [5, 6, 7], 6)) == list(generate_ids(model, [5, 6, 7], 6)) == want
    assert kv_cache_bytes(plain, 2, 16) == (0, 0)   # nothing it could size


def test_facts_and_cache_sizes_come_from_the_mixers():
    """The decoder's memory check sizes the KV caches with the mixers' own allocation (on the
    meta device): K and V per slot, `capacity` tokens or the window."""
    model = tiny(["model.layer_pattern=IAWS", "model.window=5"], dtype=torch.float32)
    facts = [block.mixer.decode_facts() for block in model.layers]
    assert [f.name for f in facts] == ["interdomain", "softmax", "softmax", "interdomain"]
    assert [f.fixed_size for f in facts] == [True, False, False, True]
    assert [f.needs_capacity for f in facts] == [False, True, False, False]
    d, H = model.cfg.d_model, model.cfg.n_heads
    assert all(isinstance(f, DecodeFacts) for f in facts)
    assert [f.rope for f in facts] == [(d // H, Rope(model.cfg.rope_theta))] * 3 + [None]   # S4D-only: no RoPE
    assert kv_cache_bytes(model, 3, 40) == (2 * 3 * (40 + 5) * d * 4, 2)   # float32: 4 bytes
    buffers = model.layers[1].mixer.allocate_decode_state(3, 40, device="meta")
    assert {k: (tuple(v.shape), v.device.type) for k, v in buffers.items()} == \
        {"k": ((3, H, 40, d // H), "meta"), "v": ((3, H, 40, d // H), "meta")}
    with pytest.raises(ValueError, match="needs a capacity"):
        model.layers[1].mixer.allocate_decode_state(1)
