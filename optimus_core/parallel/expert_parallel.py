"""Expert parallelism without touching the model: ``parallelize(model, mesh)``.

    model = build_model(cfg)                 # identical on every rank (same seed)
    model = parallelize(model, mesh)         # each EP rank keeps n_experts / ep experts
    full = full_model_state(model, mesh)     # collective; the unsharded state dict (checkpoints)

The MoE layer still permutes its tokens by (global) expert and calls ``self.experts(x_sorted,
offsets)``; ``parallelize`` swaps that ``Experts`` for an ``ExpertParallelExperts`` holding only
this rank's slice of the weights. Its forward sends each expert's contiguous rows to the EP rank
that owns the expert (all-to-all, counts exchanged first), runs the local experts with the same
kernels, and sends the outputs back to where the rows came from, in the same order, so the
layer's unpermute / top-k combine is unchanged. Parameter names stay those of the plain model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..model.experts import Experts
from ..model.moe import MoEFeedForward
from .dispatch import all_to_all, exchange_counts, inverse_permutation, source_to_expert_order
from .mesh import Mesh


class ExpertParallelExperts(Experts):
    """This EP rank's experts ``[first, first + n_local)`` of ``n_experts`` plus the token exchange."""

    def __init__(self, full: Experts, mesh: Mesh):
        nn.Module.__init__(self)
        self.n_experts, self.backend = full.n_experts, full.backend
        self.ep, self.group = mesh.ep, mesh.ep_group
        self.n_local = full.n_experts // mesh.ep
        self.first = mesh.ep_rank * self.n_local
        local = slice(self.first, self.first + self.n_local)
        self.w_up = nn.Parameter(full.w_up.detach()[local].clone())
        self.w_down = nn.Parameter(full.w_down.detach()[local].clone())

    def forward(self, x_MD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        M = x_MD.shape[0]
        kept = int(offsets_E[-1]) if offsets_E.numel() else 0  # rows past it were dropped (capacity)
        counts_E = torch.diff(offsets_E.long(), prepend=offsets_E.new_zeros(1).long())
        send_counts_PE = counts_E.view(self.ep, self.n_local)  # rows sorted by expert: blocks per peer
        recv_counts_PE = exchange_counts(send_counts_PE, self.group)
        send_splits = send_counts_PE.sum(1).tolist()
        recv_splits = recv_counts_PE.sum(1).tolist()

        x_recv_RD = all_to_all(x_MD[:kept], recv_splits, send_splits, self.group)
        order_R = source_to_expert_order(recv_counts_PE)
        local_offsets = torch.cumsum(recv_counts_PE.sum(0), 0).to(torch.int32)
        y_local_RD = super().forward(x_recv_RD[order_R], local_offsets)
        y_recv_RD = y_local_RD[inverse_permutation(order_R)]
        y_MD = all_to_all(y_recv_RD, send_splits, recv_splits, self.group)
        if kept < M:
            y_MD = torch.cat([y_MD, y_MD.new_zeros(M - kept, *y_MD.shape[1:])])
        return y_MD

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A full (unsharded) checkpoint loads onto any EP rank: take this rank's experts.
        for name in ("w_up", "w_down"):
            value = state_dict.get(prefix + name)
            if value is not None and value.shape[0] == self.n_experts != self.n_local:
                state_dict[prefix + name] = value[self.first:self.first + self.n_local]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def parallelize(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Apply expert parallelism in place (a no-op for ep == 1 or a dense model); returns ``model``."""
    if mesh.ep == 1:
        return model
    for module in model.modules():
        if isinstance(module, MoEFeedForward) and not isinstance(module.experts, ExpertParallelExperts):
            module.experts = ExpertParallelExperts(module.experts, mesh)
    return model


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Names of the experts' weights (sharded by EP; synchronised over the expert-dp group)."""
    return {f"{mod_name}.{p_name}" if mod_name else p_name
            for mod_name, module in model.named_modules() if isinstance(module, Experts)
            for p_name, _ in module.named_parameters(recurse=False)}


def full_model_state(model: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on every rank (collective over each EP group when ep > 1).

    Gathering to every rank is fine at laptop scale; paper-scale checkpoints will be written
    sharded with torch.distributed.checkpoint instead (issue 6).
    """
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, ExpertParallelExperts):
            for p_name in ("w_up", "w_down"):
                key = f"{name}.{p_name}"
                local = state[key].contiguous()
                parts = [torch.empty_like(local) for _ in range(mesh.ep)]
                dist.all_gather(parts, local, group=mesh.ep_group)
                state[key] = torch.cat(parts)
    return state
