"""The experts' SwiGLU MLP with the activation inside the GEMMs: two passes fewer each way.

    expert_mlp(x_MD, w_up_EDF2, w_down_EFD, offsets_E, row_weight_M, *, up_square=None,
               down_square=None) -> y_MD
    expert_mlp_reference(x_MD, w_up_EDF2, w_down_EFD, offsets_E, row_weight_M) -> y_MD
    expert_mlp_unsupported(x_MD, w_up_EDF2, w_down_EFD) -> str | None    # why not, or None

y = grouped_mm(swiglu(grouped_mm(x, w_up), row_weight), w_down): the same function as those
three ops (kernels.grouped_mm, kernels.swiglu), bit for bit in the forward and in every gradient
but row_weight's, whose row sums add their terms in another order. Shape suffixes as in
kernels/__init__.py; F2 = 2F, the up projection's [gate | up] columns.

Why: unfused, the up projection writes h (M x 2F), the SwiGLU pass reads it back and writes its
output (M x F); the backward's dx of the down projection writes d(output), which the SwiGLU
backward reads back with h to write dh. Here
- the forward's up projection computes a tile of gate columns and the same tile of up columns
  in one program (two accumulators), and its epilogue stores h, which the backward needs, and
  silu(gate) * up * row_weight, the down projection's input: the SwiGLU pass and its read of h
  are gone;
- the backward's dx of the down projection loads h's tiles in its epilogue and stores dh and
  row_weight's partial row sums (one per column tile, added after in a fixed order): the
  SwiGLU backward pass and the round trip of d(output) are gone.
At Mula-7B-A1B's shapes and 32k tokens that is about 1.1 GB of HBM traffic less per layer each
way (bench/NOTES.md measures what it buys).

Where it runs: anywhere the triton backend runs, for weights in x's dtype: the expert weights as
the default plans multiply by them (bf16 copies that carry the gradients on one GPU, weights
gathered in bf16 under sharding; float32 in the CPU interpreter). The fused kernels are Hopper
TMA kernels (grouped_mm_tma's loop and clipping); where those cannot run on the tensors
(grouped_mm_tma.tma_unsupported: Intel XPU, pre-sm90 GPUs, unaligned rows) the op computes the
same values with the unfused kernels. Float32 master weights cast inside the op, weight copies
without gradients and row_weight None are not taken (expert_mlp_unsupported says why);
optimus_core.model.experts runs the three ops there. The weights' gradients come back in their
dtype; ``up_square`` / ``down_square`` as grouped_mm's ``dw_square``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import INTERPRET, autotuned, bucket, check_launchable, device_guard, jit, tile_configs, tl, triton
from .grouped_mm import _check_square, _grouped_mm_dw_op, _grouped_mm_dw_squares_op, _grouped_mm_dx_op
from .grouped_mm import _launch_grouped_mm, _launch_grouped_mm_dx, grouped_mm_reference
from .grouped_mm_tiles import locate_tile, segment_tiles
from .grouped_mm_tma import _num_programs, _scratch, tma_unsupported
from .swiglu import _launch_swiglu, _launch_swiglu_weighted_bwd, swiglu_reference


def expert_mlp_reference(x: Tensor, w_up: Tensor, w_down: Tensor, offsets: Tensor, row_weight: Tensor) -> Tensor:
    """The three ops' plain-torch references, composed."""
    h = swiglu_reference(grouped_mm_reference(x, w_up, offsets), row_weight)
    return grouped_mm_reference(h, w_down, offsets)


def expert_mlp_unsupported(x: Tensor, w_up: Tensor, w_down: Tensor) -> str | None:
    """Why expert_mlp cannot take these tensors, or None (module docstring: scope). Host-side
    shapes and dtypes only, so that torch.compile traces it."""
    if x.dim() != 2 or w_up.dim() != 3 or w_down.dim() != 3 or w_up.shape[2] % 2 \
            or w_up.shape[1] != x.shape[1] or w_down.shape[1] * 2 != w_up.shape[2] \
            or w_down.shape[2] != x.shape[1] or w_up.shape[0] != w_down.shape[0]:
        return (f"shapes: need x (M, D), w_up (E, D, 2F), w_down (E, F, D); got {tuple(x.shape)}, "
                f"{tuple(w_up.shape)}, {tuple(w_down.shape)}")
    if w_up.dtype != x.dtype or w_down.dtype != x.dtype:
        return f"the weights must be in x's dtype {x.dtype} (got {w_up.dtype}, {w_down.dtype}): no cast inside"
    return None


