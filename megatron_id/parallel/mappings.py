"""Autograd pairs that move activations in and out of a tensor-parallel region (Megatron's
mappings). Each forward has the backward that makes gradients exact:

    copy_to_region          fwd identity             bwd all-reduce
    reduce_from_region      fwd all-reduce           bwd identity
    gather_from_region      fwd all-gather (dim)     bwd keep own slice
    gather_from_sequence    fwd all-gather (seq)     bwd reduce-scatter      (sequence parallel)
    reduce_scatter_to_sequence  fwd reduce-scatter   bwd all-gather          (sequence parallel)

All take the process group explicitly; with a group of one rank they are identities.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _all_reduce(x, group):
    if _size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x, dim, group):
    n = _size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _split(x, dim, group):
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {n} ranks")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter(x, dim, group):
    if _size(group) == 1:
        return x
    if dist.get_backend(group) == "nccl":
        n = _size(group)
        x = x.movedim(dim, 0).contiguous()
        out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
        return out.movedim(0, dim)
    return _split(_all_reduce(x, group), dim, group)   # gloo has no reduce-scatter


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    """All-gather forward; backward keeps this rank's slice of the gradient, or (sequence
    parallel, where every rank's copy fed a different computation) reduce-scatters it."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce_grad):
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        take = _reduce_scatter if ctx.reduce_grad else _split
        return take(grad, ctx.dim, ctx.group), None, None, None


class _Scatter(torch.autograd.Function):
    """Keep this rank's slice forward (reduce-scattering first when `reduce` is set: partial
    sums from a row-parallel layer); backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group) if reduce else _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None, None


def copy_to_region(x, group):
    return _Copy.apply(x, group)


def reduce_from_region(x, group):
    return _Reduce.apply(x, group)


def gather_from_region(x, group, dim=-1):
    return _Gather.apply(x, group, dim % x.dim(), False)


SEQUENCE_DIM = 1   # activations are [batch, sequence, hidden]


def gather_from_sequence(x, group):
    return _Gather.apply(x, group, SEQUENCE_DIM, True)


def reduce_scatter_to_sequence(x, group):
    return _Scatter.apply(x, group, SEQUENCE_DIM, True)

