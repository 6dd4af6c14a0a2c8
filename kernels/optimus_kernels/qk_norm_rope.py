"""The attention's QK-norm and rotary embedding in one pass: RMSNorm over the whole projection,
then RoPE on each head, forward and backward each one Triton kernel.

    y_BSD = qk_norm_rope(x_BSD, weight_D, cos_SDh, sin_SDh, eps=1e-5)            # Triton
    y_BSD = qk_norm_rope_reference(x_BSD, weight_D, cos_SDh, sin_SDh, eps=1e-5)  # plain torch

Suffixes: B batch, S sequence, D the projection's width (heads x Dh), Dh head dim (even), T = B * S
rows. Per row t at position s = t mod S, in float32 from x's own dtype, with h = Dh / 2 and each
head's halves x1 = x[..., :h], x2 = x[..., h:]:

    n        = x * rsqrt(mean_D(x^2) + eps) * weight                     (OLMoE's q_norm / k_norm)
    y[:h]    = n1 * cos[s, :h] - n2 * sin[s, :h]                         (rotate-half RoPE, per head)
    y[h:]    = n2 * cos[s, h:] + n1 * sin[s, h:]

rounded once to x's dtype. This is optimus_core.model's RMSNorm followed by apply_rotary, except
that the model's torch path rounds n to x's dtype between the two (under bf16 autocast); here n
stays in float32, so the two paths differ by that rounding only.

Backward (dy -> dx, dweight): dn1 = dy1 cos1 + dy2 sin2, dn2 = dy2 cos2 - dy1 sin1; with xhat = x *
rstd and g = dn * weight, dx = rstd * (g - xhat * mean_D(g * xhat)) and dweight = sum_t dn * xhat.
The backward recomputes rstd from x, which it reads anyway, so the op keeps only x (its input,
in its own dtype) for the backward, as the model's RMSNorm does. dweight is summed without
atomics: each program adds its rows' share into its own float32 row of a (programs, D) buffer,
summed after, in an order fixed by T and the tile, so two runs give the same bits.

Why: eager torch runs this as a dozen float32 passes, and Inductor
inside a compiled block as a looped reduction that reads q and k three times. Here a program holds
whole rows of D <= 8192 in registers: x is read once, each head's rotate-half partner comes from
the same registers, y is written once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import INTERPRET, check_launchable, device_guard, jit, tl, triton

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
MAX_WIDTH = 8192  # a row lives in registers: D up to this (the Mula models have 2048 and 4096)
# dweight's partial sums: at most this many programs (rows of the buffer), whatever the device,
# so that its summation order, and so its bits, depend on T (and the tile) alone
BACKWARD_PROGRAMS = 512
# A GPU tile: rows enough for about this many elements of each half, and the warps that run it
TILE_ELEMENTS = 1024
WARPS = 4


def _check(x_BSD: Tensor, weight_D: Tensor, cos_SDh: Tensor, sin_SDh: Tensor) -> None:
    op = "qk_norm_rope"
    if not isinstance(x_BSD, Tensor) or x_BSD.ndim != 3 or x_BSD.dtype not in FLOATS:
        raise ValueError(f"{op}: x_BSD must be a 3-D float32, bfloat16 or float16 tensor (batch, sequence, "
                         f"width), got {getattr(x_BSD, 'dtype', type(x_BSD).__name__)} of shape "
                         f"{tuple(getattr(x_BSD, 'shape', ()))}")
    S, D = x_BSD.shape[1], x_BSD.shape[2]
    if weight_D.shape != (D,) or weight_D.dtype not in FLOATS:
        raise ValueError(f"{op}: weight_D must be a float tensor of shape ({D},), one scale per feature of x, "
                         f"got {weight_D.dtype} {tuple(weight_D.shape)}")
    if cos_SDh.ndim != 2 or cos_SDh.shape != sin_SDh.shape:
        raise ValueError(f"{op}: cos_SDh and sin_SDh must be 2-D tables of one shape (positions, head dim), "
                         f"got {tuple(cos_SDh.shape)} and {tuple(sin_SDh.shape)}")
    Dh = cos_SDh.shape[1]
    if Dh == 0 or Dh % 2 or D % Dh:
        raise ValueError(f"{op}: the head dim (the tables' width, {Dh}) must be even and divide x's width {D}")
    if cos_SDh.shape[0] < S:
        raise ValueError(f"{op}: the tables hold {cos_SDh.shape[0]} positions, x has {S}")
    if D > MAX_WIDTH:
        raise ValueError(f"{op}: width {D} > {MAX_WIDTH}: a row must fit one program's registers")


def qk_norm_rope_reference(x_BSD: Tensor, weight_D: Tensor, cos_SDh: Tensor, sin_SDh: Tensor, *,
                           eps: float = 1e-5) -> Tensor:
    """The module's arithmetic in plain torch (float32, or float64 for float64 inputs), one
    rounding to x's dtype; differentiable in x and weight."""
    acc = torch.promote_types(x_BSD.dtype, torch.float32)
    B, S, D = x_BSD.shape
    Dh = cos_SDh.shape[1]
    x = x_BSD.to(acc)
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight_D.to(acc)
    n_BSHDh = n.view(B, S, D // Dh, Dh)
    half = Dh // 2
    rotated = torch.cat((-n_BSHDh[..., half:], n_BSHDh[..., :half]), dim=-1)
    cos, sin = cos_SDh[:S, None].to(acc), sin_SDh[:S, None].to(acc)
    return (n_BSHDh * cos + rotated * sin).reshape(B, S, D).to(x_BSD.dtype)


def qk_norm_rope(x_BSD: Tensor, weight_D: Tensor, cos_SDh: Tensor, sin_SDh: Tensor, *,
                 eps: float = 1e-5) -> Tensor:
    """RMSNorm(x) * weight, then RoPE per head (module docstring), by the Triton kernels;
    differentiable in x and weight. Raises on bad shapes, dtypes or devices, and where Triton
    cannot launch (then use qk_norm_rope_reference)."""
    _check(x_BSD, weight_D, cos_SDh, sin_SDh)
    check_launchable("qk_norm_rope", x_BSD, weight_D, cos_SDh, sin_SDh)
    return torch.ops.optimus.qk_norm_rope(x_BSD, weight_D, cos_SDh, sin_SDh, float(eps))


# ---------------------------------------------------------------- kernels
@jit
def _load_halves(ptr, lo, HALF, mask):
    """A row's first and second halves of every head, as (heads, half) float32 tiles."""
    return (tl.load(ptr + lo, mask=mask, other=0.0).to(tl.float32),
            tl.load(ptr + lo + HALF, mask=mask, other=0.0).to(tl.float32))


@jit
def _qk_norm_rope_fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, T, S, H, HALF, stride_x, stride_y,
                             stride_cs, eps, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_HALF: tl.constexpr):
    """Rows [pid * BLOCK_T, +BLOCK_T), each as (heads, half-head) tiles of its two halves."""
    r = (tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    p = tl.arange(0, BLOCK_HALF)[None, None, :]
    in_row = (h < H) & (p < HALF)
    mask = in_row & (r < T)
    lo = h * (2 * HALF) + p  # each head's first half; its second half is HALF further
    x1, x2 = _load_halves(x_ptr + r * stride_x, lo, HALF, mask)
    w1, w2 = _load_halves(w_ptr, lo, HALF, in_row)
    mean_sq = (tl.sum(tl.sum(x1 * x1, 2), 1) + tl.sum(tl.sum(x2 * x2, 2), 1)) / (2 * H * HALF)
    rstd = tl.rsqrt(mean_sq + eps)[:, None, None]
    n1, n2 = x1 * rstd * w1, x2 * rstd * w2
    c1, c2 = _load_halves(cos_ptr, (r % S) * stride_cs + p, HALF, (r < T) & (p < HALF))
    s1, s2 = _load_halves(sin_ptr, (r % S) * stride_cs + p, HALF, (r < T) & (p < HALF))
    y_row = y_ptr + r * stride_y + lo
    tl.store(y_row, (n1 * c1 - n2 * s1).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + HALF, (n2 * c2 + n1 * s2).to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _qk_norm_rope_bwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, dy_ptr, dx_ptr, dw_partial_ptr, T, S, H, HALF,
                             stride_x, stride_dy, stride_dx, stride_cs, eps, rows_per_program,
                             BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rows [pid * rows_per_program, +rows_per_program) of dx, BLOCK_T at a time, and their sum
    of dn * xhat into row pid of the partial dweight buffer."""
    pid = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[None, :, None]
    p = tl.arange(0, BLOCK_HALF)[None, None, :]
    in_row = (h < H) & (p < HALF)
    lo = h * (2 * HALF) + p
    w1, w2 = _load_halves(w_ptr, lo, HALF, in_row)
    dw1 = tl.zeros((BLOCK_H, BLOCK_HALF), tl.float32)
    dw2 = tl.zeros((BLOCK_H, BLOCK_HALF), tl.float32)
    D = 2 * H * HALF
    for i in range(0, rows_per_program, BLOCK_T):
        r = (pid.to(tl.int64) * rows_per_program + i + tl.arange(0, BLOCK_T))[:, None, None]
        mask = in_row & (r < T)
        x1, x2 = _load_halves(x_ptr + r * stride_x, lo, HALF, mask)
        dy1, dy2 = _load_halves(dy_ptr + r * stride_dy, lo, HALF, mask)
        c1, c2 = _load_halves(cos_ptr, (r % S) * stride_cs + p, HALF, (r < T) & (p < HALF))
        s1, s2 = _load_halves(sin_ptr, (r % S) * stride_cs + p, HALF, (r < T) & (p < HALF))
        dn1 = dy1 * c1 + dy2 * s2  # RoPE's transpose
        dn2 = dy2 * c2 - dy1 * s1
        rstd = tl.rsqrt((tl.sum(tl.sum(x1 * x1, 2), 1) + tl.sum(tl.sum(x2 * x2, 2), 1)) / D + eps)[:, None, None]
        xh1, xh2 = x1 * rstd, x2 * rstd
        dw1 += tl.sum(dn1 * xh1, 0)
        dw2 += tl.sum(dn2 * xh2, 0)
        g1, g2 = dn1 * w1, dn2 * w2
        mean_gx = ((tl.sum(tl.sum(g1 * xh1, 2), 1) + tl.sum(tl.sum(g2 * xh2, 2), 1)) / D)[:, None, None]
        dx_row = dx_ptr + r * stride_dx + lo
        tl.store(dx_row, (rstd * (g1 - xh1 * mean_gx)).to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_row + HALF, (rstd * (g2 - xh2 * mean_gx)).to(dx_ptr.dtype.element_ty), mask=mask)
    partial = dw_partial_ptr + pid.to(tl.int64) * D + lo
    tl.store(partial, tl.reshape(dw1, (1, BLOCK_H, BLOCK_HALF)), mask=in_row)
    tl.store(partial + HALF, tl.reshape(dw2, (1, BLOCK_H, BLOCK_HALF)), mask=in_row)


# ---------------------------------------------------------------- launchers
def _tiles(D: int, Dh: int) -> dict:
    """The kernels' tile: BLOCK_T rows of (heads, half-head) tiles, about TILE_ELEMENTS elements
    of each half a tile (a GPU: 8 bf16, 16 bytes, per thread at 256 threads); the interpreter
    takes 2 rows, so that the tests' odd row counts end in a partial tile."""
    H, half = D // Dh, Dh // 2
    block_h, block_half = triton.next_power_of_2(H), triton.next_power_of_2(half)
    if INTERPRET:
        return dict(BLOCK_T=2, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=1)
    rows = max(1, TILE_ELEMENTS // (block_h * block_half))
    return dict(BLOCK_T=rows, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=WARPS)


def _rows(x_BSD: Tensor) -> Tensor:
    """x as (T, D) rows with unit column stride (a view where it can be)."""
    x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
    return x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()


def _tables(cos_SDh: Tensor, sin_SDh: Tensor) -> tuple[Tensor, Tensor]:
    """Both tables as contiguous float32 (no copy where they are: RotaryEmbedding's)."""
    return cos_SDh.float().contiguous(), sin_SDh.float().contiguous()


def _launch_fwd(x_BSD: Tensor, weight_D: Tensor, cos_SDh: Tensor, sin_SDh: Tensor, eps: float) -> Tensor:
    B, S, D = x_BSD.shape
    Dh = cos_SDh.shape[1]
    x_TD = _rows(x_BSD)
    y_TD = torch.empty(x_TD.shape, dtype=x_BSD.dtype, device=x_BSD.device)
    if y_TD.numel():
        cos, sin = _tables(cos_SDh, sin_SDh)
        with device_guard(x_BSD):
            tiles = _tiles(D, Dh)
            _qk_norm_rope_fwd_kernel[(triton.cdiv(x_TD.shape[0], tiles["BLOCK_T"]),)](
                x_TD, weight_D.contiguous(), cos, sin, y_TD, x_TD.shape[0], S, D // Dh, Dh // 2, x_TD.stride(0),
                y_TD.stride(0), cos.stride(0), eps, **tiles)
    return y_TD.view(B, S, D)


def _launch_bwd(x_BSD: Tensor, weight_D: Tensor, cos_SDh: Tensor, sin_SDh: Tensor, dy_BSD: Tensor,
                eps: float) -> tuple[Tensor, Tensor]:
    B, S, D = x_BSD.shape
    Dh = cos_SDh.shape[1]
    x_TD, dy_TD = _rows(x_BSD), _rows(dy_BSD)
    T = x_TD.shape[0]
    dx_TD = torch.empty(x_TD.shape, dtype=x_BSD.dtype, device=x_BSD.device)
    if T == 0:
        return dx_TD.view(B, S, D), torch.zeros_like(weight_D)
    tiles = _tiles(D, Dh)
    # whole tiles a program: at most BACKWARD_PROGRAMS programs, a number fixed by T (and the tile)
    rows_per_program = triton.cdiv(triton.cdiv(T, BACKWARD_PROGRAMS), tiles["BLOCK_T"]) * tiles["BLOCK_T"]
    programs = triton.cdiv(T, rows_per_program)
    partial_PD = torch.empty(programs, D, dtype=torch.float32, device=x_BSD.device)
    cos, sin = _tables(cos_SDh, sin_SDh)
    with device_guard(x_BSD):
        _qk_norm_rope_bwd_kernel[(programs,)](
            x_TD, weight_D.contiguous(), cos, sin, dy_TD, dx_TD, partial_PD, T, S, D // Dh, Dh // 2,
            x_TD.stride(0), dy_TD.stride(0), dx_TD.stride(0), cos.stride(0), eps, rows_per_program, **tiles)
    return dx_TD.view(B, S, D), partial_PD.sum(0).to(weight_D.dtype)


# ---------------------------------------------------------------- torch custom ops
# register_autograd plays the role of a torch.autograd.Function, and torch.compile traces it.
@torch.library.custom_op("optimus::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    return _launch_fwd(x, weight, cos, sin, eps)


@_qk_norm_rope_op.register_fake
def _(x, weight, cos, sin, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("optimus::qk_norm_rope_backward", mutates_args=())
def _qk_norm_rope_backward_op(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, dy: Tensor,
                              eps: float) -> tuple[Tensor, Tensor]:
    return _launch_bwd(x, weight, cos, sin, dy, eps)


@_qk_norm_rope_backward_op.register_fake
def _(x, weight, cos, sin, dy, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, cos, sin, eps = inputs
    ctx.save_for_backward(x, weight, cos, sin)
    ctx.eps = eps


def _backward(ctx, dy):
    x, weight, cos, sin = ctx.saved_tensors
    dx, dweight = _qk_norm_rope_backward_op(x, weight, cos, sin, dy, ctx.eps)
    return dx, dweight, None, None, None


_qk_norm_rope_op.register_autograd(_backward, setup_context=_setup_context)
