"""The fused decode step: the next token of B independent sequences ("slots") through every layer,
on buffers allocated once and updated in place (the form a CUDA graph captures), in as few ops
as the math allows. The model's own decode (LanguageModel.forward with states, one token) is the
reference it is tested against (tests/test_fused_decode.py): it rebuilds shapes, concatenates
caches and runs the interdomain core as a chain of small complex ops per layer, so at short
prefixes it is bound by op overhead, not arithmetic (issue 31).

Per slot: its own position (RoPE), its own state in every layer, its own length of KV cache
(softmax layers of hybrids), so a batch holds sequences of different prefix lengths without
padding, and a slot can be refilled while the others go on (continuous batching).

Each mixer brings its own step through its decode interface (model/mixers/decode.py: the facts,
the parameter-only tables, the per-slot buffers, loading a prefill's state, the step; the
interdomain state's real layout and readout are described there); this module composes them
with what is the model's: the blocks' norms and SwiGLU (its [w1 | w3] as one matrix), the
embedding and the head, RoPE's angles computed once per step for all layers, the slots'
positions, the kernel choice and torch.compile. It reads no mixer attribute beyond that
interface, and a model with a mixer that lacks it decodes through its own forward (eager).

On a CPU (float32/float64) everything between a fixed-state layer's two matrix products runs as
one C++ call (inference/cpu_kernel.py, csrc/fixed_state_step.cpp: the state read and written
once); decode.fixed_state_mixer is its reference and the path elsewhere (GPU, bf16, compile).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..model.accounting import report
from ..model.layers import rms_norm
from ..model.mixers.decode import fixed_state_mixer, fixed_state_mixer_kernel  # noqa: F401 (benchmarks time them)
from ..training.agreement import available_host_memory
from . import cpu_kernel  # (looked up at each use: tests replace its kernel)


class FusedDecodeError(UserError, ValueError):
    """A model or a request the fused step cannot take (the message says what to do)."""


def kv_cache_bytes(model, slots: int, capacity: int) -> tuple[int, int]:
    """(bytes, softmax layers) of the KV caches FusedDecoder allocates for `slots` sequences of
    up to `capacity` tokens: K and V per softmax layer, of the window's length for sliding-window
    layers (their size does not grow with `capacity`). Fixed-state layers: none."""
    total, layers = 0, 0
    for block in model.layers:
        mixer = block.mixer
        if not _has_decode(mixer) or mixer.decode_facts().fixed_size:
            continue
        # their sizes only, allocated on the meta device
        buffers = mixer.allocate_decode_state(slots, capacity, device="meta")
        total += sum(b.numel() * b.element_size() for b in buffers.values())
        layers += 1
    return total, layers


def available_memory(device) -> tuple[int | None, str]:
    """(bytes free for new tensors, what they are) on `device`: the GPU's free memory, or the
    host's MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    return available_host_memory(), "of host memory available"


# the share of the free memory a KV pool may take (the prefill's activations and logits need the rest)
KV_MEMORY_SHARE = 0.8


def slot_bytes(model) -> int:
    """Bytes per slot that do not depend on the context: the recurrent state of every
    interdomain / S4D-only layer (float32 real numbers) and a row of float32 logits."""
    counts = report(model.cfg)
    fixed_layers = sum(_has_decode(block.mixer) and block.mixer.decode_facts().fixed_size for block in model.layers)
    return 4 * (fixed_layers * (counts.state_per_token_per_layer or 0) + model.lm_head.weight.shape[0])


