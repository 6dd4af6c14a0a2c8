"""Building blocks shared by every Mula model: RMSNorm, rotary embeddings, the SwiGLU MLP.

Shape suffixes (used across optimus_core.model):
    B batch, S sequence, D d_model, H query heads, G kv heads, Dh head dim,
    T tokens (B*S), E experts, K top-k, F feed-forward hidden, V padded vocab.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32 for stability."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE with the rotate-half convention (GPT-NeoX / OLMo / HF Llama), tables in float32."""

    def __init__(self, head_dim: int, theta: float, max_seq_len: int):
        super().__init__()
        self.head_dim, self.theta, self.max_seq_len = head_dim, theta, max_seq_len
        # Not a persistent buffer: recomputed on load, so checkpoints do not depend on it.
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device=None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta ** exponents)

    def reset_parameters(self) -> None:
        # inv_freq is lost when a model is built on the meta device and materialised later.
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos_S = torch.arange(seq_len, dtype=torch.float32, device=self.inv_freq.device)
        freqs_SDh2 = torch.outer(pos_S, self.inv_freq)
        emb_SDh = torch.cat((freqs_SDh2, freqs_SDh2), dim=-1)
        return emb_SDh.cos(), emb_SDh.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dimension (Dh) of ``x`` by the angles whose cos and sin broadcast against
    it: (S, Dh) for x (B, H, S, Dh), (S, 1, Dh) for x (B, S, H, Dh)."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class SwiGLU(nn.Module):
    """Dense feed-forward: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
