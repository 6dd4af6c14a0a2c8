"""AdamW with OLMoE's parameter groups, and global gradient-norm clipping.

Weight copies: where the execution plan keeps bf16 copies of the expert weights for the forward
(optimus_core.execution.weight_copies), every optimizer built here keeps each copy equal to its
weight cast, bit for bit, after every step (TritonAdamW in its update kernel, torch's AdamW by a
cast after its step), and holds them as ``.casts``. Where the plan keeps the expert gradients in
bf16, the copies also hold their weights' gradients, in bf16, and TritonAdamW applies those:
``grad_holder(w, casts)`` is where a weight's gradient is, and ``gradients(model, optimizer)``
lists every gradient a step applies.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import OptimConfig
from ..execution import ExecutionPlan
from ..execution.weight_copies import expert_copies, grad_holder, hold_grads_on_copies, refresh_copies
from ..model.experts import Experts
from ..model.transformer import Transformer
from .grad_norm import GradNormUnderBackward
from .update_stream import UpdateBesideForward


def param_groups(model: nn.Module, weight_decay: float, decay_norms: bool = False) -> list[dict]:
    """Weight decay on matrices (embeddings and experts included) and, with ``decay_norms`` (the
    paper's runs: every parameter decays), on the norm scales too; else none on those."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 or decay_norms else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def dw_squares(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """Give each expert weight computed by the Triton kernels a ``dw_square`` (optimus_kernels.grouped_mm),
    a 0-d float32 tensor on the weight's device whose gradient each backward sets to the sum of
    the squares of the weight's gradient, summed by the dW kernel as it stores that gradient;
    returns {weight: its dw_square} for the clip's norm (optimus_core.train.grad_norm). None for
    the other backends, where it would cost the pass over the gradient it saves. Not parameters:
    no optimizer, state dict or checkpoint sees them."""
    found = {}
    for experts in (m for m in model.modules() if isinstance(m, Experts) and m.backend == "triton"):
        experts.dw_squares = {name: torch.zeros((), device=getattr(experts, name).device, requires_grad=True)
                              for name in Experts.WEIGHTS}
        found.update({getattr(experts, name): square for name, square in experts.dw_squares.items()})
    return found


def adamw(groups: list[dict], cfg: OptimConfig, kernel: str = "torch", device: torch.device | str = "cpu",
          casts: dict[torch.Tensor, torch.Tensor] | None = None, norm_under_backward: bool = False) -> torch.optim.Optimizer:
    """The AdamW over ``groups`` (parameters on ``device``) by ``kernel`` ("triton": TritonAdamW,
    "torch": torch.optim.AdamW, fused on CUDA), keeping the copies ``casts`` ({parameter of
    groups: copy}) current after every step; with ``norm_under_backward``, the clip's norm taken
    under the last backward (GradNormUnderBackward: a CUDA side stream). Either optimizer holds
    the copies as ``.casts``."""
    casts = dict(casts or {})
    device = torch.device(device)
    if kernel == "triton":
        from .adamw import TritonAdamW

        opt = TritonAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, casts=casts)
    else:  # torch: the fused CUDA kernel on CUDA; its default (single-tensor or foreach) elsewhere.
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=device.type == "cuda" or None)
        opt.casts = casts
        if casts:  # a cast pass after the update (the forward makes none)
            opt.register_step_post_hook(lambda *_: refresh_copies(casts))
    if norm_under_backward:
        opt.grad_norms = GradNormUnderBackward(grad_holder(p, casts) for g in groups for p in g["params"])
    return opt


def build_optimizer(model: nn.Module, cfg: OptimConfig, plan: ExecutionPlan | None = None) -> torch.optim.Optimizer:
    """The AdamW of ``cfg`` for a one-process ``model``, executed as ``plan`` says (default: the
    plan of a run of the defaults on the model's device: optimus_core.execution): the kernel, the
    expert gradients on their bf16 copies, the clip's norm under the backward (with the dW
    kernel's sums of squares) and, for a Transformer, the update beside the next forward."""
    devices = {p.device for p in model.parameters()}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")  # mixed: torch's default path
    if plan is None:
        from ..config import RunConfig
        from ..execution import resolve_choices

        plan = resolve_choices(RunConfig(optim=cfg), device)
    transformer = isinstance(model, Transformer)
    casts = expert_copies(model)
    if casts:
        hold_grads_on_copies(casts, plan.bf16_expert_grads)
    opt = adamw(param_groups(model, cfg.weight_decay, cfg.decay_norms), cfg, plan.adamw, device, casts,
                norm_under_backward=plan.grad_norm_under_backward and device.type == "cuda")
    if getattr(opt, "grad_norms", None) is not None and plan.grad_norm_from_dw:
        opt.grad_norms.take_squares_from({grad_holder(p, casts): square for p, square in dw_squares(model).items()})
    if plan.update_beside_forward and device.type == "cuda" and hasattr(opt, "update_") and transformer:
        opt.beside_forward = UpdateBesideForward(model, (p for g in opt.param_groups for p in g["params"]))
    return opt


def gradients(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradient of every parameter of ``model`` that has one, where ``optimizer`` takes it
    from: the parameter's ``.grad``, or its bf16 copy's (grad_holder)."""
    casts = getattr(optimizer, "casts", {})
    return [g for p in model.parameters() if (g := grad_holder(p, casts).grad) is not None]


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of ``grads`` (one device), as torch.nn.utils.get_total_norm takes it but
    with each tensor's norm in float32 whatever its dtype (get_total_norm's would round a bf16
    gradient's norm to bf16)."""
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


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


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None,
                  sum_squares: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Clip by the global gradient norm (returned, before clipping) and update.

    A fused optimizer (CUDA) gets the clip factor as its grad_scale, which saves one read and
    one write of every gradient per step; elsewhere the gradients are clipped in place first.
    ``sum_squares``: where ``model`` is one part of the model (a pipeline stage), sums the
    parts' squared norms in place (Mesh.all_reduce_pipeline_sum_), so the norm is the whole
    model's.
    """
    norms = getattr(optimizer, "grad_norms", None)  # computed under the backward, when armed
    armed = norms is not None and norms.armed
    if armed and (max_norm is not None and not is_fused(optimizer)):
        norms.disarm()
        armed = False
    norm = norms.total() if armed else total_norm(gradients(model, optimizer))
    if sum_squares is not None:
        norm = sum_squares(norm.double().square()).sqrt().float()
    if max_norm is None:  # no clipping (the warmup, under optim.clip_after_warmup): the norm for the log
        optimizer.step()
    elif not is_fused(optimizer):
        torch._foreach_mul_(gradients(model, optimizer), torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        optimizer.step()
    else:
        step_with_grad_scale(optimizer, clip_coef_as_grad_scale(norm, max_norm))
    return norm
