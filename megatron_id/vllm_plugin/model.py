"""The export's model in vLLM: megatron_id's own LanguageModel (the training code, weights loaded
from the export's model.safetensors as they are), with each layer's mixer run against vLLM's
state and KV cache:

- interdomain and S4D-only layers (FixedStateLayer): the state a sequence carries, the complex
  S4D state and the short convs' tails, lives in vLLM's per-request state slots (a Mamba-style
  layer: vLLM allocates, frees and, with prefix caching, copies the slots). Each engine step's
  decodes go through the mixer's fused decode step (model/mixers/decode.py, the C++ core on a
  CPU) on their slots at once; each prefill, whole or a chunk of a longer prompt, through the
  mixer's own chunked form, starting from the slot's state when it continues one.
- softmax and sliding-window layers (AttentionLayer): the mixer's projections and RoPE, then
  vLLM's paged attention over vLLM's KV cache.

Norms, SwiGLU, the embedding and the head are the LanguageModel's modules, called as its blocks
call them. Tensor and pipeline parallelism are not supported here (one process; the export's
tensor-parallel serving is megatron-id serve's).
"""
from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMambaPrefixCaching
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..inference import batching
from ..model.language_model import LanguageModel
from ..model.layers import apply_rope
from ..model.mixers.decode import fixed_state_between_kernel, state_dtype
from ..model.mixers.interdomain import InterdomainMixer
from ..model.roles import Group, names_in_group
from ..model.spec import model_config_from_values
from . import BACKEND
from .limits import check_servable


def is_fixed_state(mixer) -> bool:
    return hasattr(mixer, "decode_facts") and mixer.decode_facts().fixed_size


