"""Token dispatch and combine across an EP group: all_to_all_single with variable split sizes.

    recv_counts_P = exchange_counts(send_counts_P, group)          # how many rows each peer sends
    x_recv_RD = all_to_all(x_send_MD, recv_splits, send_splits, group)    # differentiable

Forward sends ``send_splits[r]`` rows to rank ``r`` of the group and receives ``recv_splits[s]``
from rank ``s``; backward is the same exchange reversed, carrying the gradients home. Any split
may be zero (a rank that routes nothing to another one's experts).
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
