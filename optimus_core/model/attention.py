"""Causal self-attention with RoPE, optional QK-norm (OLMoE) and grouped-query attention."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import optimus_kernels

from ..config import ModelConfig
from .layers import RMSNorm, apply_rotary


class Attention(nn.Module):
    # QK-norm and RoPE by one Triton kernel per projection (execution.qk_norm_rope, set by
    # optimus_core.execution.parallelize): the same function, the normed values kept in float32
    # between the norm and the rotation instead of rounded to the projection's dtype
    qk_norm_rope_kernel: bool = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        kv_dim = self.n_kv_heads * self.head_dim
        self.w_q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.w_k = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.w_v = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.w_o = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        # OLMoE normalises q and k over the whole projection (all heads), before the head split.
        self.q_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(kv_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x_BSD: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.w_q(x_BSD), self.w_k(x_BSD), self.w_v(x_BSD)
        if self.q_norm is not None and self.qk_norm_rope_kernel:
            q = optimus_kernels.qk_norm_rope(q, self.q_norm.weight, cos_SDh, sin_SDh, eps=self.q_norm.eps)
            k = optimus_kernels.qk_norm_rope(k, self.k_norm.weight, cos_SDh, sin_SDh, eps=self.k_norm.eps)
            q_BHSDh = q.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
            k_BGSDh = k.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            # RoPE in the projections' own (B, S, heads, Dh) layout, then the head-major views
            # SDPA takes: the rotated q and k are written as the norm reads them, token by token.
            cos_S1Dh, sin_S1Dh = cos_SDh[:, None], sin_SDh[:, None]
            q_BHSDh = apply_rotary(q.view(B, S, self.n_heads, self.head_dim), cos_S1Dh, sin_S1Dh).transpose(1, 2)
            k_BGSDh = apply_rotary(k.view(B, S, self.n_kv_heads, self.head_dim), cos_S1Dh, sin_S1Dh).transpose(1, 2)
        v_BGSDh = v.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.n_kv_heads != self.n_heads:
            # repeat_interleave keeps query head h paired with kv head h // (H / G), as in Llama.
            rep = self.n_heads // self.n_kv_heads
            k_BGSDh = k_BGSDh.repeat_interleave(rep, dim=1)
            v_BGSDh = v_BGSDh.repeat_interleave(rep, dim=1)
        out_BHSDh = F.scaled_dot_product_attention(q_BHSDh, k_BGSDh, v_BGSDh, is_causal=True)
        return self.w_o(out_BHSDh.transpose(1, 2).reshape(B, S, D))