def state_shapes(cfg) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(conv tails [C, K-1], state [H, 2 Dh, 2M]) of every fixed-state layer of the model (None:
    it has none), from the mixers' own decode buffers (model/mixers/decode.py) on the meta
    device. The layers of a hybrid may convolve different projections (an I layer's q, k or
    q, a, b, an S layer's a, b): every slot is allocated for the widest, a layer uses its own
    first channels, so that all of them share one state spec (one group of vLLM's cache)."""
    with torch.device("meta"):
        model = LanguageModel(cfg, seed=None)
    buffers = [block.mixer.allocate_decode_state(1, device="meta") for block in model.layers
               if is_fixed_state(block.mixer)]
    if not buffers:
        return None
    channels = max(b["conv_tail"].shape[1] for b in buffers)
    return (channels, buffers[0]["conv_tail"].shape[2]), tuple(buffers[0]["state"].shape[1:])


class FixedStateLayer(MambaBase, nn.Module):
    """An interdomain / S4D-only layer's mixer against vLLM's state slots (see the module's text).
    The mixer is the LanguageModel's (held, not registered: its parameters are loaded there)."""

    def __init__(self, mixer, prefix: str, shapes, dtypes):
        super().__init__()
        self._mixer = [mixer]
        self.prefix, self.shapes, self.dtypes = prefix, shapes, dtypes
        self.convolved = [f"{name}_conv" for name in mixer._decode_convolved()]
        self.widths = [getattr(mixer, name).weight.shape[0] for name in self.convolved]
        self.tables = None   # the decode step's parameter-only tables: built at the first decode
        self._pages = self._pages_for = None   # the tables and vLLM's page views in one dict, per cache
        self.linears = None
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    # what vLLM reads of a Mamba-style layer
    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self):
        return self.dtypes

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum[BACKEND]

    @property
    def mixer(self):
        return self._mixer[0]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step: dict | None = None) -> torch.Tensor:
        """x [T, d]: the engine step's tokens, normalised (the decodes' first, then each
        prefill's), positions [T] -> the mixer's output [T, d]. step: what the engine step's
        layers share (the decodes' slots and RoPE tables, computed by the first layer that needs them)."""
        step = {} if step is None else step
        metadata = get_forward_context().attn_metadata
        m = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if m is None:   # vLLM's profiling and warm-up runs: no request, no state
            return self.mixer(x[None])[0]
        decodes = m.num_decode_tokens
        if m.num_decodes:   # the slots of this layer's cache group (a hybrid's state layers may be in several)
            key = ("slots", id(m.state_indices_tensor_d))
            if key not in step:   # (vLLM gives [decodes, 1 + speculative slots]: the first is the request's)
                slots = m.state_indices_tensor_d
                step[key] = (slots[:, 0] if slots.dim() == 2 else slots)[:m.num_decodes].to(torch.long).contiguous()
            slots = step[key]
        if m.num_decodes and not m.num_prefills and decodes == x.shape[0]:   # a step of decodes only
            return self.decode(x, positions, slots, step)
        out = torch.zeros_like(x)   # (tokens past the requests' own, if vLLM pads the step)
        if m.num_decodes:
            out[:decodes] = self.decode(x[:decodes], positions[:decodes], slots, step)
        if m.num_prefills:
            bounds = (m.query_start_loc_p[:m.num_prefills + 1] + decodes).tolist()
            slots = m.state_indices_tensor_p[:m.num_prefills].tolist()
            continues = m.has_initial_states_p[:m.num_prefills].tolist()
            firsts = positions[bounds[:-1]].tolist()
            fresh = []   # prompts from their first token: batched below
            for (a, b), slot, cont, first in zip(zip(bounds, bounds[1:]), slots, continues, firsts):
                if not cont and first == 0:
                    fresh.append((a, b, slot))
                else:
                    self.prefill_one(x, positions, a, b, slot, cont, out)
            for group in batching.padded_groups(fresh, length=lambda p: p[1] - p[0]):   # (from, to, slot)
                self.prefill_together(x, positions, group, out)
        return out

    def prefill_one(self, x, positions, a: int, b: int, slot: int, cont: bool, out: torch.Tensor) -> None:
        """Tokens a..b of one prompt, from its slot's state when it continues one, into out[a:b]."""
        y, state = self.mixer(x[None, a:b], state=self.read(slot) if cont else None, return_state=True,
                              position_ids=positions[None, a:b])
        out[a:b] = y[0]
        self.write(slot, state)

    def prefill_together(self, x: torch.Tensor, positions: torch.Tensor, group: list[tuple[int, int, int]],
                         out: torch.Tensor) -> None:
        """Prompts that start from nothing, (token from, token to, slot) each, as one left-padded
        batch of the mixer's chunked form (`start`: each row's first real token, the rows' states
        untouched by their padding, as megatron-id generate batches prompts): one call for many
        short prompts instead of one each (32 prompts of 8 tokens were 32 calls a layer, ~0.45 s of
        one engine step, torch's profiler)."""
        if len(group) == 1:
            (a, b, slot), = group
            self.prefill_one(x, positions, a, b, slot, False, out)
            return
        longest = max(b - a for a, b, _ in group)
        rows = x.new_zeros(len(group), longest, x.shape[-1])
        starts = [longest - (b - a) for a, b, _ in group]
        for row, (a, b, _), start in zip(rows, group, starts):
            row[start:] = x[a:b]
        y, state = self.mixer(rows, return_state=True, start=torch.tensor(starts, device=x.device))
        for j, ((a, b, slot), start) in enumerate(zip(group, starts)):
            out[a:b] = y[j, start:]
            self.write(slot, {"ssm": state["ssm"][j:j + 1],
                              "conv": {name: tail[j:j + 1] for name, tail in state["conv"].items()}})

    def slot_views(self) -> dict:
        """The slots as the mixer's decode buffers (views: writes land in vLLM's cache)."""
        conv, state = self.kv_cache
        return {"conv_tail": conv[:, :sum(self.widths)], "state": state}

    def read(self, slot: int) -> dict:
        """A slot as the state the mixer's forward continues from (the inverse of the mixer's
        load_decode_state: S [H, P, 2M], Re and Im side by side -> X [1, H, M, P] complex)."""
        buffers = self.slot_views()
        S = buffers["state"][slot]
        X = torch.view_as_complex(S.reshape(*S.shape[:-1], -1, 2).contiguous()).transpose(-1, -2)
        tails = buffers["conv_tail"][slot].split(self.widths)
        return {"ssm": X[None].contiguous(), "conv": {name: t[None].clone() for name, t in zip(self.convolved, tails)},
                "pos": 0, "tables": None}

    def write(self, slot: int, state: dict) -> None:
        self.mixer.load_decode_state(self.slot_views(), slot, state)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, step: dict) -> torch.Tensor:
        """One token of each decoding request (its slot in `slots`) through the fused step: the C++
        core on vLLM's pages in place, or the torch ops on copies of the slots written back after."""
        if self.tables is None:
            self.tables, self.static = self.mixer.decode_tables()
            rope = self.mixer.decode_facts().rope
            self.rope_key = ("rope", rope)
            self.rope = rope
            self.kernel = fixed_state_kernel(x)
            self.linears = ((cpu_linear(self.tables["w_in"]), cpu_linear(self.tables["o_proj"]))
                            if current_platform.is_cpu() else None)
        rope = None
        if self.rope is not None:   # the layers of a model share their RoPE: its tables once a step
            if self.rope_key not in step:
                head_dim, spec = self.rope
                cos, sin = spec.angles(positions, head_dim, state_dtype(x.dtype))
                step[self.rope_key] = (cos[:, None, :].contiguous(), sin[:, None, :].contiguous())
            rope = step[self.rope_key]
        if self.kernel is not None and self.linears is not None:
            # the C++ core between vLLM's GEMMs, on the requests' slots in vLLM's pages in place
            # (the tables and the page views in one dict, made again only if vLLM replaces its cache)
            if self._pages_for is not self.kv_cache:
                self._pages, self._pages_for = {**self.tables, **self.slot_views()}, self.kv_cache
            w_in, o_proj = self.linears
            return o_proj(fixed_state_between_kernel(w_in(x), rope, self._pages, self.static, self.kernel, rows=slots))
        # the torch ops take slots 0..B-1 of contiguous buffers: copies of the requests' slots, slot
        # by slot (each is contiguous in vLLM's pages, the slots are not: at 8 slots of d 256, 150 us
        # a layer both ways, against 500 for one indexed copy each way), written back after
        rows, buffers = slots.tolist(), self.slot_views()
        t = {**self.tables, **{name: torch.stack([buffer[i] for i in rows]) for name, buffer in buffers.items()}}
        y = self.mixer.decode_step(x, rope, t, self.static, self.kernel)
        for name, buffer in buffers.items():
            for j, i in enumerate(rows):
                buffer[i].copy_(t[name][j])
        return y


