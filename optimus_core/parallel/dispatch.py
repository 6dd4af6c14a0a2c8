"""Token dispatch and combine across an EP group: all_to_all_single with variable split sizes,
or (``parallel.dispatch = all_gather``) the same exchange made of all-gathers.

    recv_counts_P = exchange_counts(send_counts_P, group)          # how many rows each peer sends
    x_recv_RD = all_to_all(x_send_MD, recv_splits, send_splits, group)    # differentiable

    counts_PP = gather_counts(send_counts_P, group)     # all_gather: every rank's counts, [s, r]
    x_recv_RD = gather_exchange(x_send_MD, splits_PP, rank, group)        # differentiable

Forward sends ``send_splits[r]`` rows to rank ``r`` of the group and receives ``recv_splits[s]``
from rank ``s``; backward is the same exchange reversed, carrying the gradients home. Any split
may be zero (a rank that routes nothing to another one's experts).

The all-gather form exists for collective stacks whose variable all-to-all is missing or hangs
(public reports of some xccl builds; a torchtitan port to Aurora replaced it the same way): every
rank gathers every rank's send buffer, padded to the longest, and keeps the rows sent to it, so it
moves ``ep`` times the all-to-all's bytes. Its results are the all-to-all's, bit for bit.
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


def gather_counts(send_counts_P: torch.Tensor, group) -> torch.Tensor:
    """Every rank's counts: out[s, p] is what rank ``s`` of the group sends peer ``p``."""
    P, shape = dist.get_world_size(group), send_counts_P.shape
    out = send_counts_P.new_empty((P * shape[0], *shape[1:]))  # gloo wants the ranks along dim 0
    with phase("a2a"):
        dist.all_gather_into_tensor(out, send_counts_P.contiguous(), group=group)
    return out.view(P, *shape)


def _gathered_rows(x_MD: torch.Tensor, splits: list[list[int]], rank: int, group) -> torch.Tensor:
    """The rows each rank ``s`` sends ``rank`` (``splits[s][rank]`` of them, after its first
    ``sum(splits[s][:rank])``), in the order of s: every send buffer padded and gathered."""
    longest = max(sum(row) for row in splits)
    padded = x_MD.new_zeros((longest, *x_MD.shape[1:]))
    padded[:x_MD.shape[0]] = x_MD
    gathered = x_MD.new_empty((len(splits) * longest, *x_MD.shape[1:]))
    with phase("a2a"):
        dist.all_gather_into_tensor(gathered, padded, group=group)
    index = [s * longest + sum(row[:rank]) + i for s, row in enumerate(splits) for i in range(row[rank])]
    return gathered.index_select(0, torch.tensor(index, dtype=torch.long, device=x_MD.device))


class _GatherExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, splits, rank, group):
        ctx.splits, ctx.rank, ctx.group = splits, rank, group
        return _gathered_rows(x_MD, splits, rank, group)

    @staticmethod
    def backward(ctx, grad_RD):
        # The reverse exchange: the split matrix transposed (what s sent us goes back to s).
        back = [list(col) for col in zip(*ctx.splits)]
        return _gathered_rows(grad_RD.contiguous(), back, ctx.rank, ctx.group), None, None, None


def gather_exchange(x_MD: torch.Tensor, splits: list[list[int]], rank: int, group) -> torch.Tensor:
    """Differentiable all_to_all made of all-gathers: ``splits[s][r]`` rows go from rank ``s`` to
    rank ``r`` of ``group``; ``x_MD`` is this rank's (``rank``) send buffer, its rows for peer 0
    first. Returns the rows sent to this rank, those from peer 0 first, as all_to_all does."""
    return _GatherExchange.apply(x_MD, splits, rank, group)
