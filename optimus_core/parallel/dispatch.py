"""Token dispatch and combine across an EP group: all_to_all_single with variable split sizes.

    x_recv_RD = all_to_all(x_send_MD, recv_splits, send_splits, group)    # differentiable
    idx_R = source_to_expert_order(counts_SE)     # rows as received -> grouped by local expert

Forward sends ``send_splits[r]`` rows to rank ``r`` of the group and receives ``recv_splits[s]``
from rank ``s``; backward is the same exchange reversed, carrying the gradients home. Any split
may be zero (a rank that routes nothing to another one's experts).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def exchange_counts(send_counts_PE: torch.Tensor, group) -> torch.Tensor:
    """Row counts per (peer, local expert): row ``p`` of the input says how many rows this rank
    sends to each expert of peer ``p``; row ``s`` of the output what peer ``s`` sends us."""
    recv_counts_PE = torch.empty_like(send_counts_PE)
    dist.all_to_all_single(recv_counts_PE, send_counts_PE.contiguous(), group=group)
    return recv_counts_PE


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, recv_splits, send_splits, group):
        ctx.recv_splits, ctx.send_splits, ctx.group = recv_splits, send_splits, group
        out_RD = x_MD.new_empty((sum(recv_splits), *x_MD.shape[1:]))
        dist.all_to_all_single(out_RD, x_MD.contiguous(), recv_splits, send_splits, group=group)
        return out_RD

    @staticmethod
    def backward(ctx, grad_RD):
        # The reverse exchange: what we received from s goes back to s as its gradient.
        grad_MD = grad_RD.new_empty((sum(ctx.send_splits), *grad_RD.shape[1:]))
        dist.all_to_all_single(grad_MD, grad_RD.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return grad_MD, None, None, None


def all_to_all(x_MD: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """Differentiable variable-size all-to-all of rows (first dim) over ``group``."""
    return _AllToAll.apply(x_MD, recv_splits, send_splits, group)


def source_to_expert_order(counts_SE: torch.Tensor) -> torch.Tensor:
    """Gather index that regroups rows laid out source-major (for s: for e: counts[s, e] rows)
    into expert-major order (for e: for s: ...), so each local expert's rows are contiguous.

    >>> source_to_expert_order(torch.tensor([[1, 2], [0, 1]]))
    tensor([0, 1, 2, 3])
    >>> source_to_expert_order(torch.tensor([[2, 1], [1, 0]]))
    tensor([0, 1, 3, 2])
    """
    counts = counts_SE.flatten()
    starts_SE = (torch.cumsum(counts, 0) - counts).view_as(counts_SE)
    seg_starts, seg_counts = starts_SE.T.flatten(), counts_SE.T.flatten()
    total = int(seg_counts.sum())
    seg_first_out = torch.cumsum(seg_counts, 0) - seg_counts  # where each segment lands
    within = torch.arange(total, device=counts_SE.device) - torch.repeat_interleave(seg_first_out, seg_counts)
    return torch.repeat_interleave(seg_starts, seg_counts) + within


def inverse_permutation(idx_R: torch.Tensor) -> torch.Tensor:
    inv_R = torch.empty_like(idx_R)
    inv_R[idx_R] = torch.arange(idx_R.numel(), device=idx_R.device)
    return inv_R