def fixed_state_kernel(x: torch.Tensor):
    """megatron_id's C++ core of the decode step where it applies (a CPU, float32/float64), as
    megatron-id generate decodes; else None (the torch ops: the same math)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return None
    from ..inference import cpu_kernel
    return cpu_kernel.fixed_state_step_kernel()


def cpu_linear(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [..., K] -> x @ weight.T (+ bias) by vLLM's CPU GEMM: oneDNN with the weight prepacked once
    (vLLM's own linear layers use it on a CPU). Measured here, 1 thread, [8, 256] x [256, 50257]
    (the LM head at 8 streams): 3.7 ms against torch's 10.9; the layers' projections 1.2-1.5x."""
    holder = SimpleNamespace(weight=weight.detach(), bias=None if bias is None else bias.detach())
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)

    def linear(x):
        out = holder.cpu_linear(x.reshape(-1, x.shape[-1]), holder.weight, holder.bias)
        return out.view(*x.shape[:-1], out.shape[-1])
    return linear


class AttentionLayer(nn.Module):
    """A softmax (or sliding-window) layer's mixer: its projections and RoPE, then vLLM's
    attention over vLLM's paged KV cache."""

    def __init__(self, mixer, prefix: str, cache_config):
        super().__init__()
        self._mixer = [mixer]
        Dh = mixer.head_dim
        self.head_dim = Dh
        self.attn = Attention(mixer.q_proj.weight.shape[0] // Dh, Dh, Dh ** -0.5,
                              num_kv_heads=mixer.k_proj.weight.shape[0] // Dh, cache_config=cache_config,
                              per_layer_sliding_window=mixer.window, prefix=prefix)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step: dict | None = None) -> torch.Tensor:
        m = self._mixer[0]
        q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
        if m.rope:   # the model's own RoPE (half-split, as vLLM's neox style), at vLLM's positions
            T = x.shape[0]
            q = apply_rope(q.view(1, T, -1, self.head_dim), positions[None], m.rope_spec).view(T, -1)
            k = apply_rope(k.view(1, T, -1, self.head_dim), positions[None], m.rope_spec).view(T, -1)
        return m.o_proj(self.attn(q, k, v))


class MegatronIDForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsMambaPrefixCaching):
    """vLLM's model for architecture MegatronIDForCausalLM (registered by vllm_plugin.register)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        cfg = model_config_from_values(vllm_config.model_config.hf_config.model)
        check_servable(cfg, vllm_config)
        self.cfg = cfg
        self.model = LanguageModel(cfg, form="chunked", seed=None)
        # the SSM parameters stay float32 in a bf16/fp16 model, as the Hugging Face export keeps
        # them (hf/modeling_megatron_id.py): rounding Delta, A or C changes every output
        ssm = set(names_in_group(InterdomainMixer, Group.SSM))
        for name, parameter in self.model.named_parameters():
            if ".mixer." in name and name.rsplit(".", 1)[-1] in ssm:
                parameter.data = parameter.data.float()
        self.ffn_linears = None   # on a CPU, after loading: each block's SwiGLU on vLLM's GEMM
        shapes = state_shapes(cfg)
        dtypes = self.get_mamba_state_dtype_from_config(vllm_config)
        head = f"{prefix}." if prefix else ""
        self.mixing = nn.ModuleList(
            FixedStateLayer(block.mixer, f"{head}model.layers.{i}.mixer", shapes, dtypes)
            if is_fixed_state(block.mixer) else
            AttentionLayer(block.mixer, f"{head}model.layers.{i}.mixer.attn", vllm_config.cache_config)
            for i, block in enumerate(self.model.layers))

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return state_shapes(model_config_from_values(vllm_config.model_config.hf_config.model))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
        """The conv tails in the model's dtype, the recurrent state in float32 (float64 in a
        float64 model), as the fused decode step keeps them."""
        dtype = vllm_config.model_config.dtype
        return dtype, state_dtype(dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        """Prefix caching copies a slot whole: both tensors are the state after a token."""
        return get_temporal_copy_spec, get_temporal_copy_spec

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The LanguageModel's blocks (model/language_model.py: h + mixer(norm(h)), then
        h + SwiGLU(norm(h))) on the engine step's tokens [T]; returns the final norm's output."""
        h = self.model.embed(input_ids) if inputs_embeds is None else inputs_embeds
        step = {}
        if self.ffn_linears is not None:
            return self._forward_cpu(h, positions, step)
        for block, mixing in zip(self.model.layers, self.mixing):
            h = h + mixing(block.mixer_norm(h), positions, step)
            h = h + block.ffn(block.ffn_norm(h))
        return self.model.norm(h)

    def _forward_cpu(self, h: torch.Tensor, positions: torch.Tensor, step: dict) -> torch.Tensor:
        """The same blocks on a CPU with vLLM's fused ops, as its own Llama runs: RMSNorm, the
        residual's add with the next RMSNorm (`fused_add_rms_norm`: residual += x, x = norm(residual),
        in place), the SwiGLU's [w1 | w3] as one GEMM and its SiLU-and-product in one op. The same
        math as the blocks' (the float32 sum of squares in another order)."""
        ops = torch.ops._C
        residual = h.clone()   # (the embedding's rows may be a view of its table)
        x = torch.empty_like(residual)
        ops.rms_norm(x, residual, self.model.layers[0].mixer_norm.weight, self.model.layers[0].mixer_norm.eps)
        for i, (block, mixing) in enumerate(zip(self.model.layers, self.mixing)):
            x = mixing(x, positions, step).contiguous()
            ops.fused_add_rms_norm(x, residual, block.ffn_norm.weight, block.ffn_norm.eps)
            w13, w2 = self.ffn_linears[i]
            ab = w13(x)
            x = torch.empty(ab.shape[0], ab.shape[1] // 2, dtype=ab.dtype)
            ops.silu_and_mul(x, ab)
            x = w2(x)
            norm = self.model.layers[i + 1].mixer_norm if i + 1 < len(self.model.layers) else self.model.norm
            ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """model.safetensors as export-hf wrote it: the LanguageModel's state under `model.`.
        A tensor this model has no parameter for is refused by name (nothing is dropped)."""
        parameters = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in parameters:
                raise ValueError(f"the export's weights have {name!r}, which this model has no parameter for: "
                                 f"an export of another megatron_id version, or a changed model section in "
                                 f"config.json? Export the checkpoint again with this megatron_id (megatron-id "
                                 f"export-hf).")
            target = parameters[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"the export's {name} is {tuple(tensor.shape)}, the model built from config.json "
                                 f"expects {tuple(target.shape)}: config.json and model.safetensors disagree.")
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(name)
        if current_platform.is_cpu():   # every projection and the LM head on vLLM's CPU GEMM
            for module in self.model.modules():
                if isinstance(module, nn.Linear):
                    module.forward = cpu_linear(module.weight, module.bias)
            self.ffn_linears = [(cpu_linear(torch.cat([block.ffn.w1.weight, block.ffn.w3.weight])),
                                 cpu_linear(block.ffn.w2.weight)) for block in self.model.layers]
        # vLLM's own parameters (its attention layers' scales, if any) keep their defaults
        return loaded | {name for name in parameters if not name.startswith("model.")}
