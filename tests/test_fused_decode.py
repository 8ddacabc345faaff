"""The fused decode step (megatron_id/inference/fused_decode.py) against its references: the
model's own decode (LanguageModel.forward with states: the recurrent form and the KV cache) and
the chunked forward over the whole sequence, in float64, for every layer kind and switch; slots
of different prefix lengths in one batch, refilled while the others go on; the compiled step."""
from __future__ import annotations

import re

import pytest
import torch
from conftest import ROOT

from megatron_id.config import load_config
from megatron_id.inference.fused_decode import FusedDecodeError, FusedDecoder
from megatron_id.model import LanguageModel

VOCAB = 97
CASES = {
    "interdomain": [],
    "s4d-only": ["model.mixer=s4d"],
    "softmax": ["model.mixer=softmax"],
    "softmax GQA, q/k/v biases": ["model.mixer=softmax", "model.n_kv_heads=2", "model.qkv_bias=true"],
    # a window shorter than the prefix: the ring of the W layer's cache wraps
    "hybrid IAWS, window 5": ["model.layer_pattern=IAWS", "model.window=5"],
    "plain readout": ["model.readout=plain"],
    "single kv input": ["model.dual_kv_input=false"],
    "no query readout (contraction), dual input": ["model.query_readout=false"],
    "no rope, output gate": ["model.rope=false", "model.output_gate=true"],
}


def tiny(items, dtype=torch.float64, layers=4):
    cfg = load_config([ROOT / "configs/model/tiny.yaml"], [f"model.vocab_size={VOCAB}", f"model.n_layers={layers}",
                                                            *items]).model
    model = LanguageModel(cfg, seed=1).to(dtype).eval()
    with torch.no_grad():   # parameters the init leaves at zero, so that every term is exercised
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if name.endswith(("c_im", "k_bias", "v_bias", "conv.bias", "proj.bias")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_step_equals_the_models_decode_and_the_whole_sequence(case, kernel):
    """Both ways of running the fixed-state core: the C++ kernel and its torch reference."""
    model = tiny(CASES[case])
    g = torch.Generator().manual_seed(0)
    prompt, new = torch.randint(0, VOCAB, (1, 13), generator=g), torch.randint(0, VOCAB, (1, 6), generator=g)
    with torch.no_grad():
        whole = model(torch.cat([prompt, new], 1))[0, 13:]                      # the chunked form
        _, states = model(prompt, return_states=True)
        decoder = FusedDecoder(model, slots=3, capacity=32, kernel=kernel)
        assert decoder.kernel == ("torch" if case.startswith("softmax") else kernel)
        decoder.load(1, states, 13)                                            # the middle slot
        for t in range(6):
            own, states = model(new[:, t:t + 1], states=states, return_states=True)
            tokens = torch.zeros(3, dtype=torch.long)
            tokens[1] = new[0, t]
            fused = decoder.step(tokens)[1]
            assert rel(fused, own[0, -1]) < 1e-10, (case, t)
            assert rel(fused, whole[t]) < 1e-10, (case, t)


def test_slots_of_different_lengths_decode_as_if_alone_and_refill_mid_run():
    """Three prompts of 3, 11 and 20 tokens decode in one batch, each as it would alone; slot 0
    is emptied and refilled with a fourth prompt after two steps while the others go on."""
    model = tiny(["model.layer_pattern=IIAS"])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (3, 11, 20, 7)]
    follow = torch.randint(0, VOCAB, (4, 5), generator=g)

    def alone(i, steps):
        with torch.no_grad():
            return model(torch.cat([prompts[i], follow[i:i + 1, :steps]], 1))[0, prompts[i].shape[1] - 1:]

    with torch.no_grad():
        decoder = FusedDecoder(model, slots=3, capacity=40)
        for slot in range(3):
            decoder.load(slot, model(prompts[slot], return_states=True)[1], prompts[slot].shape[1])
        got = {0: [], 1: [], 2: [], 3: []}
        for t in range(5):
            if t == 2:   # slot 0's sequence leaves, prompt 3 takes its slot
                decoder.clear(0)
                decoder.load(0, model(prompts[3], return_states=True)[1], prompts[3].shape[1])
            seq = [3 if t >= 2 else 0, 1, 2]
            step = follow[seq, [t - 2 if (t >= 2 and s == 0) else t for s in range(3)]]
            logits = decoder.step(step)
            for s, i in enumerate(seq):
                got[i].append(logits[s])
    for i, n in ((0, 2), (1, 5), (2, 5), (3, 3)):
        want = alone(i, n)[1:n + 1]
        assert rel(torch.stack(got[i]), want) < 1e-10, i


