"""The experts' low-precision weight copies: kept by the optimizer, read by the forward.

Under bf16 autocast the float32 master weights would be cast to bf16 by every forward (3.2B
expert parameters for 8 OLMoE layers: read 4 bytes, write 2 each). Where the execution plan
keeps copies (``plan.expert_copies``: one process under bf16, optimus_core.execution.plan)

    copies = keep_expert_copies(model, torch.bfloat16)   # {weight: copy}, made now from the weights
    expert_copies(model)                                 # the same mapping, found on the model
    assert_copies_current(model)                         # tests: every copy == w.to(its dtype), bit for bit

gives each expert weight a copy that every writer of the weights keeps equal to ``w.to(bf16)``:
the optimizers (optimus_core.train.optim; TritonAdamW writes them in its update pass, torch's
AdamW by a cast after its step) and every load (a ``load_state_dict`` post-hook registered here;
``refresh_copies`` for writers that bypass it, such as a checkpoint read into the parameters
directly). State dicts and checkpoints do not change: the copies are non-persistent buffers
``<weight>_cast`` of the Experts module, which its forward reads when their dtype is autocast's
(optimus_core.model.experts).

Gradients on the copies (the plan's ``bf16_expert_grads``):

    hold_grads_on_copies(copies, True)    # the copies require grad

makes the copies the weights the forward multiplies by, so the dW kernel stores each weight's
gradient in bf16 as the copy's ``.grad``, and TritonAdamW applies it to the float32 weight
(optimus_core.train.adamw): the gradient torch's autocast recipe makes (the bf16 GEMM's dW,
rounded to bf16, then widened into a float32 ``.grad``) without the float32 tensor. Micro-batches
would add up in bf16, so the plan allows it with one micro-batch per step only.
``grad_holder(w, copies)`` is where a weight's gradient is.
"""
from __future__ import annotations

import torch
from torch import nn

from ..model.experts import Experts

SUFFIX = "_cast"  # the copy of weight ``w_up`` is the buffer ``w_up_cast``


def _experts(model: nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def keep_expert_copies(model: nn.Module, dtype: torch.dtype | None) -> dict[nn.Parameter, torch.Tensor]:
    """Give every expert weight of ``model`` a ``dtype`` copy made now from the weight (None
    drops them); returns {weight: copy}. Build the optimizer after this: it keeps the copies."""
    for experts in _experts(model):
        for name in Experts.WEIGHTS:
            copy = None if dtype is None else getattr(experts, name).detach().to(dtype, copy=True)
            experts.register_buffer(name + SUFFIX, copy, persistent=False)
        if dtype is not None and not getattr(experts, "_copies_hook", None):
            experts._copies_hook = experts.register_load_state_dict_post_hook(
                lambda module, _keys: refresh_copies(expert_copies(module)))
    return expert_copies(model)


def expert_copies(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """{expert weight: its copy} over ``model`` (empty where none are kept)."""
    found = {}
    for experts in _experts(model):
        for name in Experts.WEIGHTS:
            copy = experts._buffers.get(name + SUFFIX)
            if copy is not None:
                found[getattr(experts, name)] = copy
    return found


def hold_grads_on_copies(copies: dict[nn.Parameter, torch.Tensor], on: bool) -> None:
    """The weights' gradients on their copies, in the copies' dtype (module docstring), or back
    on the weights (``on`` False). ValueError with nothing to hold them."""
    if on and not copies:
        raise ValueError("gradients on the expert weight copies: this model keeps no copies (keep_expert_copies)")
    for copy in copies.values():
        copy.grad = None
        copy.requires_grad_(on)


def grad_holder(w: torch.Tensor, copies: dict[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The tensor whose ``.grad`` is ``w``'s gradient: its copy in ``copies`` where the gradients
    are held on the copies (hold_grads_on_copies), else ``w``."""
    copy = copies.get(w)
    return copy if copy is not None and copy.requires_grad else w


@torch.no_grad()
def refresh_copies(copies: dict[torch.Tensor, torch.Tensor]) -> None:
    """Every copy = its weight cast to the copy's dtype (round to nearest even): for the weights'
    writers other than the update kernel (loads, init, torch's AdamW)."""
    for w, copy in copies.items():
        copy.copy_(w)


def assert_copies_current(model: nn.Module) -> int:
    """Raise AssertionError unless every expert weight copy in ``model`` equals its weight cast
    to the copy's dtype, bit for bit; returns how many copies were checked (0: none kept)."""
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            for w, copy in expert_copies(module).items():
                want = w.detach().to(copy.dtype)
                if not torch.equal(_bits(copy), _bits(want)):  # bits: NaN copies of NaN count as equal
                    differ = (copy != want).sum().item()
                    raise AssertionError(f"{name or 'experts'}: {differ} of {copy.numel()} elements of a "
                                         f"{copy.dtype} weight copy differ from the weight, cast")
                checked += 1
    return checked


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
