"""Context parallelism: one sequence split into C contiguous blocks, one block per rank.

For the interdomain and S4D mixers this is cheap, because the state is fixed-size and the
transition over a whole block of L tokens is the diagonal lambda^L:

  1. each rank computes its block's end state from a zero state (the carry alone, linear in
     k and v: ops/interdomain/chunked.block_end_state);
  2. the end states (heads x M x (R + d_h) complex numbers per row, small) are all-gathered, and
     each rank combines those before it, an exclusive scan:
         E_j = survives_j lambda^L (.) E_{j-1} + end_j,     incoming_c = E_{c-1}
     (survives_j = 0 when a packed document starts inside block j);
  3. each rank runs its block with the incoming state as the initial state.
The short convs need the previous block's last K-1 inputs, which travel the same way. Every
exchange is differentiable: the backward sums each rank's gradient with respect to the
gathered tensors and hands each rank the part for its own (`gather`), so gradients flow
between blocks exactly as along one sequence. Softmax attention all-gathers K and V (the
simple scheme the issue allows; no ring).

Megatron-LM's context parallelism (and FLA's for GDN/KDA) split attention the same way; the
state-passing form here follows the chunked algorithm's own carry, applied across ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import UserError


@dataclass(frozen=True)
class ContextParallel:
    """The context-parallel group of this rank: its block is tokens rank*L .. (rank+1)*L - 1.
    Set on a mixer (its `context_parallel` attribute, `apply_context_parallel`), it is all the
    mixer sees of the other ranks: the methods below, so the model code imports no parallelism."""
    group: object
    rank: int
    size: int

    def gather(self, x):
        return gather(x, self)

    def fresh_start(self, seq_idx):
        return fresh_start(seq_idx, self)

    def previous_tail(self, x, width: int):
        return previous_tail(x, width, self)

    def incoming_state(self, block_end, transition, survives, initial=None, final=False):
        return incoming_state(block_end, transition, survives, self, initial, final)

    def last_tail(self, x, width: int):
        return last_tail(x, width, self)


def apply_context_parallel(model, cp: ContextParallel | None):
    """Every mixer of `model` runs its rank's block of the sequence (None: whole sequences). A
    mixer runs context parallel when it has a `context_parallel` attribute (docs/adding-a-mixer.md);
    one without is an error here, not a model that silently sees only its own block."""
    if cp is not None:
        missing = sorted({type(layer.mixer).__name__ for layer in getattr(model, "layers", [])
                          if not hasattr(layer.mixer, "context_parallel")})
        if missing:
            raise UserError(f"parallel.context_parallel_size={cp.size}: the mixer {', '.join(missing)} does not "
                            f"run context parallel (it has no context_parallel attribute); set "
                            f"parallel.context_parallel_size=1, or see docs/adding-a-mixer.md.")
    for module in model.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = cp
    return model


class _Gather(torch.autograd.Function):
    """all_gather along a new leading dim; backward: every rank's gradient for the gathered
    tensor summed (one all_reduce), this rank's slice returned. Works on gloo (no reduce_scatter)."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x.contiguous(), group=cp.group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.cp.group)
        return grad[ctx.cp.rank], None


def gather(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[C, *x.shape]: every rank's x, differentiable (complex tensors travel as real pairs)."""
    if x.is_complex():
        return torch.view_as_complex(_Gather.apply(torch.view_as_real(x), cp))
    if not x.is_floating_point():
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x.contiguous(), group=cp.group)
        return torch.stack(parts)
    return _Gather.apply(x, cp)


def fresh_start(seq_idx: torch.Tensor | None, cp: ContextParallel) -> torch.Tensor | None:
    """[B] bool: this block's first token begins a new document (its seq_idx differs from the
    previous block's last): nothing from earlier blocks may reach it. None without documents."""
    if seq_idx is None:
        return None
    last = gather(seq_idx[:, -1], cp)                                   # [C, B]
    if cp.rank == 0:
        return torch.zeros_like(seq_idx[:, 0], dtype=torch.bool)
    return seq_idx[:, 0] != last[cp.rank - 1]


def _pick(stacked: torch.Tensor, weights: list) -> torch.Tensor:
    """sum_j weights[j] * stacked[j], touching every slice. Every rank's backward must reach
    every gather's backward (each holds an all_reduce the other ranks wait in), so a rank that
    needs none of the gathered slices (the first one) still uses them, times zero."""
    w = torch.tensor(weights, dtype=stacked.real.dtype, device=stacked.device)
    return (stacked * w.view(-1, *[1] * (stacked.dim() - 1))).sum(0)


def _block_tail(x: torch.Tensor, width: int, cp: ContextParallel, block: int) -> torch.Tensor:
    """Block `block`'s last `width` tokens of x [B, L, ...] on every rank (zeros for a block
    outside 0..C-1), differentiable."""
    tails = gather(x[:, x.shape[1] - width:], cp)
    return _pick(tails, [1.0 if j == block else 0.0 for j in range(cp.size)])


def previous_tail(x: torch.Tensor, width: int, cp: ContextParallel) -> torch.Tensor:
    """The previous block's last `width` tokens of x [B, L, C] (zeros on the first rank), for
    the short convs' window; differentiable."""
    return _block_tail(x, width, cp, cp.rank - 1)


def incoming_state(block_end: torch.Tensor, transition: torch.Tensor, survives: torch.Tensor | None,
                   cp: ContextParallel, initial: torch.Tensor | None = None, final: bool = False):
    """The state entering this rank's block, [B, H, M, P] (complex for the interdomain mixer; any
    float state of that layout, docs/adding-a-mixer.md). block_end: this block's end state from
    zero; transition [H, M]: lambda^L over one block; survives [B] (float, 0/1) or
    None: whether a state entering this block reaches its end (no document starts in it).
    initial: the state entering the first block (data.carry_state: the previous window's end),
    None for zero. final: also return the state after the last block (the same on every rank)."""
    ends = gather(block_end, cp)                                        # [C, B, H, M, P]
    keep = None if survives is None else gather(survives, cp)           # [C, B]
    state = torch.zeros_like(block_end) if initial is None else initial.to(block_end.dtype)
    lam = transition.to(block_end.dtype)[None, :, :, None]
    # every rank runs the same scan over all C blocks and picks its own entry with weights (no
    # branch on the rank): the backward graphs are then alike, so every rank reaches the
    # gathers' all_reduces in the same order (a rank-dependent graph may order them otherwise)
    entering = []
    for j in range(cp.size):
        entering.append(state)
        carried = lam * state
        if keep is not None:
            carried = carried * keep[j][:, None, None, None]
        state = carried + ends[j]
    incoming = _pick(torch.stack(entering), [1.0 if j == cp.rank else 0.0 for j in range(cp.size)])
    return (incoming, state) if final else incoming


def last_tail(x: torch.Tensor, width: int, cp: ContextParallel) -> torch.Tensor:
    """The last block's last `width` tokens of x [B, L, ...], on every rank (differentiable):
    what the whole sequence leaves its short convs."""
    return _block_tail(x, width, cp, cp.size - 1)


def split_sequence(x: torch.Tensor, cp: ContextParallel, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous block of x along `dim` (the length must divide by C)."""
    n = x.shape[dim]
    if n % cp.size:
        raise ValueError(f"a sequence of {n} tokens does not split into {cp.size} equal blocks "
                         f"(parallel.context_parallel_size): choose a length divisible by it")
    block = n // cp.size
    return x.narrow(dim, cp.rank * block, block)