def test_compiled_step_equals_the_eager_one():
    """torch.compile of the fixed-state block (real arithmetic for the update): the same logits."""
    model = tiny(["model.layer_pattern=IS", "model.output_gate=true"], layers=2)
    g = torch.Generator().manual_seed(2)
    prompt, new = torch.randint(0, VOCAB, (1, 9), generator=g), torch.randint(0, VOCAB, (2, 4), generator=g)
    with torch.no_grad():
        _, states = model(prompt, return_states=True)
        eager, compiled = FusedDecoder(model, slots=2), FusedDecoder(model, slots=2, compile=True)
        for decoder in (eager, compiled):
            decoder.load(0, states, 9)
            decoder.load(1, states, 9)
        for t in range(4):
            a, b = eager.step(new[:, t]), compiled.step(new[:, t])
            assert rel(b, a) < 1e-10, t


def test_what_the_fused_step_cannot_take_is_refused():
    softmax = tiny(["model.mixer=softmax"], layers=1)
    with pytest.raises(FusedDecodeError, match="needs a capacity"):
        FusedDecoder(softmax, slots=1)
    with torch.no_grad():
        _, states = softmax(torch.zeros(1, 8, dtype=torch.long), return_states=True)
    decoder = FusedDecoder(softmax, slots=2, capacity=9)
    with pytest.raises(FusedDecodeError, match="slots 0 to 1"):
        decoder.load(2, states, 8)
    with pytest.raises(FusedDecodeError, match="a prefix of 9 tokens leaves no room in a KV cache of 9"):
        decoder.load(0, states, 9)
    decoder.load(0, states, 8)
    with pytest.raises(FusedDecodeError, match=r"shape \(n,\) with n from 1 to 2, not \(3,\)"):
        decoder.step(torch.zeros(3, dtype=torch.long))
    decoder.step(torch.zeros(2, dtype=torch.long))     # the ninth token: the cache is full now
    with pytest.raises(FusedDecodeError, match="reached the KV cache's capacity of 9"):
        decoder.step(torch.zeros(2, dtype=torch.long))
    interdomain = tiny([], layers=1)
    with pytest.raises(FusedDecodeError, match=r"layer 0's state has \['k', 'pos', 'v'\], not the \['conv', 'ssm'\] "
                                               r"of its interdomain mixer"):
        FusedDecoder(interdomain).load(0, states, 8)
    with pytest.raises(FusedDecodeError, match="2 layer states for a model of 1 layers"):
        FusedDecoder(interdomain).load(0, states * 2, 8)

    class Toy(torch.nn.Module):
        pass
    interdomain.layers[0].mixer = Toy()
    with pytest.raises(FusedDecodeError, match=r"layer 0's mixer \(Toy\) has no fused decode step"):
        FusedDecoder(interdomain)


