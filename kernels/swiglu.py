"""SwiGLU activation of the experts' fused gate+up projection.

    swiglu(h_M2H, *, backend="triton") -> out_MH
    swiglu_reference(h_M2H) -> out_MH

Shape suffixes: M rows, H hidden features; h_M2H is (M, 2H) with gate = h[:, :H] and
up = h[:, H:] (the up projection's output columns laid out gate first), out = silu(gate) * up.
Any float dtype; the triton kernels compute in float32 and store in h's dtype. Differentiable
in h: dgate = dout * up * s * (1 + gate * (1 - s)), s = sigmoid(gate); dup = dout * silu(gate).
The backward recomputes s from h (saved instead of the activation), in one fused pass.

Backends: "loop" and "torch" run the plain-torch reference; "triton" runs our kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton import autotuned, check_launchable, device_guard, jit, row_configs, tl, triton

BACKENDS = ("loop", "torch", "triton")


def swiglu_reference(h: Tensor) -> Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(h: Tensor, *, backend: str = "triton") -> Tensor:
    """silu(h[:, :H]) * h[:, H:]; see the module docstring."""
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu: need h of shape (M, 2H), got {tuple(h.shape)}")
    if backend in ("loop", "torch"):
        return swiglu_reference(h)
    if backend != "triton":
        raise ValueError(f"swiglu: backend must be one of {BACKENDS}, got {backend!r}")
    check_launchable("swiglu", h)
    return torch.ops.optimus.swiglu(h)


# ---------------------------------------------------------------- kernels
@autotuned(row_configs, key=["H"])
@jit
def _swiglu_fwd_kernel(h_ptr, out_ptr, M, H, stride_h, stride_out,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    gate_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask).to(tl.float32)
    up = tl.load(gate_ptrs + H, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


@autotuned(row_configs, key=["H"])
@jit
def _swiglu_bwd_kernel(h_ptr, dout_ptr, dh_ptr, M, H, stride_h, stride_dout, stride_dh,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    gate_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask).to(tl.float32)
    up = tl.load(gate_ptrs + H, mask=mask).to(tl.float32)
    dout = tl.load(dout_ptr + rows[:, None] * stride_dout + cols[None, :], mask=mask).to(tl.float32)
    s = tl.sigmoid(gate)
    silu = gate * s
    dgate_ptrs = dh_ptr + rows[:, None] * stride_dh + cols[None, :]
    tl.store(dgate_ptrs, (dout * up * (s + silu * (1.0 - s))).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptrs + H, (dout * silu).to(dh_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- launchers
def _grid(M: int, H: int):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_R"]), triton.cdiv(H, meta["BLOCK_D"]))


def _launch_swiglu(h: Tensor) -> Tensor:
    h = h.contiguous()  # no-op when contiguous: the kernels assume unit column stride
    M, H = h.shape[0], h.shape[1] // 2
    out = h.new_empty(M, H)
    if out.numel():
        with device_guard(h):
            _swiglu_fwd_kernel(h.device.type)[_grid(M, H)](h, out, M, H, h.stride(0), out.stride(0))
    return out


def _launch_swiglu_bwd(h: Tensor, dout: Tensor) -> Tensor:
    h, dout = h.contiguous(), dout.contiguous()
    M, H = h.shape[0], h.shape[1] // 2
    dh = torch.empty_like(h)
    if dh.numel():
        with device_guard(h):
            _swiglu_bwd_kernel(h.device.type)[_grid(M, H)](
                h, dout, dh, M, H, h.stride(0), dout.stride(0), dh.stride(0))
    return dh


# ---------------------------------------------------------------- torch custom ops
# register_autograd plays the role of a torch.autograd.Function, and torch.compile traces it.
@torch.library.custom_op("optimus::swiglu", mutates_args=())
def _swiglu_op(h: Tensor) -> Tensor:
    return _launch_swiglu(h)


@_swiglu_op.register_fake
def _(h):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@torch.library.custom_op("optimus::swiglu_backward", mutates_args=())
def _swiglu_backward_op(h: Tensor, dout: Tensor) -> Tensor:
    return _launch_swiglu_bwd(h, dout)


@_swiglu_backward_op.register_fake
def _(h, dout):
    return h.new_empty(h.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dout):
    (h,) = ctx.saved_tensors
    return _swiglu_backward_op(h, dout)


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)
