"""The experts' MLP, swiglu(x @ w_up) @ w_down per group, with the SwiGLU fused into its GEMMs.

    expert_mlp(x_MD, w_up_GD2H, w_down_GHN, offsets_G, *, row_weight=None, backend="triton",
               keep_cast=False, up_cast=None, down_cast=None, up_square=None, down_square=None) -> y_MN

y = grouped_mm(swiglu(grouped_mm(x, w_up, offsets), row_weight), w_down, offsets): the values,
shapes, dtypes and gradients of those three ops (optimus_kernels.grouped_mm, optimus_kernels.swiglu: shapes,
``keep_cast``, the weights' copies ``*_cast`` and their gradients' squares ``*_square`` as
``w_cast`` and ``dw_square`` there). Suffixes: M rows, D in-features, H hidden features, N
out-features, G groups.

What differs is where the SwiGLU runs, with the triton backend on Hopper (kernels/optimus_kernels/hopper/grouped_mm_ws.py):
- forward: the up projection's epilogue writes h = x @ w_up[g], which the backward needs, and
  out = silu(gate) * up * row_weight from the same 16-bit values (``swiglu_out``). Each work item
  loads the gate's columns c + [0, B/2) and the up's H + c + [0, B/2) into one B-column tile (B
  the kernel's tile width, grouped_mm_ws.default_config), so one accumulator holds both halves
  of its outputs. The swiglu pass (read h, write out: 6 bytes a row and hidden feature) gives
  way to the epilogue's store of out (2).
- backward: the down projection's dx epilogue takes its tile of d out (rounded to 16 bits, as
  the dx kernel stores it, but never stored), reads h's gate and up and writes dh and each row's
  share of the row weights' gradient (``launch_grouped_mm_ws_swiglu_backward``): d out's store
  and the swiglu backward pass (12 bytes a row and hidden feature) give way to the epilogue's 8
  (h read, dh written).
Both give the three ops' bits (the weights' gradient to float32 rounding: its sums run in another
order), and the backward allocates no d out. Elsewhere
(other devices, the interpreter, H not whole tiles) the same two ops run the kernels one after
the other. The autograd seam: the up op returns h beside out, and the down op
takes both; its backward differentiates through the SwiGLU to h and the row weights and gives
out no gradient, so the up op's backward starts from dh. Hence the two ops are used together,
here only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import check_launchable
from .grouped_mm import (_check_args, _check_cast, _check_square, _grads, _grouped_mm_dw_op, _grouped_mm_dw_squares_op,
                         _launch_grouped_mm, _launch_grouped_mm_dx, allows, grouped_mm)
from .hopper.grouped_mm_ws import (launch_grouped_mm_ws, launch_grouped_mm_ws_swiglu_backward,
                                   swiglu_backward_unsupported, swiglu_unsupported)
from .swiglu import (_launch_swiglu, _launch_swiglu_bwd, _launch_swiglu_weighted_bwd, _swiglu_backward_op,
                     _swiglu_weighted_backward_op, swiglu)


def expert_mlp(x: Tensor, w_up: Tensor, w_down: Tensor, offsets: Tensor, *, row_weight: Tensor | None = None,
               backend: str = "triton", keep_cast: bool = False, up_cast: Tensor | None = None,
               down_cast: Tensor | None = None, up_square: Tensor | None = None,
               down_square: Tensor | None = None) -> Tensor:
    """grouped_mm(swiglu(grouped_mm(x, w_up), row_weight), w_down) with the SwiGLU fused where the
    triton backend can (module docstring)."""
    _check_args(x, w_up, offsets)
    if w_up.shape[2] % 2 or w_down.shape[1] != w_up.shape[2] // 2 or w_down.shape[0] != w_up.shape[0]:
        raise ValueError(f"expert_mlp: need w_up (G, D, 2H) = [gate | up] and w_down (G, H, N), got "
                         f"{tuple(w_up.shape)} and {tuple(w_down.shape)}")
    if row_weight is not None and row_weight.shape != (x.shape[0],):
        raise ValueError(f"expert_mlp: row_weight must be ({x.shape[0]},), one per row of x, "
                         f"got {tuple(row_weight.shape)}")
    copies_kept = keep_cast and (w_up.dtype != x.dtype and up_cast is None or w_down.dtype != x.dtype and down_cast is None)
    if backend != "triton" or copies_kept:  # the three ops (keep_cast: grouped_mm's op that keeps its copy)
        h = grouped_mm(x, w_up, offsets, backend=backend, keep_cast=keep_cast, w_cast=up_cast, dw_square=up_square)
        out = swiglu(h, row_weight=row_weight, backend=backend)
        return grouped_mm(out, w_down, offsets, backend=backend, keep_cast=keep_cast, w_cast=down_cast,
                          dw_square=down_square)
    for w, cast, square in ((w_up, up_cast, up_square), (w_down, down_cast, down_square)):
        if square is not None:
            _check_square(w, square)
        if cast is not None:
            _check_cast(x, w, cast)
    check_launchable("expert_mlp", *(t for t in (x, w_up, w_down, offsets, row_weight) if t is not None))
    out, h = torch.ops.optimus.grouped_mm_swiglu(x, w_up, up_cast, offsets, row_weight, up_square)
    return torch.ops.optimus.swiglu_down(out, h, row_weight, w_down, down_cast, offsets, down_square)


def _launch_up(x: Tensor, w_lp: Tensor, offsets: Tensor, row_weight: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out, h) of the up projection: fused where the warp-specialized kernel runs, else the
    GEMM then the swiglu kernel."""
    M, N = x.shape[0], w_lp.shape[2]
    h, out = x.new_empty(M, N), x.new_empty(M, N // 2)
    if row_weight is not None:
        row_weight = row_weight.contiguous()
    if h.numel() and allows("warp_specialized") and swiglu_unsupported(x, w_lp, h, out, row_weight) is None:
        launch_grouped_mm_ws(x, w_lp, offsets, h, swiglu_out=out, row_weight=row_weight)
        return out, h
    return _launch_swiglu(_launch_grouped_mm(x, w_lp, offsets, y=h), row_weight, out=out), h


def _launch_down_dh(dy: Tensor, w_lp: Tensor, offsets: Tensor, h: Tensor,
                    row_weight: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(dh, d row_weight or None) from the down projection's dy: the SwiGLU's backward in the dx
    epilogue where the warp-specialized kernel runs, else dx then the swiglu backward kernel."""
    if row_weight is not None:
        row_weight = row_weight.contiguous()
    if allows("warp_specialized") and swiglu_backward_unsupported(dy, w_lp, h, h, row_weight) is None:  # dh: h's layout
        dh = torch.empty_like(h)
        return dh, launch_grouped_mm_ws_swiglu_backward(dy, w_lp, offsets, h, dh, row_weight)
    d_out = _launch_grouped_mm_dx(dy, w_lp, offsets)
    if row_weight is None:
        return _launch_swiglu_bwd(h, d_out), None
    return _launch_swiglu_weighted_bwd(h, row_weight, d_out)


# ---------------------------------------------------------------- the up projection and its SwiGLU
# h is the op's second output so that the down op can take it (module docstring); gradients are
# not materialized: out's never arrives when the down op took it.
@torch.library.custom_op("optimus::grouped_mm_swiglu", mutates_args=())
def _grouped_mm_swiglu_op(x: Tensor, w: Tensor, w_cast: Tensor | None, offsets: Tensor,
                          row_weight: Tensor | None, dw_square: Tensor | None) -> tuple[Tensor, Tensor]:
    return _launch_up(x, (w if w_cast is None else w_cast).to(x.dtype), offsets, row_weight)


@_grouped_mm_swiglu_op.register_fake
def _(x, w, w_cast, offsets, row_weight, dw_square):
    return x.new_empty(x.shape[0], w.shape[2] // 2), x.new_empty(x.shape[0], w.shape[2])


def _up_setup(ctx, inputs, output):
    x, w, w_cast, offsets, row_weight, _ = inputs
    ctx.float32_dw = w.dtype != x.dtype
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, w if w_cast is None else w_cast, offsets, output[1], row_weight)


def _up_backward(ctx, d_out, dh):
    x, w_lp, offsets, h, row_weight = ctx.saved_tensors  # a float32 w is cast again inside dx
    d_row_weight = None
    if d_out is not None:  # out's gradient, where something but the down op read it
        if row_weight is None:
            dh_out = _swiglu_backward_op(h, d_out)
        else:
            dh_out, d_row_weight = _swiglu_weighted_backward_op(h, row_weight, d_out)
        dh = dh_out if dh is None else dh + dh_out
    if dh is None:
        return None, None, None, None, None, None
    dx, dw, square = _grads(ctx, x, w_lp, offsets, dh, ctx.float32_dw)
    return dx, dw, None, None, d_row_weight if ctx.needs_input_grad[4] else None, square


_grouped_mm_swiglu_op.register_autograd(_up_backward, setup_context=_up_setup)


# ---------------------------------------------------------------- the down projection of the SwiGLU
@torch.library.custom_op("optimus::swiglu_down", mutates_args=())
def _swiglu_down_op(out: Tensor, h: Tensor, row_weight: Tensor | None, w: Tensor, w_cast: Tensor | None,
                    offsets: Tensor, dw_square: Tensor | None) -> Tensor:
    return _launch_grouped_mm(out, (w if w_cast is None else w_cast).to(out.dtype), offsets)


@_swiglu_down_op.register_fake
def _(out, h, row_weight, w, w_cast, offsets, dw_square):
    return out.new_empty(out.shape[0], w.shape[2])


@torch.library.custom_op("optimus::swiglu_down_dh", mutates_args=())
def _swiglu_down_dh_op(dy: Tensor, w: Tensor, offsets: Tensor, h: Tensor,
                       row_weight: Tensor | None) -> tuple[Tensor, Tensor]:
    """(dh, d row_weight; an empty tensor without row weights)."""
    dh, d_row_weight = _launch_down_dh(dy, w.to(dy.dtype), offsets, h, row_weight)
    return dh, h.new_empty(0, dtype=torch.float32) if d_row_weight is None else d_row_weight


@_swiglu_down_dh_op.register_fake
def _(dy, w, offsets, h, row_weight):
    return h.new_empty(h.shape), (h.new_empty(0, dtype=torch.float32) if row_weight is None
                                  else row_weight.new_empty(row_weight.shape))


def _down_setup(ctx, inputs, output):
    out, h, row_weight, w, w_cast, offsets, _ = inputs
    ctx.float32_dw = w.dtype != out.dtype
    ctx.save_for_backward(out, h, row_weight, w if w_cast is None else w_cast, offsets)


def _down_backward(ctx, dy):
    out, h, row_weight, w_lp, offsets = ctx.saved_tensors
    dh = d_row_weight = dw = square = None
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        dh, d_row_weight = _swiglu_down_dh_op(dy, w_lp, offsets, h, row_weight)
        d_row_weight = d_row_weight if ctx.needs_input_grad[2] else None
    if ctx.needs_input_grad[3] and ctx.needs_input_grad[6]:
        dw, square = _grouped_mm_dw_squares_op(out, dy, offsets, ctx.float32_dw)
    elif ctx.needs_input_grad[3]:
        dw = _grouped_mm_dw_op(out, dy, offsets, ctx.float32_dw)
    return None, dh, d_row_weight, dw, None, None, square


_swiglu_down_op.register_autograd(_down_backward, setup_context=_down_setup)