def test_the_kernel_choice_falls_back_or_refuses_with_the_reason(monkeypatch):
    """kernel='auto' takes the torch ops where the C++ core does not apply (compile, bf16) or cannot
    be built; kernel='cpp' refuses there, naming why; a failed build warns with its cause."""
    from megatron_id.inference import cpu_kernel
    model = tiny([], layers=1)
    assert FusedDecoder(model).kernel == "cpp"
    assert FusedDecoder(model, compile=True).kernel == "torch"
    with pytest.raises(FusedDecodeError, match="kernel='cpp' is not available here: compile=True"):
        FusedDecoder(model, compile=True, kernel="cpp")
    bf16 = tiny([], dtype=torch.bfloat16, layers=1)
    assert FusedDecoder(bf16).kernel == "torch"
    with pytest.raises(FusedDecodeError, match="the model is torch.bfloat16, not float32 or float64"):
        FusedDecoder(bf16, kernel="cpp")
    with pytest.raises(FusedDecodeError, match="kernel='fast': one of auto, cpp, torch"):
        FusedDecoder(model, kernel="fast")

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension: g++: not found")
    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    with pytest.warns(UserWarning, match="could not be built .*g\\+\\+: not found.*torch ops instead"):
        assert cpu_kernel.fixed_state_step_kernel.__wrapped__() is None
    monkeypatch.setattr(cpu_kernel, "fixed_state_step_kernel", lambda: None)
    assert FusedDecoder(model).kernel == "torch"
    with pytest.raises(FusedDecodeError, match="the C\\+\\+ kernel could not be built"):
        FusedDecoder(model, kernel="cpp")


def test_the_kernel_names_a_tensor_it_cannot_take():
    """The C++ core checks its inputs (a caller outside FusedDecoder gets the tensor's name)."""
    model = tiny([], layers=1)
    decoder = FusedDecoder(model, kernel="cpp")
    t, s = decoder.layers[0].tensors, decoder.layers[0].static
    x = torch.zeros(1, model.layers[0].mixer.o_proj.weight.shape[0], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="state must be contiguous, on the CPU and Double .* not contiguous"):
        decoder.core(x @ t["w_in"].T, t["conv_tail"], t["conv_w"], t["conv_b"], None, None, t["kv_norm"],
                     t["kv_bias"], t["lam_re"], t["lam_im"], t["bbar_re"], t["bbar_im"], t["g2"],
                     t["state"].transpose(-1, -2), 0, s.mapped, s.query, s.dual, s.gate, s.kv_eps)


def test_the_first_build_says_so_before_its_pause_and_when_it_is_done(monkeypatch, tmp_path, capsys):
    """A build (~10 s, silent in torch) is announced on stderr, and its end with the time it took;
    a cached one is not."""
    import warnings

    from megatron_id.inference import cpu_kernel
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: None)   # no real build here
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpu_kernel.module_name(cpu_kernel._flags())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (whether the op is registered depends on the tests before)
        cpu_kernel.fixed_state_step_kernel.__wrapped__()
        err = capsys.readouterr().err
        assert f"building the fused decode step's CPU kernel (once, ~10 s; cached under {tmp_path})" in err
        assert re.search(rf"megatron-id: built the CPU kernel in \d+\.\d s \({tmp_path / name / name}\.so\)", err), err
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / f"{name}.so").write_bytes(b"")
        cpu_kernel.fixed_state_step_kernel.__wrapped__()
        assert "built" not in capsys.readouterr().err



def inverse_frequencies(layer, dtype):
    """The layer's RoPE inverse frequencies (model/rope.py)."""
    head_dim, rope = layer.facts.rope
    return rope.frequencies(head_dim, dtype=dtype)[0]

