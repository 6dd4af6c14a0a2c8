"""The collectives of the two expert exchanges (optimus_core.parallel.expert_parallel), each
differentiable: its backward is the reverse exchange, carrying the gradients home.

The all-to-all (variable split sizes; the least traffic: a token goes only to the ranks of its
experts):

    recv_counts_P = exchange_counts(send_counts_P, group)          # how many rows each peer sends
    x_recv_RD = all_to_all(x_send_MD, recv_splits, send_splits, group)

Forward sends ``send_splits[r]`` rows to rank ``r`` of the group and receives ``recv_splits[s]``
from rank ``s``. Any split may be zero (a rank that routes nothing to another one's experts).

The paper's (GitHub IntelLabs/Optimus-LM): every rank's tokens gathered on every rank of the
group, each rank's partial outputs summed and scattered back; equal sizes on every rank, no
counts exchanged, no variable-size collective (which oneCCL's xccl mishandles with empty splits:
ALCF's AuroraBugTracking #111):

    x_GD = all_gather_rows(x_TD, group)        # (P * T, D); backward: reduce-scatter
    out_TD = reduce_scatter_rows(y_GD, group)  # the sum over the group, our T rows; backward: all-gather
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..timing import phase


def exchange_counts(send_counts_P: torch.Tensor, group) -> torch.Tensor:
    """Counts per peer: row ``p`` of the input (a number, or several) is what this rank sends to
    peer ``p``; row ``s`` of the output what peer ``s`` sends us."""
    recv_counts_P = torch.empty_like(send_counts_P)
    with phase("a2a"):
        dist.all_to_all_single(recv_counts_P, send_counts_P.contiguous(), group=group)
    return recv_counts_P


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, recv_splits, send_splits, group):
        ctx.recv_splits, ctx.send_splits, ctx.group = recv_splits, send_splits, group
        out_RD = x_MD.new_empty((sum(recv_splits), *x_MD.shape[1:]))
        with phase("a2a"):
            dist.all_to_all_single(out_RD, x_MD.contiguous(), recv_splits, send_splits, group=group)
        return out_RD

    @staticmethod
    def backward(ctx, grad_RD):
        # The reverse exchange: what we received from s goes back to s as its gradient.
        grad_MD = grad_RD.new_empty((sum(ctx.send_splits), *grad_RD.shape[1:]))
        with phase("a2a"):
            dist.all_to_all_single(grad_MD, grad_RD.contiguous(), ctx.send_splits, ctx.recv_splits,
                                   group=ctx.group)
        return grad_MD, None, None, None


def all_to_all(x_MD: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """Differentiable variable-size all-to-all of rows (first dim) over ``group``."""
    return _AllToAll.apply(x_MD, recv_splits, send_splits, group)


def _all_gather(x_TD: torch.Tensor, group) -> torch.Tensor:
    out = x_TD.new_empty((dist.get_world_size(group) * x_TD.shape[0], *x_TD.shape[1:]))
    with phase("a2a"):
        dist.all_gather_into_tensor(out, x_TD.contiguous(), group=group)
    return out


def _reduce_scatter(x_GD: torch.Tensor, group) -> torch.Tensor:
    out = x_GD.new_empty((x_GD.shape[0] // dist.get_world_size(group), *x_GD.shape[1:]))
    with phase("a2a"):
        dist.reduce_scatter_tensor(out, x_GD.contiguous(), group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, group):
        ctx.group = group
        return _all_gather(x_TD, group)

    @staticmethod
    def backward(ctx, grad_GD):
        # Every rank's copy of our rows got a gradient there: the sum comes home.
        return _reduce_scatter(grad_GD, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_GD, group):
        ctx.group = group
        return _reduce_scatter(x_GD, group)

    @staticmethod
    def backward(ctx, grad_TD):
        # Our block of the sum came from every rank's rows: each gets its gradient.
        return _all_gather(grad_TD, ctx.group), None


def all_gather_rows(x_TD: torch.Tensor, group) -> torch.Tensor:
    """Differentiable: every rank's ``x_TD`` (the same shape on each) stacked in rank order,
    (P * T, ...); the backward reduce-scatters the gradient, so each rank gets the sum over the
    group of its rows' gradients."""
    return _AllGather.apply(x_TD, group)


def reduce_scatter_rows(x_GD: torch.Tensor, group) -> torch.Tensor:
    """Differentiable: the sum over the group of every rank's ``x_GD`` (P * T rows, the same
    shape on each), this rank's block of T rows of it (rank order); the backward all-gathers the
    gradient."""
    return _ReduceScatter.apply(x_GD, group)