def expert_mlp(x: Tensor, w_up: Tensor, w_down: Tensor, offsets: Tensor, row_weight: Tensor, *,
               up_square: Tensor | None = None, down_square: Tensor | None = None) -> Tensor:
    """The fused experts' MLP (module docstring); raises with the reason where it cannot run."""
    reason = expert_mlp_unsupported(x, w_up, w_down)
    if reason is not None:
        raise ValueError(f"expert_mlp: {reason}; use kernels.grouped_mm and kernels.swiglu")
    E = w_up.shape[0]
    if offsets.dtype != torch.int32 or offsets.shape != (E,):
        raise ValueError(f"expert_mlp: offsets must be int32 of shape ({E},), got {offsets.dtype} {tuple(offsets.shape)}")
    if row_weight.shape != (x.shape[0],):
        raise ValueError(f"expert_mlp: row_weight must be ({x.shape[0]},), one per row, got {tuple(row_weight.shape)}")
    for w, square in ((w_up, up_square), (w_down, down_square)):
        if square is not None:
            _check_square(w, square)
    check_launchable("expert_mlp", x, w_up, w_down, offsets, row_weight)
    return torch.ops.optimus.expert_mlp(x, w_up, w_down, offsets, row_weight, up_square, down_square)[0]


# ---------------------------------------------------------------- kernels
def _configs(device_type: str, dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); BLOCK_N counts F's columns: the forward keeps
    a BLOCK_N tile of gate and one of up (two accumulators: 128 x 128 is today's 128 x 256 tile),
    the dx kernel one tile of d(output) beside h's two tiles in its epilogue."""
    if INTERPRET:
        return tile_configs([(16, 16, 16, 1, 1)])
    return tile_configs([(128, 128, 64, 8, 3), (128, 128, 64, 8, 2), (128, 64, 64, 4, 4),
                         (128, 64, 64, 8, 4), (64, 128, 64, 4, 4)])


@autotuned(_configs, key=["F", "K", "M_BUCKET"])
@jit
def _up_swiglu_kernel(
    x_ptr, w_ptr, h_ptr, out_ptr, rw_ptr, offsets_ptr,
    M, F, K, G, stride_xm,
    M_BUCKET,  # autotune key only
    SEGMENTS: tl.constexpr,  # a power of two >= G + 1
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """h[rows of g] = x[rows of g] @ w[g] (M x 2F, [gate | up]) and out = silu(gate) * up * rw
    (M x F), rounded as the unfused ops round: h to x's dtype first, the rest from it. A work
    item is a (row tile, column tile of F); the loop and its clipping are the forward TMA
    kernel's (grouped_mm_tma), h's stores go through an (M, 2, F) view so that a gate tile past
    F is dropped, not written over up's columns."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G * K, 2 * F], strides=[2 * F, 1],
                                       block_shape=[BLOCK_K, BLOCK_N])
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, 2, F], strides=[2 * F, F, 1],
                                       block_shape=[BLOCK_M, 1, BLOCK_N])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, F], strides=[F, 1], block_shape=[BLOCK_M, BLOCK_N])

    seg, starts, ends, tiles, tiles_end = segment_tiles(offsets_ptr, M, G, SEGMENTS, BLOCK_M)
    num_n = tl.cdiv(F, BLOCK_N)
    work = tl.sum(tiles, 0) * num_n
    for item in tl.range(tl.program_id(0), work, tl.num_programs(0)):
        tile = item // num_n
        n0 = item % num_n * BLOCK_N
        g, row_start, row_end = locate_tile(tile, seg, starts, ends, tiles, tiles_end, BLOCK_M)
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.where(g < G, K, 0)  # the tail segment keeps both at 0
        k_main = k_end - k_end % BLOCK_K
        for k in range(0, k_main, BLOCK_K):
            a = x_desc.load([row_start, k])
            acc_gate = tl.dot(a, w_desc.load([g * K + k, n0]), acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, w_desc.load([g * K + k, F + n0]), acc_up, input_precision="ieee")
        if k_main < k_end:  # the partial last K block: the next group's rows of w zeroed
            a = x_desc.load([row_start, k_main])
            ks_ok = (k_main + tl.arange(0, BLOCK_K) < K)[:, None]
            b = w_desc.load([g * K + k_main, n0])
            acc_gate = tl.dot(a, tl.where(ks_ok, b, tl.zeros_like(b)), acc_gate, input_precision="ieee")
            b = w_desc.load([g * K + k_main, F + n0])
            acc_up = tl.dot(a, tl.where(ks_ok, b, tl.zeros_like(b)), acc_up, input_precision="ieee")

        gate = acc_gate.to(h_ptr.dtype.element_ty)
        up = acc_up.to(h_ptr.dtype.element_ty)
        rows = row_start + tl.arange(0, BLOCK_M)
        rw = tl.load(rw_ptr + rows, mask=rows < row_end, other=0.0).to(tl.float32)
        gate32 = gate.to(tl.float32)
        out = (gate32 * tl.sigmoid(gate32) * up.to(tl.float32) * rw[:, None]).to(out_ptr.dtype.element_ty)
        if row_start + BLOCK_M <= row_end:
            h_desc.store([row_start, 0, n0], tl.reshape(gate, (BLOCK_M, 1, BLOCK_N)))
            h_desc.store([row_start, 1, n0], tl.reshape(up, (BLOCK_M, 1, BLOCK_N)))
            out_desc.store([row_start, n0], out)
        else:  # a tile ending inside its group: the next group's rows belong to another program
            cols = n0 + tl.arange(0, BLOCK_N)
            mask = (rows < row_end)[:, None] & (cols < F)[None, :]
            h_ptrs = h_ptr + rows[:, None].to(tl.int64) * 2 * F + cols[None, :]
            tl.store(h_ptrs, gate, mask=mask)
            tl.store(h_ptrs + F, up, mask=mask)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * F + cols[None, :], out, mask=mask)


@autotuned(_configs, key=["F", "K", "M_BUCKET"], reset_to_zero=["part_ptr"])
@jit
def _down_dx_swiglu_kernel(
    dy_ptr, w_ptr, h_ptr, rw_ptr, dh_ptr, part_ptr, offsets_ptr,
    M, F, K, G, stride_dym, PARTS,
    M_BUCKET,  # autotune key only
    SEGMENTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """d(out) = dy @ w[g]^T (w (G, F, K) as the forward's down projection read it, K = D,
    tiles transposed in shared memory as grouped_mm_tma's dx), then in the epilogue SwiGLU's
    backward from h: dh (M x 2F) and part[r, n0 / BLOCK_N] = sum over the tile's columns of
    d(out) * silu(gate) * up, row_weight's gradient in pieces. d(out) is rounded to dy's dtype
    first, as the unfused dx kernel stores it."""
    dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, K], strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G * F, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, 2, F], strides=[2 * F, F, 1],
                                       block_shape=[BLOCK_M, 1, BLOCK_N])
    dh_desc = tl.make_tensor_descriptor(dh_ptr, shape=[M, 2, F], strides=[2 * F, F, 1],
                                        block_shape=[BLOCK_M, 1, BLOCK_N])

    seg, starts, ends, tiles, tiles_end = segment_tiles(offsets_ptr, M, G, SEGMENTS, BLOCK_M)
    num_n = tl.cdiv(F, BLOCK_N)
    work = tl.sum(tiles, 0) * num_n
    for item in tl.range(tl.program_id(0), work, tl.num_programs(0)):
        tile = item // num_n
        n0 = item % num_n * BLOCK_N
        g, row_start, row_end = locate_tile(tile, seg, starts, ends, tiles, tiles_end, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # w's rows past F belong to group g + 1: they land in columns >= F, masked below
        for k in range(0, tl.where(g < G, K, 0), BLOCK_K):
            acc = tl.dot(dy_desc.load([row_start, k]), tl.trans(w_desc.load([g * F + n0, k])), acc,
                         input_precision="ieee")

        rows = row_start + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        row_ok = rows < row_end
        dout = acc.to(dh_ptr.dtype.element_ty).to(tl.float32)
        gate = tl.reshape(h_desc.load([row_start, 0, n0]), (BLOCK_M, BLOCK_N)).to(tl.float32)
        up = tl.reshape(h_desc.load([row_start, 1, n0]), (BLOCK_M, BLOCK_N)).to(tl.float32)
        rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        s = tl.sigmoid(gate)
        silu = gate * s
        part = tl.sum(tl.where((cols < F)[None, :], dout * silu * up, 0.0), 1)
        dout = dout * rw[:, None]
        dgate = (dout * up * (s + silu * (1.0 - s))).to(dh_ptr.dtype.element_ty)
        dup = (dout * silu).to(dh_ptr.dtype.element_ty)
        tl.store(part_ptr + rows.to(tl.int64) * PARTS + n0 // BLOCK_N, part, mask=row_ok)
        if row_start + BLOCK_M <= row_end:
            dh_desc.store([row_start, 0, n0], tl.reshape(dgate, (BLOCK_M, 1, BLOCK_N)))
            dh_desc.store([row_start, 1, n0], tl.reshape(dup, (BLOCK_M, 1, BLOCK_N)))
        else:
            mask = row_ok[:, None] & (cols < F)[None, :]
            dh_ptrs = dh_ptr + rows[:, None].to(tl.int64) * 2 * F + cols[None, :]
            tl.store(dh_ptrs, dgate, mask=mask)
            tl.store(dh_ptrs + F, dup, mask=mask)


# ---------------------------------------------------------------- launchers
def _launch_up_swiglu(x: Tensor, w_up: Tensor, offsets: Tensor, row_weight: Tensor) -> tuple[Tensor, Tensor]:
    """(h (M, 2F), out (M, F)) in x's dtype."""
    (M, K), G, F = x.shape, offsets.shape[0], w_up.shape[2] // 2
    h, out = x.new_empty(M, 2 * F), x.new_empty(M, F)
    if out.numel() == 0:
        return h, out
    grid = _persistent_grid(x, M, G, F)
    triton.set_allocator(_scratch(x.device))  # per launch: the backward runs on autograd's thread
    with device_guard(x):
        _up_swiglu_kernel(x.device.type, x.dtype)[grid](
            x, w_up, h, out, row_weight.contiguous(), offsets, M, F, K, G, x.stride(0), bucket(M),
            SEGMENTS=triton.next_power_of_2(G + 1))
    return h, out


def _launch_down_dx_swiglu(dy: Tensor, w_down: Tensor, offsets: Tensor, h: Tensor,
                           row_weight: Tensor) -> tuple[Tensor, Tensor]:
    """(dh (M, 2F) in dy's dtype, d row_weight (M,) in its dtype)."""
    dy = dy.contiguous()
    (M, K), G, F = dy.shape, offsets.shape[0], w_down.shape[1]
    dh = dy.new_empty(M, 2 * F)
    if M == 0:
        return dh, row_weight.new_empty(0)
    if F == 0:
        return dh, row_weight.new_zeros(M)
    # one partial sum per column tile of the config with the narrowest tiles; zeros elsewhere
    parts = triton.cdiv(F, min(c.kwargs["BLOCK_N"] for c in _configs(dy.device.type, dy.dtype)))
    part = torch.zeros(M, parts, dtype=torch.float32, device=dy.device)
    grid = _persistent_grid(dy, M, G, F)
    triton.set_allocator(_scratch(dy.device))
    with device_guard(dy):
        _down_dx_swiglu_kernel(dy.device.type, dy.dtype)[grid](
            dy, w_down, h, row_weight.contiguous(), dh, part, offsets, M, F, K, G, dy.stride(0), parts,
            bucket(M), SEGMENTS=triton.next_power_of_2(G + 1))
    return dh, part.sum(1).to(row_weight.dtype)


def _persistent_grid(t: Tensor, M: int, G: int, F: int):
    programs = _num_programs(t.device)

    def grid(meta):
        return (min(programs, (triton.cdiv(M, meta["BLOCK_M"]) + G) * triton.cdiv(F, meta["BLOCK_N"])),)
    return grid


def _up_tma_unsupported(x: Tensor, w_up: Tensor) -> str | None:
    """Why the fused forward's TMA kernel cannot read x and w_up and write h and the SwiGLU
    output (new, so only their row strides can fail), or None."""
    F = w_up.shape[2] // 2
    return tma_unsupported(x, w_up, x.new_empty(0, 2 * F)) or tma_unsupported(x, w_up, x.new_empty(0, F))


# ---------------------------------------------------------------- torch custom ops
# The op returns h and the SwiGLU output beside y so that setup_context can keep them for the
# backward (as grouped_mm_keep_cast keeps its copy); expert_mlp returns y alone.
@torch.library.custom_op("optimus::expert_mlp", mutates_args=())
def _expert_mlp_op(x: Tensor, w_up: Tensor, w_down: Tensor, offsets: Tensor, row_weight: Tensor,
                   up_square: Tensor | None = None, down_square: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    if _up_tma_unsupported(x, w_up) is None:
        h, out = _launch_up_swiglu(x, w_up, offsets, row_weight)
    else:  # the same values from the unfused kernels (the pointer kernels: XPU, pre-sm90)
        h = _launch_grouped_mm(x, w_up, offsets)
        out = _launch_swiglu(h, row_weight)
    return _launch_grouped_mm(out, w_down, offsets), h, out


@_expert_mlp_op.register_fake
def _(x, w_up, w_down, offsets, row_weight, up_square=None, down_square=None):
    F = w_down.shape[1]
    return x.new_empty(x.shape[0], w_down.shape[2]), x.new_empty(x.shape[0], 2 * F), x.new_empty(x.shape[0], F)


@torch.library.custom_op("optimus::expert_mlp_down_dx", mutates_args=())
def _down_dx_op(dy: Tensor, w_down: Tensor, offsets: Tensor, h: Tensor, row_weight: Tensor) -> tuple[Tensor, Tensor]:
    if tma_unsupported(dy, w_down, h) is None:
        return _launch_down_dx_swiglu(dy, w_down, offsets, h, row_weight)
    return _launch_swiglu_weighted_bwd(h, row_weight, _launch_grouped_mm_dx(dy, w_down, offsets))


@_down_dx_op.register_fake
def _(dy, w_down, offsets, h, row_weight):
    return h.new_empty(h.shape), row_weight.new_empty(row_weight.shape)


def _setup_context(ctx, inputs, output):
    x, w_up, w_down, offsets, row_weight, _, _ = inputs
    _, h, out = output
    ctx.save_for_backward(x, w_up, w_down, offsets, row_weight, h, out)


def _weight_grad(wants_w: bool, wants_square: bool, x: Tensor, dy: Tensor, offsets: Tensor):
    """(dw, sum of its squares) in x's dtype (the weights are), either None where not wanted."""
    if wants_w and wants_square:
        return _grouped_mm_dw_squares_op(x, dy, offsets, False)
    return (_grouped_mm_dw_op(x, dy, offsets, False) if wants_w else None), None


def _backward(ctx, dy, _dh, _dout):
    x, w_up, w_down, offsets, row_weight, h, out = ctx.saved_tensors
    # trailing inputs left at their default (None squares) are not in needs_input_grad
    wants = (*ctx.needs_input_grad, False, False)
    wants_x, wants_up, wants_down, _, wants_rw, wants_up_sq, wants_down_sq = wants[:7]
    dy = dy.contiguous()
    dw_down, down_sq = _weight_grad(wants_down, wants_down_sq, out, dy, offsets)
    dx = dw_up = up_sq = drw = None
    if wants_x or wants_up or wants_rw:
        dh, drw = _down_dx_op(dy, w_down, offsets, h, row_weight)
        dx = _grouped_mm_dx_op(dh, w_up, offsets) if wants_x else None
        dw_up, up_sq = _weight_grad(wants_up, wants_up_sq, x, dh, offsets)
    return dx, dw_up, dw_down, None, drw if wants_rw else None, up_sq, down_sq


_expert_mlp_op.register_autograd(_backward, setup_context=_setup_context)
