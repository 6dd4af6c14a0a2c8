"""Softmax cross-entropy of a chunk of logits and its gradient, in place, in one Triton kernel.

    loss_C = softmax_cross_entropy_(logits_CV, targets_C, valid_C)             # Triton, in place
    loss_C = softmax_cross_entropy_reference_(logits_CV, targets_C, valid_C)   # plain torch, in place

Suffixes: C rows (tokens of a chunk), V classes (the vocabulary). Per row c, in float32 from the
logits' own dtype (float32, bfloat16 or float16):

    m, log_s  = max_v logits[c, v], log(sum_v exp(logits[c, v] - m))      (one online pass)
    loss[c]   = (m - logits[c, targets[c]]) + log_s              if valid[c], else 0
    logits[c] = exp(logits[c] - m - log_s) - one_hot(targets[c])  if valid[c], else 0  (when grad)

so ``logits_CV`` ends as d(sum of the valid rows' losses)/d(logits), rounded once to its dtype:
softmax minus the target's one-hot, the cross-entropy gradient that
optimus_core.model.linear_cross_entropy multiplies into the LM head's matmuls. ``grad=False``
leaves the logits alone (evaluation).

Why: torch's path for a chunk of bf16 logits is a cast to float32, a float32 log-softmax and an
exp back into bf16, 20 bytes per logit, measured at a few percent of the training step on an H200.
Here each logit is read twice and written once in its own dtype: 6 bytes per logit for bf16.
``targets`` must lie in [0, V) on the valid rows (not checked on the device: an out-of-range
target reads another row's logit there).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import INTERPRET, check_launchable, device_guard, jit, tl

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check(logits_CV: Tensor, targets_C: Tensor, valid_C: Tensor) -> None:
    if not isinstance(logits_CV, Tensor) or logits_CV.ndim != 2 or logits_CV.dtype not in FLOATS:
        raise ValueError("softmax_cross_entropy_: logits_CV must be a 2-D float32, bfloat16 or float16 tensor, got "
                         f"{getattr(logits_CV, 'dtype', type(logits_CV).__name__)} of shape "
                         f"{tuple(getattr(logits_CV, 'shape', ()))}")
    if logits_CV.stride(1) != 1:
        raise ValueError("softmax_cross_entropy_: logits_CV rows must be contiguous (stride 1 along V)")
    C = logits_CV.shape[0]
    if targets_C.shape != (C,) or targets_C.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"softmax_cross_entropy_: targets_C must be ({C},) int64 or int32, got "
                         f"{targets_C.dtype} {tuple(targets_C.shape)}")
    if valid_C.shape != (C,) or valid_C.dtype != torch.bool:
        raise ValueError(f"softmax_cross_entropy_: valid_C must be ({C},) bool, got {valid_C.dtype} "
                         f"{tuple(valid_C.shape)}")
    devices = {t.device for t in (logits_CV, targets_C, valid_C)}
    if len(devices) != 1:
        raise ValueError(f"softmax_cross_entropy_: all on one device, got {sorted(map(str, devices))}")


@torch.no_grad()
def softmax_cross_entropy_reference_(logits_CV: Tensor, targets_C: Tensor, valid_C: Tensor, *,
                                     grad: bool = True) -> Tensor:
    """The module's arithmetic in plain torch (float32 log-softmax): per-row losses, float32."""
    _check(logits_CV, targets_C, valid_C)
    logp_CV = torch.log_softmax(logits_CV, dim=-1, dtype=torch.float32)
    safe_C1 = torch.where(valid_C, targets_C, 0).long()[:, None]
    loss_C = torch.where(valid_C, -logp_CV.gather(1, safe_C1)[:, 0], 0.0)
    if grad:
        g_CV = logp_CV.exp_()
        g_CV.scatter_add_(1, safe_C1, torch.full_like(safe_C1, -1.0, dtype=torch.float32))
        logits_CV.copy_(g_CV * valid_C[:, None])
    return loss_C


@jit
def _softmax_xent_kernel(x_ptr, stride, t_ptr, valid_ptr, loss_ptr, V,
                         GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    cols = tl.arange(0, BLOCK)
    # Pass 1: per lane, a running max and a sum of exp shifted by it; combined after the loop.
    # A lane that has seen only padding (-inf) keeps max -inf and sum 0 (guarded: no inf - inf).
    m_B = tl.full([BLOCK], float("-inf"), tl.float32)
    s_B = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_B, x)
        seen = m_new > float("-inf")
        s_B = tl.where(seen, s_B * tl.exp(m_B - m_new) + tl.exp(x - m_new), 0.0)
        m_B = m_new
    # lse = m + log_s, kept apart: x - m is exact where x is near the max, and m + log_s would
    # lose log_s against a large |m| in float32 (as torch's log-softmax keeps x - m - log_s).
    m = tl.max(m_B, axis=0)
    log_s = tl.log(tl.sum(tl.where(m_B > float("-inf"), s_B * tl.exp(m_B - m), 0.0), axis=0))
    valid = tl.load(valid_ptr + row) != 0
    target = tl.load(t_ptr + row).to(tl.int64)
    target = tl.where(valid, target, 0)
    x_t = tl.load(base + target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, (m - x_t) + log_s, 0.0))
    if GRAD:
        # Pass 2: softmax minus the one-hot, rounded once to the logits' dtype, in place.
        for start in range(0, V, BLOCK):
            c = start + cols
            x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
            g = tl.exp((x - m) - log_s) - tl.where(c == target, 1.0, 0.0)
            g = tl.where(valid, g, 0.0)
            tl.store(base + c, g.to(x_ptr.dtype.element_ty), mask=c < V)


def _config(V: int) -> tuple[int, int]:
    """(BLOCK, num_warps): whole 16-byte accesses per thread over a 50k vocabulary on a GPU;
    the interpreter gets small blocks, so that the tests' odd V cross block edges."""
    if INTERPRET:
        return 32, 1
    return (4096, 8) if V >= 4096 else (1024, 4)


@torch.no_grad()
def softmax_cross_entropy_(logits_CV: Tensor, targets_C: Tensor, valid_C: Tensor, *, grad: bool = True) -> Tensor:
    """Per-row losses (float32, 0 on invalid rows); with ``grad`` the logits become their
    gradient, in place (module docstring). Raises on bad shapes, dtypes, layouts or devices,
    and where Triton cannot launch (then use softmax_cross_entropy_reference_)."""
    _check(logits_CV, targets_C, valid_C)
    check_launchable("softmax_cross_entropy_", logits_CV)
    C, V = logits_CV.shape
    loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if C == 0:
        return loss_C
    if V == 0:
        raise ValueError("softmax_cross_entropy_: V = 0 classes")
    block, warps = _config(V)
    with device_guard(logits_CV):
        _softmax_xent_kernel[(C,)](logits_CV, logits_CV.stride(0), targets_C, valid_C.view(torch.uint8),
                                   loss_C, V, GRAD=grad, BLOCK=block, num_warps=warps)
    return loss_C
