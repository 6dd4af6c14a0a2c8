"""Softmax top-k router with the statistics of the auxiliary losses and optional aux-loss-free balancing.

    probs_TE   = softmax(x_TD @ W_DE)                    (float32)
    chosen_TK  = top-k of (probs_TE + balance_bias_E)    the bias steers selection only
    weight_TK  = probs_TE[chosen_TK]                     OLMoE: not renormalised by default
    counts_E   = assignments per expert                  the load-balancing loss's statistics,
    P_E        = mean_t probs_TE                         combined over the layers by
                                                         Transformer.lb_loss
    z_loss     = mean_t logsumexp(logits_t)^2
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import MoEConfig


@dataclass
class Routing:
    topk_idx_TK: torch.Tensor  # int64 expert ids
    topk_weight_TK: torch.Tensor  # float32 combine weights
    z_loss: torch.Tensor  # scalar, unscaled
    tokens_per_expert_E: torch.Tensor  # int64, this forward's assignment counts (no grad)
    mean_probs_E: torch.Tensor  # float32, P_e: mean router probability of each expert (graph-connected)


class TopKRouter(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk = cfg.n_experts, cfg.top_k, cfg.norm_topk_probs
        self.bias_update_rate = cfg.bias_update_rate
        self.gate = nn.Linear(d_model, cfg.n_experts, bias=False)
        # Persistent: the balancing bias is training state and must survive a resume.
        self.register_buffer("balance_bias", torch.zeros(cfg.n_experts))

    def forward(self, x_TD: torch.Tensor) -> Routing:
        logits_TE = self.gate(x_TD).float()
        probs_TE = logits_TE.softmax(dim=-1)
        scores_TE = probs_TE + self.balance_bias if self.bias_update_rate > 0 else probs_TE
        topk_idx_TK = scores_TE.topk(self.top_k, dim=-1).indices
        topk_weight_TK = probs_TE.gather(-1, topk_idx_TK)
        if self.norm_topk:
            topk_weight_TK = topk_weight_TK / topk_weight_TK.sum(-1, keepdim=True)

        # Counted by scatter_add into n_experts bins, not bincount: bincount's output size depends
        # on the data, so on a GPU it waits for the device, and it breaks torch.compile's graph
        # (measured on an H200: 1.2 ms of host wait per layer, the forward left host-bound).
        flat_N = topk_idx_TK.flatten()
        tokens_per_expert_E = torch.zeros(self.n_experts, dtype=torch.long, device=flat_N.device).scatter_add_(
            0, flat_N, torch.ones_like(flat_N))
        mean_probs_E = probs_TE.mean(0)
        z_loss = torch.logsumexp(logits_TE, dim=-1).pow(2).mean()
        return Routing(topk_idx_TK, topk_weight_TK, z_loss, tokens_per_expert_E.detach(), mean_probs_E)

    @torch.no_grad()
    def update_balance_bias(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded."""
        if self.bias_update_rate <= 0:
            return
        load_E = tokens_per_expert_E.float().to(self.balance_bias.device)
        self.balance_bias += self.bias_update_rate * torch.sign(load_E.mean() - load_E)
