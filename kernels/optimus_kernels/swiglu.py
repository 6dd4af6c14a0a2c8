"""SwiGLU activation of the experts' fused gate+up projection, optionally scaled per row.

    swiglu(h_M2H, *, row_weight=None, backend="triton") -> out_MH     # row_weight: (M,) or None
    swiglu_reference(h_M2H, row_weight=None) -> out_MH

Shape suffixes: M rows, H hidden features; h_M2H is (M, 2H) with gate = h[:, :H] and
up = h[:, H:] (the up projection's output columns laid out gate first), out = silu(gate) * up,
times row_weight[r] on row r when given. Any float dtype for h; row_weight any float dtype (the
routing weights: float32). The triton kernels compute in float32 and store in h's dtype.
Differentiable in h: dgate = dout' * up * s * (1 + gate * (1 - s)), s = sigmoid(gate); dup =
dout' * silu(gate), with dout' = dout * row_weight[r] (or dout); and in row_weight:
drow_weight[r] = sum_f dout[r, f] * silu(gate[r, f]) * up[r, f], in row_weight's dtype.
The backward recomputes s from h (saved instead of the activation), in one fused pass.

Why a row weight: the MoE layer's routing weights, applied here instead of in the top-k combine
(optimus_core.model.experts): the down projection is linear, so w * (a @ W) = (w * a) @ W, and
the weight's gradient <dy, a @ W> = <dy @ W^T, a> is a row sum of what this backward already
reads. The combine then keeps no expert output for its backward (the down projection's output
rows, as large as its input rows x 2 for OLMoE's shapes).

Backends: "loop" and "torch" run the plain-torch reference; "triton" runs our kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton import autotuned, check_launchable, device_guard, jit, row_configs, tl, triton

BACKENDS = ("loop", "torch", "triton")


def swiglu_reference(h: Tensor, row_weight: Tensor | None = None) -> Tensor:
    gate, up = h.chunk(2, dim=-1)
    out = F.silu(gate) * up
    if row_weight is None:
        return out
    # the product in float32 at least, one rounding to h's dtype, as the kernel
    acc = torch.promote_types(out.dtype, torch.float32)
    return (F.silu(gate.to(acc)) * up.to(acc) * row_weight.to(acc)[:, None]).to(h.dtype)


def swiglu(h: Tensor, *, row_weight: Tensor | None = None, backend: str = "triton") -> Tensor:
    """silu(h[:, :H]) * h[:, H:] (times row_weight per row); see the module docstring."""
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu: need h of shape (M, 2H), got {tuple(h.shape)}")
    if row_weight is not None and row_weight.shape != (h.shape[0],):
        raise ValueError(f"swiglu: row_weight must be ({h.shape[0]},), one per row of h, "
                         f"got {tuple(row_weight.shape)}")
    if backend in ("loop", "torch"):
        return swiglu_reference(h, row_weight)
    if backend != "triton":
        raise ValueError(f"swiglu: backend must be one of {BACKENDS}, got {backend!r}")
    if row_weight is None:
        check_launchable("swiglu", h)
        return torch.ops.optimus.swiglu(h)
    check_launchable("swiglu", h, row_weight)
    return torch.ops.optimus.swiglu_weighted(h, row_weight)


# ---------------------------------------------------------------- kernels
@autotuned(row_configs, key=["H"])
@jit
def _swiglu_fwd_kernel(h_ptr, w_ptr, out_ptr, M, H, stride_h, stride_out,
                       HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    gate_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask).to(tl.float32)
    up = tl.load(gate_ptrs + H, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    if HAS_WEIGHT:
        out = out * tl.load(w_ptr + rows, mask=rows < M).to(tl.float32)[:, None]
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


@autotuned(row_configs, key=["H"])
@jit
def _swiglu_weighted_bwd_kernel(h_ptr, w_ptr, dout_ptr, dh_ptr, dw_ptr, M, H, stride_h, stride_dout, stride_dh,
                                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Both gradients of w[r] * silu(gate) * up: a program owns whole rows (it loops over the
    columns), so each dw[r], a sum over the row, is one plain store."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_ok = rows < M
    weight = tl.load(w_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for d in range(0, H, BLOCK_D):
        cols = d + tl.arange(0, BLOCK_D)
        mask = r_ok[:, None] & (cols < H)[None, :]
        gate_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + H, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(dout_ptr + rows[:, None] * stride_dout + cols[None, :], mask=mask, other=0.0)
        dout = dout.to(tl.float32)
        s = tl.sigmoid(gate)
        silu = gate * s
        dot += tl.sum(dout * silu * up, 1)
        dout = dout * weight[:, None]
        dgate_ptrs = dh_ptr + rows[:, None] * stride_dh + cols[None, :]
        tl.store(dgate_ptrs, (dout * up * (s + silu * (1.0 - s))).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dgate_ptrs + H, (dout * silu).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + rows, dot.to(dw_ptr.dtype.element_ty), mask=r_ok)


# ---------------------------------------------------------------- launchers
def _grid(M: int, H: int):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_R"]), triton.cdiv(H, meta["BLOCK_D"]))


def _launch_swiglu(h: Tensor, row_weight: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """``out``: a contiguous (M, H) tensor in h's dtype to fill, else a new one."""
    h = h.contiguous()  # no-op when contiguous: the kernels assume unit column stride
    M, H = h.shape[0], h.shape[1] // 2
    out = h.new_empty(M, H) if out is None else out
    if out.numel():
        w = h if row_weight is None else row_weight.contiguous()  # h: a placeholder, never read
        with device_guard(h):
            _swiglu_fwd_kernel(h.device.type)[_grid(M, H)](h, w, out, M, H, h.stride(0), out.stride(0),
                                                           HAS_WEIGHT=row_weight is not None)
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


def _launch_swiglu_weighted_bwd(h: Tensor, row_weight: Tensor, dout: Tensor) -> tuple[Tensor, Tensor]:
    h, row_weight, dout = h.contiguous(), row_weight.contiguous(), dout.contiguous()
    M, H = h.shape[0], h.shape[1] // 2
    dh, dw = torch.empty_like(h), torch.empty_like(row_weight)
    if M and H:
        with device_guard(h):
            _swiglu_weighted_bwd_kernel(h.device.type)[lambda meta: (triton.cdiv(M, meta["BLOCK_R"]),)](
                h, row_weight, dout, dh, dw, M, H, h.stride(0), dout.stride(0), dh.stride(0))
    elif M:
        dw.zero_()  # H = 0: empty rows sum to zero
    return dh, dw


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


@torch.library.custom_op("optimus::swiglu_weighted", mutates_args=())
def _swiglu_weighted_op(h: Tensor, row_weight: Tensor) -> Tensor:
    return _launch_swiglu(h, row_weight)


@_swiglu_weighted_op.register_fake
def _(h, row_weight):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@torch.library.custom_op("optimus::swiglu_weighted_backward", mutates_args=())
def _swiglu_weighted_backward_op(h: Tensor, row_weight: Tensor, dout: Tensor) -> tuple[Tensor, Tensor]:
    return _launch_swiglu_weighted_bwd(h, row_weight, dout)


@_swiglu_weighted_backward_op.register_fake
def _(h, row_weight, dout):
    return h.new_empty(h.shape), row_weight.new_empty(row_weight.shape)


def _weighted_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _weighted_backward(ctx, dout):
    h, row_weight = ctx.saved_tensors
    return _swiglu_weighted_backward_op(h, row_weight, dout)


_swiglu_weighted_op.register_autograd(_weighted_backward, setup_context=_weighted_setup_context)
