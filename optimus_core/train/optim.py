"""AdamW with OLMoE's parameter groups, and global gradient-norm clipping.

Weight casts: a module may keep low-precision copies of its weights for the forward (Experts
under bf16, train.expert_weight_casts) and list them as ``module.weight_casts() -> {param:
copy}``; ``weight_casts(model)`` collects them and every optimizer built here keeps each copy
equal to its parameter cast, bit for bit, after every step (TritonAdamW in its update kernel,
torch's AdamW by a cast after its step).
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import OptimConfig
from ..model.experts import refresh_casts
from ..model.transformer import Transformer
from .grad_norm import GradNormUnderBackward
from .update_stream import UpdateBesideForward


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (embeddings and experts included), none on norm scales."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def use_triton_adamw(cfg: OptimConfig, device: torch.device) -> bool:
    """optim.implementation resolved for parameters on ``device`` (see OptimConfig)."""
    from kernels._triton import use_triton

    return use_triton(cfg.implementation, device, "optim.implementation", "the Triton AdamW")


def _per_parameter(model: nn.Module, method: str) -> dict[nn.Parameter, torch.Tensor]:
    """The union of ``module.<method>()`` ({parameter: tensor}) over the modules that have it."""
    found = {}
    for module in model.modules():
        call = getattr(module, method, None)
        if callable(call):
            found.update(call())
    return found


def weight_casts(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """{parameter: its low-precision copy} over the modules of ``model`` that keep copies."""
    return _per_parameter(model, "weight_casts")


def dw_squares(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """{weight: its dw_square} over the modules of ``model`` whose kernels can sum their weights'
    squared gradients in the backward (Experts.enable_dw_squares; enables them)."""
    return _per_parameter(model, "enable_dw_squares")


def adamw(groups: list[dict], cfg: OptimConfig, device: torch.device,
          casts: dict[torch.Tensor, torch.Tensor] | None = None) -> torch.optim.Optimizer:
    """The AdamW of ``cfg.implementation`` over ``groups`` (parameters on ``device``), keeping
    the copies ``casts`` ({parameter of groups: copy}) current after every step."""
    casts = dict(casts or {})
    if use_triton_adamw(cfg, device):
        from .adamw import TritonAdamW

        opt = TritonAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, casts=casts)
    else:  # torch: the fused CUDA kernel on CUDA; its default (single-tensor or foreach) elsewhere.
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=device.type == "cuda" or None)
        if casts:  # a cast pass after the update (the one the forward no longer makes)
            opt.register_step_post_hook(lambda *_: refresh_casts(casts))
    # CUDA only for now: the side stream and record_stream are untested on Intel XPU.
    if cfg.grad_norm_under_backward and cfg.grad_clip is not None and device.type == "cuda":
        opt.grad_norms = GradNormUnderBackward(p for g in groups for p in g["params"])
    return opt


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The AdamW of ``cfg`` for a one-process ``model``; on a CUDA GPU with the Triton AdamW and a
    Transformer, its update runs beside the next forward (optim.update_beside_forward)."""
    devices = {p.device for p in model.parameters()}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")  # mixed: torch's default path
    opt = adamw(param_groups(model, cfg.weight_decay), cfg, device, weight_casts(model))
    if getattr(opt, "grad_norms", None) is not None and cfg.grad_norm_from_dw:
        opt.grad_norms.take_squares_from(dw_squares(model))
    # CUDA only for now, as the grad norm's side stream: untested on Intel XPU.
    if cfg.update_beside_forward and device.type == "cuda" and hasattr(opt, "update_") \
            and isinstance(model, Transformer):  # TritonAdamW: it updates a stage at a time
        opt.beside_forward = UpdateBesideForward(model, (p for g in opt.param_groups for p in g["params"]))
    return opt


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of all gradients (returned before clipping); clip when max_norm is set."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm is None:
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Takes the clip divisor as ``grad_scale`` inside its update (torch's fused AdamW, TritonAdamW)."""
    return bool(optimizer.defaults.get("fused") or getattr(optimizer, "takes_grad_scale", False))


def clip_coef_as_grad_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The divisor that scales gradients as clip_grad_norm_ would (grads x min(1, max_norm /
    (norm + 1e-6))), for a fused optimizer's ``grad_scale``."""
    return torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)


def step_with_grad_scale(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor) -> None:
    """One fused step that divides every gradient by ``grad_scale`` inside the update kernel
    (the hook torch's GradScaler uses): clipping without its own pass over every gradient."""
    optimizer.grad_scale = grad_scale
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
    """Clip by the global gradient norm (returned, before clipping) and update.

    A fused optimizer (CUDA) gets the clip factor as its grad_scale, which saves one read and
    one write of every gradient per step (bench/NOTES.md); elsewhere the gradients are clipped
    in place first.
    """
    norms = getattr(optimizer, "grad_norms", None)  # computed under the backward, when armed
    armed = norms is not None and norms.armed
    if max_norm is None or not is_fused(optimizer):
        if armed:
            norms.disarm()
        norm = clip_grad_norm(model, max_norm)
        optimizer.step()
        return norm
    if armed:
        norm = norms.total()
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    step_with_grad_scale(optimizer, clip_coef_as_grad_scale(norm, max_norm))
    return norm
