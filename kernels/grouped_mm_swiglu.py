"""The experts' up projection and its SwiGLU as one op: the activation written by the GEMM.

    grouped_mm_swiglu(x_MK, w_GK2H, offsets_G, *, row_weight=None, backend="triton",
                      keep_cast=False, w_cast=None, dw_square=None) -> out_MH

out = swiglu(grouped_mm(x, w, offsets), row_weight=row_weight): the same values, shapes, dtypes
and gradients as those two ops (kernels.grouped_mm, kernels.swiglu: shapes, ``keep_cast``,
``w_cast`` and ``dw_square`` as there; w in x's dtype, or float32 master weights cast inside
the op, again in the backward, or with ``keep_cast`` by grouped_mm's op that keeps its copy,
then the swiglu op). What differs is the triton backend's forward on Hopper: the warp-specialized
GEMM's epilogue (kernels.grouped_mm_ws, ``swiglu_out``) writes h = x @ w[g], which the backward
needs, and out = silu(gate) * up * row_weight from the same 16-bit values, so the swiglu pass
(read h, write out: 3 bytes a row element) is gone and the bits are those of the two ops. Each
work item loads the gate's columns c + [0, 64) and the up's columns H + c + [0, 64) into one
128-column tile, so one accumulator holds both halves of its outputs. Elsewhere (other devices,
H not a multiple of 64) the op runs the two kernels one after the other.

The backward is the two ops' backward: the swiglu kernel's (dh and the row weights' gradient
from h), then the grouped GEMM's dx and dW of dh.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import check_launchable
from .grouped_mm import _check_args, _check_cast, _check_square, _grads, _launch_grouped_mm, grouped_mm
from .swiglu import _launch_swiglu, _swiglu_backward_op, _swiglu_weighted_backward_op, swiglu
from .grouped_mm_ws import launch_grouped_mm_ws, swiglu_unsupported


def grouped_mm_swiglu(x: Tensor, w: Tensor, offsets: Tensor, *, row_weight: Tensor | None = None,
                      backend: str = "triton", keep_cast: bool = False, w_cast: Tensor | None = None,
                      dw_square: Tensor | None = None) -> Tensor:
    """swiglu(grouped_mm(x, w, offsets), row_weight=row_weight), fused where the triton backend
    can (module docstring)."""
    if backend != "triton" or (keep_cast and w_cast is None and w.dtype != x.dtype):
        h = grouped_mm(x, w, offsets, backend=backend, keep_cast=keep_cast, w_cast=w_cast, dw_square=dw_square)
        return swiglu(h, row_weight=row_weight, backend=backend)
    _check_args(x, w, offsets)
    if w.shape[2] % 2:
        raise ValueError(f"grouped_mm_swiglu: w's columns must be [gate | up], an even number, got {w.shape[2]}")
    if row_weight is not None and row_weight.shape != (x.shape[0],):
        raise ValueError(f"grouped_mm_swiglu: row_weight must be ({x.shape[0]},), one per row of x, "
                         f"got {tuple(row_weight.shape)}")
    if dw_square is not None:
        _check_square(w, dw_square)
    if w_cast is not None:
        _check_cast(x, w, w_cast)
    check_launchable("grouped_mm_swiglu", *(t for t in (x, w, w_cast, offsets, row_weight) if t is not None))
    return torch.ops.optimus.grouped_mm_swiglu(x, w, w_cast, offsets, row_weight, dw_square)[0]


def _launch(x: Tensor, w_lp: Tensor, offsets: Tensor, row_weight: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out, h): fused where the warp-specialized kernel runs, else the two kernels."""
    M, N = x.shape[0], w_lp.shape[2]
    h, out = x.new_empty(M, N), x.new_empty(M, N // 2)
    if row_weight is not None:
        row_weight = row_weight.contiguous()
    if h.numel() and swiglu_unsupported(x, w_lp, h, out, row_weight) is None:
        launch_grouped_mm_ws(x, w_lp, offsets, h, swiglu_out=out, row_weight=row_weight)
        return out, h
    h = _launch_grouped_mm(x, w_lp, offsets)
    return _launch_swiglu(h, row_weight), h


# h is the op's second output so that setup_context can keep it for the backward; nothing else
# reads it, and its gradient is never materialized.
@torch.library.custom_op("optimus::grouped_mm_swiglu", mutates_args=())
def _grouped_mm_swiglu_op(x: Tensor, w: Tensor, w_cast: Tensor | None, offsets: Tensor,
                          row_weight: Tensor | None, dw_square: Tensor | None) -> tuple[Tensor, Tensor]:
    return _launch(x, (w if w_cast is None else w_cast).to(x.dtype), offsets, row_weight)


@_grouped_mm_swiglu_op.register_fake
def _(x, w, w_cast, offsets, row_weight, dw_square):
    return x.new_empty(x.shape[0], w.shape[2] // 2), x.new_empty(x.shape[0], w.shape[2])


def _setup_context(ctx, inputs, output):
    x, w, w_cast, offsets, row_weight, _ = inputs
    ctx.float32_dw = w.dtype != x.dtype
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, w if w_cast is None else w_cast, offsets, output[1], row_weight)


def _backward(ctx, dout, _):
    x, w_lp, offsets, h, row_weight = ctx.saved_tensors  # a float32 w is cast again inside dx
    d_row_weight = None
    if dout is None:  # out took no part in the loss
        dout = h.new_zeros(h.shape[0], h.shape[1] // 2)
    if row_weight is None:
        dh = _swiglu_backward_op(h, dout)
    else:
        dh, d_row_weight = _swiglu_weighted_backward_op(h, row_weight, dout)
    dx, dw, square = _grads(ctx, x, w_lp, offsets, dh, ctx.float32_dw)
    return dx, dw, None, None, d_row_weight if ctx.needs_input_grad[4] else None, square


_grouped_mm_swiglu_op.register_autograd(_backward, setup_context=_setup_context)
