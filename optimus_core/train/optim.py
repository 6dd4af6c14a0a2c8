"""AdamW with OLMoE's parameter groups, and global gradient-norm clipping."""
from __future__ import annotations

import torch
from torch import nn

from ..config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (embeddings and experts included), none on norm scales."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    # The fused CUDA kernel where every parameter is on CUDA; torch's default elsewhere.
    fused_ok = all(p.device.type == "cuda" for p in model.parameters())
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                             eps=cfg.eps, fused=fused_ok or None)


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of all gradients (returned before clipping); clip when max_norm is set."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm is None:
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    return torch.nn.utils.clip_grad_norm_(params, max_norm)
