"""The MoE feed-forward: route, (optionally) drop over capacity, permute, experts, combine."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import MoEConfig
from .experts import Experts
from .router import TopKRouter


def capacity_keep_mask(topk_idx_TK: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """True for the assignments that fit: each expert keeps its first ``capacity`` in token order."""
    flat = topk_idx_TK.flatten()
    one_hot = torch.nn.functional.one_hot(flat, n_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # rank of this assignment in its expert
    return (position < capacity).view_as(topk_idx_TK)


class MoEFeedForward(nn.Module):
    """Drop-in for the dense SwiGLU: same input and output, plus auxiliary losses and load stats.

    After each forward, ``last_z_loss`` holds the unscaled router z-loss,
    ``last_tokens_per_expert_E`` the routing counts and ``last_mean_probs_E`` the mean router
    probabilities (graph-connected): Transformer.aux_loss combines them over the layers into the
    loss the training step adds. They are overwritten, never accumulated, so an activation-
    checkpointing recompute cannot count a micro-batch twice; the training step reads them right
    after each forward and drops them (``clear_routing``) once the micro-batch's backward has run.
    """

    # The backward recomputes everything after the routing -- the expert exchange, the experts,
    # the combine -- from the normed input and the routing (set by optimus_core.execution: the
    # authors' recompute level's MoE bit); the router's own activations are kept.
    recompute_routed: bool = False

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = TopKRouter(d_model, cfg)
        self.experts = Experts(cfg.n_experts, d_model, cfg.d_expert)
        self.clear_routing()

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        routing = self.router(x_TD)
        topk_idx_TK, topk_weight_TK = routing.topk_idx_TK, routing.topk_weight_TK
        E, n_groups = self.cfg.n_experts, self.cfg.n_experts
        if self.cfg.capacity_factor is not None:
            capacity = math.ceil(self.cfg.capacity_factor * B * S * self.cfg.top_k / E)
            keep_TK = capacity_keep_mask(topk_idx_TK, E, capacity)
            # Dropped assignments go to a phantom group E past the last offset: the experts
            # ignore those rows (zero output) and their combine weight is zero.
            topk_idx_TK = torch.where(keep_TK, topk_idx_TK, E)
            topk_weight_TK = topk_weight_TK * keep_TK
            n_groups = E + 1

        if self.recompute_routed and self.training:
            out_TD = checkpoint(self.experts.apply_routed, x_TD, topk_idx_TK, topk_weight_TK, n_groups,
                                use_reentrant=False)
        else:
            out_TD = self.experts.apply_routed(x_TD, topk_idx_TK, topk_weight_TK, n_groups)

        self.last_z_loss = routing.z_loss
        self.last_tokens_per_expert_E = routing.tokens_per_expert_E
        self.last_mean_probs_E = routing.mean_probs_E
        return out_TD.view(B, S, D).to(x_BSD.dtype)

    def clear_routing(self) -> None:
        """Drop the last forward's losses and statistics. Kept on the module, the graph-connected
        ones close a reference cycle through the autograd graph wherever an autograd function of
        that graph holds the module (FSDP2's hold their states, which hold the modules): the
        cycle runs through C++ graph nodes, which Python's collector cannot see, so the whole
        model, its shares included, would outlive its last use (a second model built in the
        process, as the rehearsals of several layouts do, would then be measured with the
        first one's weights still allocated)."""
        self.last_z_loss = self.last_tokens_per_expert_E = None
        self.last_mean_probs_E = None