def check_kv_pool(model, slots: int, capacity: int, device, options: str, fix: str) -> None:
    """Refuse, before allocating, a decode pool (the KV caches of softmax layers, the recurrent
    states, the logits of a step) larger than KV_MEMORY_SHARE of the memory available on
    `device`: on a CPU torch hands out the pages lazily and the out-of-memory killer ends the
    process later, without a word. `options` names what sized it, `fix` what to lower."""
    kv, layers = kv_cache_bytes(model, slots, capacity)
    per_slot = slot_bytes(model)
    need = kv + slots * per_slot
    free, where = available_memory(device)
    if free is None or need <= KV_MEMORY_SHARE * free:
        return
    budget = KV_MEMORY_SHARE * free
    per_token = kv_cache_bytes(model, 1, 2)[0] - kv_cache_bytes(model, 1, 1)[0]   # grows with the context
    fixed = kv_cache_bytes(model, 1, 0)[0] + per_slot                              # per slot, any context
    tokens = int((budget - slots * fixed) // (per_token * slots)) if per_token else 0
    fitting_slots = int(budget // (fixed + per_token * capacity)) if fixed + per_token * capacity else 0
    if per_token and tokens >= 2:
        hint = f" (at most {tokens:,} tokens fit with {slots} slot(s))"
    elif fitting_slots >= 1:
        hint = f" (at most {fitting_slots:,} slot(s) fit)"
    else:
        hint = ""
    rest = slots * per_slot
    what = (f"the KV cache of the model's {layers} softmax layer(s) would take {kv / 2**30:,.1f} GiB ({kv:,} bytes, "
            f"allocated at start)" + (f" and the recurrent states and logits {rest / 2**30:,.1f} GiB more"
                                      if rest >= 0.05 * 2**30 else "")
            if kv else f"the recurrent states and logits of {slots:,} slot(s) would take {need / 2**30:,.1f} GiB "
                       f"({need:,} bytes, allocated at start)")
    raise FusedDecodeError(f"{options}: {what}, more than {KV_MEMORY_SHARE:.0%} of the {free / 2**30:,.1f} GiB "
                           f"{where}. {fix}{hint}.")


def _swiglu_residual(h, norm, eps, w13, w2):
    """h + SwiGLU(RMSNorm(h)) with the SwiGLU's w1 and w3 as one matrix [w1 | w3]."""
    a, b = (rms_norm(h, norm, eps) @ w13.T).chunk(2, dim=-1)
    return h + (F.silu(a) * b) @ w2.T


def fixed_state_block(h, rope, t: dict, s, eps: tuple, step, kernel=None):
    """A block with a fixed-size state (mixer and SwiGLU, with their norms and residuals): h [B, d]
    -> [B, d]; step: the mixer's decode_step, s its static facts; eps: the mixer norm's and the
    FFN norm's; kernel: the C++ core (cpu_kernel.fixed_state_step_kernel()), None for the torch
    ops. A plain function of tensors, so that one torch.compile serves every such layer."""
    x = rms_norm(h, t["mixer_norm"], eps[0])
    h = h + step(x, rope, t, s, kernel)
    return _swiglu_residual(h, t["ffn_norm"], eps[1], t["w13"], t["w2"])


DECODE_INTERFACE = ("decode_facts", "decode_tables", "allocate_decode_state", "load_decode_state", "decode_step")


def _has_decode(mixer) -> bool:
    """Whether a mixer offers the decode interface (model/mixers/decode.py); it is optional."""
    return all(hasattr(mixer, name) for name in DECODE_INTERFACE)


class _Layer:
    """One block for `slots` rows: its mixer's decode tables and per-slot buffers (through the
    mixer's decode interface only), and the block's norms and SwiGLU around them. `tensors` holds
    all of them in one dict (the form the step takes); `buffers` the per-slot ones."""

    def __init__(self, block, slots: int, capacity: int | None, real_update: bool):
        mixer = block.mixer
        self.facts = mixer.decode_facts()
        self.step, self._load = mixer.decode_step, mixer.load_decode_state
        try:   # (the mixers say what they cannot take as ValueError, without knowing this module)
            tables, self.static = mixer.decode_tables(real_update=real_update)
            self.buffers = mixer.allocate_decode_state(slots, capacity)
        except ValueError as e:
            raise FusedDecodeError(str(e)) from None
        self.eps = (block.mixer_norm.eps, block.ffn_norm.eps)
        around = {"mixer_norm": block.mixer_norm.weight, "ffn_norm": block.ffn_norm.weight,
                  "w13": torch.cat([block.ffn.w1.weight, block.ffn.w3.weight]), "w2": block.ffn.w2.weight}
        self.tensors = {**{k: v.detach() for k, v in around.items()}, **tables, **self.buffers}

    def load(self, slot: int, state: dict) -> None:
        """A prefill's state of one sequence (the mixer's own, batch 1)."""
        try:
            self._load(self.buffers, slot, state)
        except ValueError as e:
            raise FusedDecodeError(str(e)) from None

    def clear(self, slot: int) -> None:
        # every buffer, KV caches too: a stale value past a slot's length is masked out, but a
        # stale inf or NaN would still reach the output through its zero weight
        for buffer in self.buffers.values():
            buffer[slot].zero_()

    def move(self, source: int, target: int) -> None:
        for buffer in self.buffers.values():
            buffer[target] = buffer[source]

    def first(self, n: int) -> dict:
        """The tensors with the per-slot buffers cut to slots 0..n-1 (views: updates land in place)."""
        if n == next(iter(self.buffers.values())).shape[0]:
            return self.tensors
        return {**self.tensors, **{k: v[:n] for k, v in self.buffers.items()}}

    def mixer(self, x, rope, positions, lengths: list[int]):
        """A growing-cache mixer's step alone (benchmarks/decode_step.py): x [B, d] (normalised)."""
        return self.step(x, rope, self.first(x.shape[0]), self.static, positions, lengths)

    def __call__(self, h, rope, positions, lengths: list[int]):
        """A block whose cache grows (softmax, sliding window): h [B, d] -> [B, d]; lengths: the
        tokens each row holds after this one (host ints: no device sync per step)."""
        t = self.first(h.shape[0])
        h = h + self.step(rms_norm(h, t["mixer_norm"], self.eps[0]), rope, t, self.static, positions, lengths)
        return _swiglu_residual(h, t["ffn_norm"], self.eps[1], t["w13"], t["w2"])


class FusedDecoder:
    """Decode `slots` sequences at once with the fused step.

        decoder = FusedDecoder(model, slots=8, capacity=4096)
        logits, states = model(prompt, return_states=True)      # prefill (chunked), batch 1
        decoder.load(0, states, position=len(prompt))
        logits = decoder.step(tokens)                            # [slots] -> [slots, V]

    A step advances slots 0..n-1 (n = len(tokens)); the others wait, at no cost. `move` copies a
    sequence to another slot, so that a scheduler can keep the running ones first.
    capacity: the most tokens (prompt + generated) a sequence may reach, for the KV caches of
    softmax layers (hybrids); fixed-state models need none. compile: the interdomain / S4D-only
    blocks through torch.compile (one compiled function for all of them; the first step
    compiles, seconds to a minute). kernel: how the interdomain / S4D-only core runs: "cpp" one
    C++ call per layer (inference/cpu_kernel.py; CPU, float32/float64, built on first use),
    "torch" the torch ops, "auto" (the default) "cpp" where it applies and builds, else "torch";
    `self.kernel` says which was taken."""

    KERNELS = ("auto", "cpp", "torch")

    def __init__(self, model, slots: int = 1, capacity: int | None = None, compile: bool = False,
                 kernel: str = "auto"):
        if slots < 1:
            raise FusedDecodeError(f"slots={slots}: at least 1.")
        if kernel not in self.KERNELS:
            raise FusedDecodeError(f"kernel={kernel!r}: one of {', '.join(self.KERNELS)}.")
        why = fused_decode_refusal(model)
        if why:
            raise FusedDecodeError(f"{why}: decode this model with the model's own step (decode='eager').")
        self.slots, self.capacity = slots, capacity
        device = model.lm_head.weight.device
        if capacity is not None:   # before allocating (serve names its own options earlier)
            check_kv_pool(model, slots, capacity, device, f"{slots} sequence(s) of up to {capacity:,} tokens (prompt "
                          f"+ new tokens)", "Ask for fewer tokens (--max-new-tokens) or fewer sequences at once "
                          "(--batch-size)")
        self.layers = [_Layer(block, slots, capacity, real_update=compile) for block in model.layers]
        self.block = torch.compile(fixed_state_block, dynamic=False) if compile else fixed_state_block
        self.core, self.kernel = self._kernel(kernel, device, model.lm_head.weight.dtype, compile)
        # RoPE's (head dim, Rope) pairs in use: their angles once a step for all layers
        self.ropes = {layer.facts.rope for layer in self.layers if layer.facts.rope}
        self.rope_dtype = torch.promote_types(model.lm_head.weight.dtype, torch.float32)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.lengths = [0] * slots      # host copy of positions (no device sync per step)
        self.embed, self.lm_head = model.embed.weight.detach(), model.lm_head.weight.detach()
        self.norm_w, self.norm_eps = model.norm.weight.detach(), model.norm.eps
        self.unbounded = any(layer.facts.needs_capacity for layer in self.layers)

    def _kernel(self, wanted: str, device, dtype, compile: bool):
        """(the C++ core or None, "cpp" or "torch") for kernel=`wanted`."""
        if wanted == "torch" or not any(layer.facts.fixed_size for layer in self.layers):
            return None, "torch"
        why = ("compile=True runs the torch ops through torch.compile" if compile else
               f"the model is on {device.type}, not the CPU" if device.type != "cpu" else
               f"the model is {dtype}, not float32 or float64" if dtype not in (torch.float32, torch.float64)
               else None)
        if why is None:
            core = cpu_kernel.fixed_state_step_kernel()
            if core is not None:
                return core, "cpp"
            why = "the C++ kernel could not be built (the warning above says why)"
        if wanted == "cpp":
            raise FusedDecodeError(f"kernel='cpp' is not available here: {why}; use kernel='auto' or 'torch'.")
        return None, "torch"

    def load(self, slot: int, states: list, position: int) -> None:
        """Put a prefilled sequence into `slot`: `states` from model(prompt, return_states=True)
        (batch 1), `position` the tokens it holds."""
        if not 0 <= slot < self.slots:
            raise FusedDecodeError(f"slot {slot}: this decoder has slots 0 to {self.slots - 1}.")
        if len(states) != len(self.layers):
            raise FusedDecodeError(f"{len(states)} layer states for a model of {len(self.layers)} layers.")
        if self.unbounded and position >= self.capacity:
            raise FusedDecodeError(f"a prefix of {position} tokens leaves no room in a KV cache of "
                                   f"{self.capacity} tokens: give a larger capacity.")
        for i, (layer, state) in enumerate(zip(self.layers, states)):
            wanted = set(layer.facts.state_keys)
            if not isinstance(state, dict) or not wanted <= set(state):
                got = sorted(state) if isinstance(state, dict) else type(state).__name__
                raise FusedDecodeError(f"layer {i}'s state has {got}, not the {sorted(wanted)} of its "
                                       f"{layer.facts.name} mixer: "
                                       f"the states of another model?")
        with torch.no_grad():
            for layer, state in zip(self.layers, states):
                layer.load(slot, state)
        self.positions[slot] = position
        self.lengths[slot] = position

    def clear(self, slot: int) -> None:
        """Empty `slot` (its states zeroed, its position 0) for the next sequence."""
        for layer in self.layers:
            layer.clear(slot)
        self.positions[slot] = 0
        self.lengths[slot] = 0

    def move(self, source: int, target: int) -> None:
        """Copy slot `source`'s sequence into slot `target` (continuous batching keeps the running
        sequences in the first slots, so that a step computes only those)."""
        with torch.no_grad():
            for layer in self.layers:
                layer.move(source, target)
        self.positions[target] = self.positions[source]
        self.lengths[target] = self.lengths[source]

    def reorder(self, index: torch.Tensor) -> None:
        """Slot i continues from slot index[i] (beam search)."""
        index = index.to(self.positions.device)
        with torch.no_grad():
            for layer in self.layers:
                for buffer in layer.buffers.values():
                    buffer.copy_(buffer.index_select(0, index.to(buffer.device)))
        self.positions.copy_(self.positions.index_select(0, index))
        self.lengths = [self.lengths[i] for i in index.tolist()]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [n] (the next input token of slots 0..n-1, n <= slots) -> logits [n, V] after them.
        The other slots are left as they are (and cost nothing)."""
        n = tokens.shape[0] if tokens.dim() == 1 else 0
        if not 1 <= n <= self.slots:
            raise FusedDecodeError(f"step takes one token for each of the first n slots: shape (n,) with n from "
                                   f"1 to {self.slots}, not {tuple(tokens.shape)}.")
        if self.unbounded and max(self.lengths[:n]) >= self.capacity:
            raise FusedDecodeError(f"a sequence reached the KV cache's capacity of {self.capacity} tokens.")
        positions = self.positions[:n]
        rope = {}
        for Dh, spec in self.ropes:
            cos, sin = spec.angles(positions, Dh, self.rope_dtype)                   # [n, D/2]
            rope[(Dh, spec)] = (cos[:, None, :], sin[:, None, :])
        lengths = [length + 1 for length in self.lengths[:n]]
        h = self.embed[tokens]
        for layer in self.layers:
            angles = rope.get(layer.facts.rope) if layer.facts.rope else None
            if layer.facts.fixed_size:
                h = self.block(h, angles, layer.first(n), layer.static, layer.eps, layer.step, self.core)
            else:
                h = layer(h, angles, positions, lengths)
        positions += 1
        self.lengths[:n] = lengths
        return rms_norm(h, self.norm_w, self.norm_eps) @ self.lm_head.T


def fused_decode_refusal(model) -> str | None:
    """Why `model` has no fused decode step (None: it has one)."""
    for i, block in enumerate(model.layers):
        if not _has_decode(block.mixer):
            return f"layer {i}'s mixer ({type(block.mixer).__name__}) has no fused decode step"
    return None
