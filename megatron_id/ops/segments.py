"""Run a causal sequence function segment by segment, with a backward that recomputes.

Many pieces of a recurrent mixer are causal and local: a short conv needs the K-1 inputs before
a position, RoPE and norms need nothing, and the SSM needs only the state entering a segment.
Such a function can be evaluated on segments of the sequence in order, carrying a state, and
its backward can do the same in reverse: recompute one segment under autograd (from its saved
inputs, the `halo` inputs before it and the saved entering state), backpropagate that segment's
output gradient together with the gradient arriving at its exit state, and hand the gradient of
its entering state to the segment before. (A sequence of one segment keeps its graph from the
forward instead: nothing to bound, nothing recomputed.) Autograd then holds one segment's intermediates at a
time instead of the whole sequence's: memory is the inputs plus one segment, at any length.

This is gradient checkpointing (Chen et al. 2016) with the time axis cut instead of the depth
axis, as flash-linear-attention's chunk kernels do for linear attention (their state passing
between chunks); the segments here are many chunks long so that every op stays a large batched
matmul.

    outputs, end_state = run_in_segments(step, params, inputs, start_state,
                                         segment_tokens=512, halo=3)

step(params, window, lo, window_lo, state) -> (output [B, hi - lo, ...], next_state): `window`
are the inputs at tokens window_lo..hi-1 (window_lo = max(0, lo - halo)), each [B, w, ...] or
None; `params` are tensors step differentiates (tables, weights), passed explicitly so that the
backward can return their gradients. Inputs, output and gradients stay token-major.
"""
from __future__ import annotations

import torch


class _SegmentedRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, state, *tensors):
        step, n_params, n_tokens, segment_tokens, halo = spec
        params, inputs = tensors[:n_params], tensors[n_params:]
        bounds = [(lo, min(lo + segment_tokens, n_tokens)) for lo in range(0, n_tokens, segment_tokens)]
        # a single segment keeps its graph from here: there is nothing to bound, nothing to redo
        ctx.keep_graph = len(bounds) == 1
        out, starts = None, []
        for lo, hi in bounds:
            starts.append(state)
            window_lo = max(0, lo - halo)
            window = [None if x is None else x[:, window_lo:hi] for x in inputs]
            if not ctx.keep_graph:
                part, state = step(params, window, lo, window_lo, state)
            else:
                with torch.enable_grad():
                    leaves = _leaves(params, window, state)
                    part, end = step(leaves[0], leaves[1], lo, window_lo, leaves[2])
                ctx.last = (leaves, part, end)
                part, state = part.detach(), end.detach()
            if out is None:
                out = part.new_empty(part.shape[0], n_tokens, *part.shape[2:])
            out[:, lo:hi] = part
        ctx.spec, ctx.bounds, ctx.none_inputs = spec, bounds, [x is None for x in inputs]
        # the backward recomputes under the forward's autocast, as torch.utils.checkpoint does
        device = state.device.type
        ctx.autocast = dict(device_type=device, enabled=torch.is_autocast_enabled(device),
                            dtype=torch.get_autocast_dtype(device))
        ctx.save_for_backward(*params, *[x for x in inputs if x is not None], *starts)
        return out, state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_end):
        step, n_params, _, _, halo = ctx.spec
        saved = list(ctx.saved_tensors)
        params = saved[:n_params]
        present = iter(saved[n_params:])
        inputs = [None if none else next(present) for none in ctx.none_inputs]
        starts = saved[n_params + sum(not none for none in ctx.none_inputs):]
        grad_inputs = [torch.zeros_like(x) if _differentiable(x) else None for x in inputs]
        grad_params = [None] * n_params
        grad_state = grad_end
        for index in reversed(range(len(ctx.bounds))):
            lo, hi = ctx.bounds[index]
            window_lo = max(0, lo - halo)
            if ctx.keep_graph:
                leaves, part, end = ctx.last
                del ctx.last
            else:
                with torch.enable_grad(), torch.autocast(**ctx.autocast):
                    window = [None if x is None else x[:, window_lo:hi] for x in inputs]
                    leaves = _leaves(params, window, starts[index])
                    part, end = step(leaves[0], leaves[1], lo, window_lo, leaves[2])
            leaf_params, leaf_window, leaf_state = leaves
            wrt = [leaf_state, *leaf_params, *[x for x in leaf_window if _differentiable(x)]]
            got = torch.autograd.grad((part, end), wrt, (grad_out[:, lo:hi], grad_state), allow_unused=True)
            del part, end, leaves
            grad_state = got[0]
            for i, g in enumerate(got[1:1 + n_params]):
                if g is not None:
                    grad_params[i] = g if grad_params[i] is None else grad_params[i] + g
            window_grads = iter(got[1 + n_params:])
            for i, x in enumerate(inputs):
                if _differentiable(x):
                    g = next(window_grads)
                    if g is not None:   # halo tokens overlap the segment before: add, not copy
                        grad_inputs[i][:, window_lo:hi] += g
        return (None, grad_state, *grad_params, *grad_inputs)


def _differentiable(x) -> bool:
    """Inputs that get a gradient: float tensors (integer / bool inputs such as document
    boundaries travel with the segments as constants)."""
    return x is not None and x.is_floating_point()


def _leaves(params, window, state):
    """Detached tensors (no data copied) that a recomputation differentiates against."""
    leaf = lambda x: x.detach().requires_grad_() if _differentiable(x) else x
    return [leaf(p) for p in params], [leaf(x) for x in window], leaf(state)


def run_in_segments(step, params, inputs, state, *, segment_tokens: int, halo: int = 0):
    """See the module docstring. Returns (output [B, N, ...], the state after the last token)."""
    inputs = list(inputs)
    n_tokens = next(x for x in inputs if x is not None).shape[1]
    if segment_tokens < 1 or halo < 0:
        raise ValueError(f"segment_tokens={segment_tokens} must be >= 1 and halo={halo} >= 0")
    spec = (step, len(params), n_tokens, segment_tokens, halo)
    return _SegmentedRecompute.apply(spec, state, *params, *inputs)