@pytest.mark.parametrize("case", ["interdomain", "no query readout (contraction), dual input", "single kv input"])
def test_the_kernel_updates_chosen_slots_of_strided_pages_in_place(case):
    """`rows` (the vLLM plugin's decode): row b updates slot rows[b] of conv tails and states that
    are views into pages (vLLM's layout: each slot contiguous, the slots a page apart), exactly as
    the kernel updates the same slots copied out into contiguous buffers; the other slots are
    untouched; a row past the slots is refused."""
    from megatron_id.model.mixers.decode import fixed_state_between_kernel
    model = tiny(CASES[case], layers=1)
    decoder = FusedDecoder(model, slots=1, kernel="cpp")
    layer = decoder.layers[0]
    t, s = layer.tensors, layer.static
    tail_shape, state_shape = layer.buffers["conv_tail"].shape[1:], layer.buffers["state"].shape[1:]
    n_tail, n_state = tail_shape.numel(), state_shape.numel()
    g = torch.Generator().manual_seed(5)
    pages = torch.randn(9, n_tail + n_state + 7, generator=g, dtype=torch.float64)   # 7: a page's padding
    conv = pages[:, :n_tail].view(9, *tail_shape)
    state = pages[:, n_tail:n_tail + n_state].view(9, *state_shape)
    rows = torch.tensor([6, 1, 4])
    y = torch.randn(3, t["w_in"].shape[0], generator=g, dtype=torch.float64)
    rope = None
    if s.rotated:
        positions = torch.tensor([3.0, 11.0, 7.0], dtype=torch.float64)
        angles = positions[:, None] * inverse_frequencies(layer, torch.float64)
        rope = (angles.cos()[:, None, :], angles.sin()[:, None, :])
    copies = {"conv_tail": conv[rows].clone(), "state": state[rows].clone()}
    want = fixed_state_between_kernel(y, rope, {**t, **copies}, s, decoder.core)
    before = pages.clone()
    got = fixed_state_between_kernel(y, rope, {**t, "conv_tail": conv, "state": state}, s, decoder.core, rows=rows)
    assert torch.equal(got, want)
    assert torch.equal(conv[rows], copies["conv_tail"]) and torch.equal(state[rows], copies["state"])
    others = [i for i in range(9) if i not in rows.tolist()]
    assert torch.equal(pages[others], before[others]) and not torch.equal(pages[rows], before[rows])
    with pytest.raises(RuntimeError, match=r"rows\[1\] = 9 is not a slot"):
        fixed_state_between_kernel(y, rope, {**t, "conv_tail": conv, "state": state}, s, decoder.core,
                                   rows=torch.tensor([0, 9, 2]))


@pytest.mark.parametrize("state_size", [16, 6])
@pytest.mark.parametrize("case", ["interdomain", "no query readout (contraction), dual input"])
def test_the_kernels_float32_path_equals_its_torch_reference(case, state_size):
    """float32 is the C++ core's vectorised path (AVX2: four modes a register, the tests above are
    float64): five steps of three slots from random states equal the torch ops' to float32's
    rounding, outputs and states; M 6 leaves a tail of modes past the last full register."""
    from megatron_id.model.mixers.decode import fixed_state_step
    model = tiny([*CASES[case], f"model.state_size={state_size}"], dtype=torch.float32, layers=1)
    decoder = FusedDecoder(model, slots=3, kernel="cpp")
    layer = decoder.layers[0]
    g = torch.Generator().manual_seed(7)
    for buffer in layer.buffers.values():
        buffer.copy_(torch.randn(buffer.shape, generator=g))
    ours = {**layer.tensors}
    reference = {**layer.tensors, **{k: v.clone() for k, v in layer.buffers.items()}}
    for step in range(5):
        x = torch.randn(3, model.cfg.d_model, generator=g)
        rope = None
        if layer.static.rotated:
            angles = torch.tensor([3.0, 11.0, 7.0])[:, None] * inverse_frequencies(layer, torch.float32) + step
            rope = (angles.cos()[:, None, :], angles.sin()[:, None, :])
        got = fixed_state_step(x, rope, ours, layer.static, decoder.core)
        want = fixed_state_step(x, rope, reference, layer.static)
        assert rel(got, want) < 1e-5, (step, rel(got, want))
        for name in layer.buffers:
            assert rel(ours[name], reference[name]) < 1e-5, (step, name, rel(ours[name], reference[name]))
