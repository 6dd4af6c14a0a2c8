"""AdamW whose update is one streaming Triton kernel per tensor (optimus_kernels.adamw_step_), with
torch.optim.AdamW's arithmetic, parameter groups and state layout.

    opt = TritonAdamW(param_groups, lr=4e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt.grad_scale = divisor     # optional: gradients divided by it inside the kernel (clipping)
    opt.step()

Why: torch's fused AdamW moves 32 bytes per parameter when it is given a grad_scale (it writes
the unscaled gradient back) and runs through multi_tensor_apply; this kernel moves 28 and streams
each tensor. A sharded parameter (a DTensor: optimus_core.parallel.sharding) is updated on its
local share, its moments plain tensors of the share's shape.
bench/optimizer.py times both.

``casts`` ({parameter: low-precision copy}, optimus_core.execution.weight_copies): copies kept
equal to their parameter cast after every step; a bf16 copy is written by the update kernel
itself (2 more bytes per parameter, instead of the forward's cast: read 4, write 2). Where a
copy requires grad, it holds its weight's gradient, in bf16 (the plan's bf16_expert_grads): the
update reads that, and ``zero_grad`` clears it with the parameters' (weight_copies.grad_holder).

With ``beside_forward`` set (optim.update_beside_forward, optimus_core.train.update_stream),
``step()`` queues the update on a side stream in the forward's order of the model's stages and
returns; the next forward waits stage by stage. ``update_stream.settle_updates(opt)`` waits for all of it.

The state is torch's: ``step`` (a float32 CPU tensor, so the bias corrections are computed on the
host without a sync), ``exp_avg``, ``exp_avg_sq``; a torch AdamW state dict loads as it is (a
step saved on the device moves to the host once, at the first update).
"""
from __future__ import annotations

import torch

import optimus_kernels

from ..execution.weight_copies import grad_holder
from ..parallel.layout import local_tensor
from .update_stream import settle_updates


class TritonAdamW(torch.optim.Optimizer):
    takes_grad_scale = True  # train.optim.clip_and_step passes the clip divisor as grad_scale

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, casts: dict[torch.Tensor, torch.Tensor] | None = None):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.casts = dict(casts or {})
        # optimus_core.train.update_stream.UpdateBesideForward, attached by build_optimizer where
        # it applies: step() then queues the update on a side stream, stage by stage.
        self.beside_forward = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        if self.beside_forward is None:
            self.update_(None, grad_scale)
            return loss
        for group in self.param_groups:  # the state is made here, on the current stream, once
            for p in group["params"]:
                if self._gradient(p) is not None:
                    self._state(p)
        self.beside_forward.step(lambda params: self.update_(params, grad_scale), keep=(grad_scale,),
                                 gradients=lambda p: [g] if (g := self._gradient(p)) is not None else [])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for copy in self.casts.values():  # the gradients kept on bf16 copies, where they are
            if copy.grad is not None:
                if set_to_none:
                    copy.grad = None
                else:
                    copy.grad.zero_()

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:  # a sharded parameter's moments are plain tensors of its local share
            local = local_tensor(p)
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(local, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(local, memory_format=torch.contiguous_format)
        if state["step"].device.type != "cpu":  # loaded from a fused / capturable AdamW
            state["step"] = state["step"].detach().float().cpu()
        return state

    def _gradient(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s gradient where this optimizer takes it (its bf16 copy's, where kept there), as
        the plain local tensor of a sharded parameter's gradient; None: no gradient."""
        grad = grad_holder(p, self.casts).grad
        return None if grad is None else local_tensor(grad)

    @torch.no_grad()
    def update_(self, params: list[torch.Tensor] | None, grad_scale: torch.Tensor | None = None) -> None:
        """The update of ``params`` (every parameter when None), on the current stream."""
        only = None if params is None else {id(p) for p in params}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = self._gradient(p)
                if grad is None or (only is not None and id(p) not in only):
                    continue
                state = self._state(p)
                state["step"] += 1  # on every rank, an empty share too: the step is the parameter's
                copy = self.casts.get(p)
                p = local_tensor(p)  # a sharded parameter: its local share (fetched each step: FSDP2 may re-pad it)
                if not p.numel():
                    continue
                if not (p.is_contiguous() and grad.is_contiguous()):
                    raise ValueError("TritonAdamW: parameters and gradients must be contiguous")
                fused = copy is not None and copy.dtype == torch.bfloat16 and copy.is_contiguous()
                optimus_kernels.adamw_step_(p.view(-1), grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                                    lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                                    weight_decay=group["weight_decay"], step=int(state["step"]),
                                    grad_scale=grad_scale, param_bf16_N=copy.view(-1) if fused else None)
                if copy is not None and not fused:  # another dtype or layout: a cast after
                    copy.copy_(p)

    def state_dict(self):
        settle_updates(self)  # its tensors are read later, on the current stream
        return super().state_dict()

    def load_state_dict(self, state_dict):
        settle_updates(self)  # not over tensors an update still writes
        super().load_state_dict(state_dict)
