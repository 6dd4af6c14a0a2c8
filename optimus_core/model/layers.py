"""Building blocks shared by every Mula model: the norms, rotary embeddings, the SwiGLU MLP.

Shape suffixes (used across optimus_core.model):
    B batch, S sequence, D d_model, H query heads, G kv heads, Dh head dim,
    T tokens (B*S), E experts, K top-k, F feed-forward hidden, V padded vocab.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def make_norm(cfg) -> nn.Module:
    """The pre-norm / final norm a ModelConfig names (``model.norm``), over d_model."""
    if cfg.norm == "nonparametric_layernorm":
        return NonParametricLayerNorm(cfg.norm_eps)
    return RMSNorm(cfg.d_model, cfg.norm_eps)


class NonParametricLayerNorm(nn.Module):
    """LayerNorm with neither scale nor bias (OLMo-1B's), computed in float32; the output in the
    input's dtype. A 16-bit input in eager mode keeps, like RMSNorm, that input and two float32
    numbers per row for the backward (_LayerNormFunction), not its float32 copy."""

    def __init__(self, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 and not torch.compiler.is_compiling():
            return _LayerNormFunction.apply(x, self.eps)
        return F.layer_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class _LayerNormFunction(torch.autograd.Function):
    """The non-parametric LayerNorm of a 16-bit input: the same float32 arithmetic as
    F.layer_norm on its float32 copy, keeping the input, the mean and the rsqrt per row:

        y = (x - mean) * r,  r = rsqrt(var(x) + eps)
        dx = r * (g - mean(g) - y * mean(g * y)),  g = dout
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        var, mean = torch.var_mean(x32, dim=-1, keepdim=True, correction=0)
        rstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, mean, rstd)
        return ((x32 - mean) * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, mean, rstd = ctx.saved_tensors
        y = (x.float() - mean) * rstd
        g = dout.float()
        dx = rstd * (g - g.mean(-1, keepdim=True) - y * (g * y).mean(-1, keepdim=True))
        return dx.to(x.dtype), None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32 for stability; the output
    in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 and not torch.compiler.is_compiling():
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        # Torch ops where the Function gains nothing: a float32 input is its own float32 copy,
        # and a compiled graph's partitioner chooses what to keep itself. Measured on an H200:
        # compiled, the Function's step was slower, and given a float32 input (which .float()
        # returns as it is) it passed no gradient at all.
        return _rms_norm(x, self.weight, self.eps)[0]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the normed x in x's dtype, its float32 rsqrt per row): the arithmetic both paths share."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float()).to(x.dtype), rstd


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm of a 16-bit input in eager mode (FSDP2 runs, XPU), keeping that input and one
    float32 rsqrt per row for the backward.

    Written as torch ops, autograd would keep the input's float32 copy and the normalised value
    (two float32 tensors of the input's size, four times a bf16 input's bytes) for every norm of
    an eager run -- what a block keeps most of, beside the experts' rows (bench/
    saved_activations.py). The forward is the same ops in the same order (the same bits); the
    backward recomputes the normalised value from the input:

        y = x * r,  r = rsqrt(mean(x^2) + eps),  out = y * w
        dw = sum over rows of dout * y
        dx = r * (g - y * mean(g * y)),  g = dout * w
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        y = x.float() * rstd
        dout32 = dout.float()
        dw = (dout32 * y).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        g = dout32 * weight.float()
        dx = rstd * (g - y * (g * y).mean(-1, keepdim=True))
        return dx.to(x.dtype), None if dw is None else dw.to(weight.dtype), None


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
