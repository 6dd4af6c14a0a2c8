"""Grouped matrix multiply: the experts' GEMM of an MoE layer.

    grouped_mm(x_MK, w_GKN, offsets_G, *, backend="triton", keep_cast=False, w_cast=None,
               dw_square=None) -> y_MN
    grouped_mm_reference(x_MK, w_GKN, offsets_G) -> y_MN
    torch_grouped_mm_unsupported(x_MK, w_GKN) -> str | None

Shape suffixes: M rows (token-to-expert assignments, sorted by group), K in-features,
N out-features, G groups (experts).

- x_MK: (M, K), w_GKN: (G, K, N), both of one dtype: bfloat16, float16 or float32; or w in
  float32 (master weights) with x in bfloat16 / float16: w is cast to x's dtype inside the op
  and dw comes back in float32, written so by the kernel (no cast pass over it). Then
  ``keep_cast`` (triton backend) chooses memory or time: False casts again in the backward, so
  no half-precision copy of the weights is kept alive between them (for 8 OLMoE layers, 6 GiB);
  True keeps the forward's copy for the backward (one cast per step instead of two).
  ``w_cast`` (any backend): a copy of w in x's dtype that someone keeps current (the optimizer
  writes it with each update: optimus_core.model.experts), not requiring grad. The forward and
  dx read it instead of casting w; dw comes back for w, in w's dtype (float32, no cast after).
  ``dw_square`` (any backend): a 0-d float32 tensor that requires grad and is used for nothing
  else. The backward gives it, as its gradient, sum(dw ** 2) of the dw it gives w: the triton
  backend's dW kernel sums the squares of the values it stores (no second read of dw, 1 GiB per
  OLMoE-size expert weight in float32), the others by a pass over dw. The clip's gradient norm
  reads it instead of the gradient (optimus_core.train.grad_norm).
- offsets_G: int32 (G,), cumulative group ends as torch._grouped_mm takes them: group g owns rows
  offsets[g-1] .. offsets[g] (group 0 starts at row 0), G >= 1. Groups may be empty; rows past
  offsets[-1] belong to no group: their outputs are zero and they get zero gradient.
- y_MN: (M, N) in x's dtype, y[rows of g] = x[rows of g] @ w[g]. Differentiable in x and w:
  dx[rows of g] = dy[rows of g] @ w[g]^T and dw[g] = x[rows of g]^T @ dy[rows of g].

Backends:
- "loop": the reference, a Python loop over groups in plain torch (reads offsets on the host).
- "torch": torch._grouped_mm (CUTLASS), where it has a fast path: bfloat16 on CUDA sm90+ with
  K, N multiples of 8; elsewhere it raises with the reason from torch_grouped_mm_unsupported.
  Torch leaves rows past offsets[-1] unwritten (seen on an H200, torch 2.11); this backend
  zeroes them in y and dx with a small Triton kernel that touches only those rows.
- "triton": our kernels, no host sync and no loop over groups. Products accumulate in float32;
  float32 inputs multiply in full fp32 ("ieee", not tf32), as torch.mm does by default. Four
  kernel families, fastest first (FAMILIES); each call takes the fastest its device and
  tensors allow, up to the ceiling the execution plan sets for the process (``family_on``
  names the device's, ``use_family`` sets it; optimus_core.execution prints and records it):
    warp_specialized  (kernels/optimus_kernels/hopper/grouped_mm_ws.py, Hopper: Gluon, 16-bit inputs, the
             forward's K a multiple of 64) a TMA loader warp running ahead of two wgmma
             warpgroups, both on each 128 x 256 tile, or taking turns on 128 x 128 tiles where
             N is an odd multiple of 128 (grouped_mm_ws.default_config), for the forward and for
             dx (reading w as stored, its tiles transposed in shared memory); dW by the TMA kernel;
    tma      (kernels/optimus_kernels/hopper/grouped_mm_tma.py, NVIDIA sm90+ or the interpreter: device-side
             descriptors, 16-bit inputs, 16-byte aligned rows) persistent kernels for the
             forward, dx and dW (dW's items dealt round-robin, largest group first);
    descriptor  the same kernels on Intel XPU (or the interpreter), with PVC configs (256 x 256
             x 32 tiles, 32 warps, grf_mode "256") and one program per Xe core: Intel's Triton
             turns the descriptors into 2D block loads (grouped_mm_tma's docstring); same rules;
    pointer  (here) one program per output tile by pointer loads, dx reading w^T through
             transposed strides (no copy); dW one program per (group, K tile, N tile): what
             runs on pre-sm90 GPUs, float32 on a GPU and unaligned rows, and the reference
             the others are tested against.
  The private launchers (_launch_grouped_mm, _launch_grouped_mm_dx, _launch_grouped_mm_dw)
  take ``tma=False`` to run the pointer kernels where the descriptor kernels (either family)
  could run, for the tests and for bench/kernels.py's pointer rows.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ._triton import (INTERPRET, XPU_LARGE_GRF, autotuned, bucket, check_launchable, device_guard, jit, tile_configs,
                      tl, triton)
from .grouped_mm_tiles import locate_tile, segment_tiles
from .hopper.grouped_mm_tma import (_num_programs, descriptor_device_unsupported, descriptor_unsupported,
                                    launch_grouped_mm_dw_tma, launch_grouped_mm_tma, tma_device_unsupported,
                                    tma_unsupported)
from .hopper.grouped_mm_ws import launch_grouped_mm_ws, ws_device_unsupported, ws_unsupported

BACKENDS = ("loop", "torch", "triton")

def grouped_mm_reference(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """Plain torch: one matmul per group, zero rows past offsets[-1]. Syncs (offsets.tolist()).
    split/unbind rather than slicing, whose backward would zero-fill a full-size gradient per group."""
    ends = offsets.tolist()
    sizes = [end - start for start, end in zip([0] + ends, ends + [x.shape[0]])]
    *groups, tail = x.split(sizes)
    ys = [xg @ wg for xg, wg in zip(groups, w.unbind(0))]
    return torch.cat(ys + [tail.new_zeros(len(tail), w.shape[2])])


def torch_grouped_mm_unsupported(x: Tensor, w: Tensor) -> str | None:
    """Why backend="torch" cannot run these tensors, or None if it can."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if x.device.type != "cuda" or torch.version.cuda is None:
        return (f"torch._grouped_mm's fast path needs an NVIDIA CUDA device (sm90+), "
                f"got {x.device.type}")
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return f"torch._grouped_mm's fast path needs bfloat16 inputs, got {x.dtype} and {w.dtype}"
    major, minor = torch.cuda.get_device_capability(x.device)
    if major < 9:
        return f"torch._grouped_mm's fast path needs compute capability 9.0+, got {major}.{minor}"
    if x.shape[1] % 8 or w.shape[2] % 8:
        return (f"torch._grouped_mm needs K and N multiples of 8 (16-byte rows), "
                f"got K={x.shape[1]} N={w.shape[2]}")
    return None


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor, *, backend: str = "triton",
               keep_cast: bool = False, w_cast: Tensor | None = None, dw_square: Tensor | None = None) -> Tensor:
    """y[rows of g] = x[rows of g] @ w[g]; see the module docstring for shapes, backends,
    ``keep_cast``, ``w_cast`` and ``dw_square``."""
    _check_args(x, w, offsets)
    if dw_square is not None:
        _check_square(w, dw_square)
        if backend in ("loop", "torch"):
            w = _SquareOfGrad.apply(w, dw_square)
            dw_square = None
    if w_cast is not None:
        _check_cast(x, w, w_cast)
        if backend == "triton":
            check_launchable("grouped_mm", x, w, w_cast, offsets)
            return torch.ops.optimus.grouped_mm_cast(x, w, w_cast, offsets, dw_square)
        if backend in ("loop", "torch"):  # the copy stands in for w.to(x.dtype), gradient and all
            w = _AsCast.apply(w, w_cast)
    if backend == "loop":
        return grouped_mm_reference(x, w.to(x.dtype), offsets)
    if backend == "torch":
        reason = torch_grouped_mm_unsupported(x, w.to(x.dtype) if w.dtype != x.dtype else w)
        if reason is not None:
            raise RuntimeError(f"grouped_mm backend='torch' is unavailable: {reason}; "
                               "use backend='triton' or 'loop'")
        return _TorchGroupedMM.apply(x, w, offsets)
    if backend == "triton":
        check_launchable("grouped_mm", x, w, offsets)
        if keep_cast and w.dtype != x.dtype:
            return torch.ops.optimus.grouped_mm_keep_cast(x, w, offsets, dw_square)[0]
        return torch.ops.optimus.grouped_mm(x, w, offsets, dw_square)
    raise ValueError(f"grouped_mm: backend must be one of {BACKENDS}, got {backend!r}")


def _check_args(x: Tensor, w: Tensor, offsets: Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or w.shape[0] == 0:
        raise ValueError(f"grouped_mm: need x (M, K) and w (G, K, N) with G >= 1, "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    if offsets.dtype != torch.int32 or offsets.shape != (w.shape[0],):
        raise ValueError(f"grouped_mm: offsets must be int32 of shape (G,) = ({w.shape[0]},), "
                         f"got {offsets.dtype} {tuple(offsets.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"grouped_mm: x and w must share a dtype among bfloat16, float16, float32 (or w "
                         f"float32 with x in half precision); got {x.dtype} and {w.dtype}")


# ---------------------------------------------------------------- backend "torch"
class _TorchGroupedMM(torch.autograd.Function):
    """Forward and both gradients through torch._grouped_mm, plus zeroing the rows past
    offsets[-1] of y and dx, which torch leaves unwritten."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)  # w as given: a float32 w is cast again in backward
        return _zero_tail(torch._grouped_mm(x, w.to(x.dtype), offs=offsets), offsets)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _zero_tail(torch._grouped_mm(dy, w.to(dy.dtype).transpose(1, 2), offs=offsets), offsets)
        if ctx.needs_input_grad[1]:
            dw = torch._grouped_mm(x.t(), dy, offs=offsets).to(w.dtype)  # offsets split the reduction dim
        return dx, dw, None


@jit
def _zero_tail_kernel(y_ptr, offsets_ptr, M, N, G, stride_y, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """y[offsets[-1]:] = 0, with offsets[-1] read on the device. Programs wholly before it
    return at once, so without a tail this costs about a launch (a masked_fill over all of y
    cost ~0.3 ms of a 0.8 ms product on an H200)."""
    tail_start = tl.load(offsets_ptr + G - 1)
    if (tl.program_id(0) + 1) * BLOCK_R <= tail_start:
        return
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = (rows >= tail_start) & (rows < M)
    zeros = tl.zeros((BLOCK_R, BLOCK_D), dtype=y_ptr.dtype.element_ty)
    for d in range(0, N, BLOCK_D):
        cols = d + tl.arange(0, BLOCK_D)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], zeros,
                 mask=row_ok[:, None] & (cols < N)[None, :])


def _zero_tail(y: Tensor, offsets: Tensor) -> Tensor:
    if triton is None:  # a CUDA torch without Triton: a full pass instead
        tail = torch.arange(y.shape[0], device=y.device) >= offsets[-1:]
        return y.masked_fill_(tail.unsqueeze(1), 0)
    if y.numel():
        with device_guard(y):
            _zero_tail_kernel[(triton.cdiv(y.shape[0], 64),)](
                y, offsets, y.shape[0], y.shape[1], offsets.shape[0], y.stride(0), BLOCK_R=64, BLOCK_D=256)
    return y


# ---------------------------------------------------------------- backend "triton": kernels
def _mm_configs(device_type: str, dtype: torch.dtype):
    """Forward and dx: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), a BLOCK_M x BLOCK_N output
    tile and a BLOCK_K reduction step."""
    if INTERPRET:
        return tile_configs([(16, 16, 16, 1, 1)])
    if dtype == torch.float32:  # exact fp32 products run on FMA units, not tensor cores: big
        # tiles would only unroll into huge, slow-to-compile code for a dtype used in tests
        return tile_configs([(64, 64, 32, 4, 2)])
    if device_type == "xpu":  # Intel Max (PVC): big tiles, 32 warps, the large register file
        return tile_configs([(256, 256, 32, 32, 2), (256, 256, 32, 32, 3), (256, 128, 32, 32, 2),
                             (128, 256, 32, 32, 2), (128, 128, 32, 16, 2)], grf_mode=XPU_LARGE_GRF)
    return tile_configs([(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                         (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 3)])


def _dw_configs(device_type: str, dtype: torch.dtype):
    """dw: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) with a BLOCK_K x BLOCK_N output tile and
    a BLOCK_M reduction step over rows. Tiles 128+ wide in K: measured faster than the forward's
    list on an H200."""
    if INTERPRET or dtype == torch.float32:
        return _mm_configs(device_type, dtype)
    if device_type == "xpu":
        return tile_configs([(32, 256, 256, 32, 2), (32, 256, 256, 32, 3), (32, 256, 128, 32, 2),
                             (32, 128, 256, 32, 2), (32, 128, 128, 16, 2)], grf_mode=XPU_LARGE_GRF)
    return tile_configs([(64, 256, 128, 8, 3), (64, 128, 256, 8, 3), (32, 128, 128, 4, 4),
                         (64, 128, 128, 8, 3), (64, 128, 128, 4, 4)])


@autotuned(_mm_configs, key=["N", "K", "M_BUCKET", "stride_wk", "DX"])
@jit(do_not_specialize=["DX"])  # a key only: one compiled kernel for both
def _grouped_mm_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr,
    M, N, K, G,
    stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, stride_ym, stride_yn,
    M_BUCKET, DX,  # autotune keys only: forward (0) or dx (1); stride_wk tells w from w^T views
    SEGMENTS: tl.constexpr,  # a power of two >= G + 1
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y = x @ w[g] row-block by row-block. Also computes dx = dy @ w[g]^T when given w^T's strides."""
    num_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n

    # Row tiles are numbered group after group (grouped_mm_tiles); the grid, sized
    # cdiv(M, BLOCK_M) + G tiles (each segment adds at most one partial tile), may overshoot.
    seg, starts, ends, tiles, tiles_end = segment_tiles(offsets_ptr, M, G, SEGMENTS, BLOCK_M)
    g, row_start, row_end = locate_tile(tile, seg, starts, ends, tiles, tiles_end, BLOCK_M)
    if g > G:  # past the last tile
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < row_end
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk
    w_ptrs = (w_ptr + tl.minimum(g, G - 1).to(tl.int64) * stride_wg
              + ks[:, None] * stride_wk + cols[None, :] * stride_wn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.where(g < G, K, 0), BLOCK_K):  # the tail segment keeps acc = 0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & (ks[None, :] < K - k), other=0.0)
        b = tl.load(w_ptrs, mask=(ks[:, None] < K - k) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < N))


@autotuned(_dw_configs, key=["N", "K", "M_BUCKET"], reset_to_zero=["squares_ptr"])
@jit
def _grouped_mm_dw_kernel(
    x_ptr, dy_ptr, dw_ptr, offsets_ptr, squares_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_wg, stride_wk, stride_wn,
    M_BUCKET,  # autotune key only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SQUARES: tl.constexpr,  # squares_ptr[program] = the sum of the squares of the tile it stores
):
    """dw[g] = x[rows of g]^T @ dy[rows of g]: one program per (group, K tile, N tile), each
    reducing over its group's rows. An empty group's tiles are written as zeros."""
    num_k = tl.cdiv(K, BLOCK_K)
    num_n = tl.cdiv(N, BLOCK_N)
    g = tl.program_id(0) // (num_k * num_n)
    pid_k = tl.program_id(0) // num_n % num_k
    pid_n = tl.program_id(0) % num_n
    row_end = tl.minimum(tl.load(offsets_ptr + g), M)
    row_start = tl.minimum(tl.load(offsets_ptr + g - 1, mask=g > 0, other=0), row_end)

    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m in range(row_start, row_end, BLOCK_M):
        rows = m + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end  # rows of the next group (or NaN garbage past M) stay out
        xt = tl.load(x_ptr + rows[None, :].to(tl.int64) * stride_xm + ks[:, None] * stride_xk,
                     mask=row_ok[None, :] & (ks[:, None] < K), other=0.0)
        dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * stride_dym + cols[None, :] * stride_dyn,
                     mask=row_ok[:, None] & (cols[None, :] < N), other=0.0)
        acc = tl.dot(xt, dy, acc, input_precision="ieee")
    dw_ptrs = dw_ptr + g.to(tl.int64) * stride_wg + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    out = acc.to(dw_ptr.dtype.element_ty)
    tl.store(dw_ptrs, out, mask=(ks[:, None] < K) & (cols[None, :] < N))
    if SQUARES:  # masked loads left acc = 0 past K and N: the padding adds nothing
        stored = out.to(tl.float32)
        tl.store(squares_ptr + tl.program_id(0), tl.sum(stored * stored))


# ---------------------------------------------------------------- backend "triton": which kernels
# The kernel families of the triton backend, fastest first: each call takes the fastest its
# tensors allow (shapes, dtypes) up to the process's ceiling, which the execution plan sets once
# (optimus_core.execution: one device per process); the portable pointer kernels run anywhere.
FAMILIES = {
    "warp_specialized": "the warp-specialized Gluon kernel for the forward and dx, the TMA kernel for dW",
    "tma": "the TMA kernels",
    "descriptor": "the tensor-descriptor kernels with Intel PVC tiles (2D block loads)",
    "pointer": "the pointer kernels",
}
_ceiling = "warp_specialized"


def family_on(device: torch.device | str) -> tuple[str, str]:
    """(the fastest family of FAMILIES whose kernels can run on ``device``, why): the device's
    Triton and GPU only (a call's shapes may still take a slower one; the interpreter runs the
    TMA kernels on the CPU). Reads the GPU's compute capability: pass a device of this machine,
    or a device type that needs none (xpu, cpu)."""
    device = torch.device(device)
    ws = ws_device_unsupported(device)
    if ws is None:
        return "warp_specialized", f"{FAMILIES['warp_specialized']} (Hopper)"
    tma = tma_device_unsupported(device)
    if tma is None:
        return "tma", f"{FAMILIES['tma']}: {ws}"
    descriptor = descriptor_device_unsupported(device)
    if descriptor is None:
        return "descriptor", f"{FAMILIES['descriptor']}: {tma}"
    return "pointer", f"{FAMILIES['pointer']}: {descriptor if device.type == 'xpu' else tma}"


def use_family(name: str) -> None:
    """No call in this process takes a faster family than ``name`` from now on (the execution
    plan's choice); each still takes the fastest its tensors allow up to it."""
    global _ceiling
    if name not in FAMILIES:
        raise ValueError(f"grouped GEMM kernels {name!r}: must be one of {', '.join(FAMILIES)}")
    _ceiling = name


def allows(family: str) -> bool:
    """Whether a call may take ``family`` under the process's ceiling (use_family)."""
    order = list(FAMILIES)
    return order.index(family) >= order.index(_ceiling)


@contextlib.contextmanager
def ceiling_at_least(name: str):
    """Inside the block, calls may take ``name`` (and every family the ceiling allowed before):
    the ceiling is the faster of the two; restored after. The self-check runs the family
    family_on names this way, whatever ceiling was set before it."""
    global _ceiling
    if name not in FAMILIES:
        raise ValueError(f"grouped GEMM kernels {name!r}: must be one of {', '.join(FAMILIES)}")
    before = _ceiling
    if not allows(name):
        _ceiling = name
    try:
        yield
    finally:
        _ceiling = before


def _descriptor_kernels_unsupported(x: Tensor, w: Tensor, y: Tensor) -> str | None:
    """Why no call on these tensors may take the descriptor kernels (hopper/grouped_mm_tma.py),
    or None: as the tma family (NVIDIA sm90+) or as the descriptor family (Intel XPU), each
    under the ceiling and its own rules; for dW: (x, dw, dy)."""
    tma = tma_unsupported(x, w, y) if allows("tma") else "the ceiling excludes the tma family"
    if tma is None:
        return None
    descriptor = descriptor_unsupported(x, w, y) if allows("descriptor") else "the ceiling excludes it"
    return None if descriptor is None else f"tma: {tma}; descriptor: {descriptor}"


# ---------------------------------------------------------------- backend "triton": launchers
def _launch_grouped_mm(x: Tensor, w: Tensor, offsets: Tensor, *, dx: bool = False, tma: bool = True,
                       y: Tensor | None = None) -> Tensor:
    """y = x @ w[g] per group, w (G, K, N) in any strides: the warp-specialized kernel where it
    runs on these tensors, else the descriptor kernel where it does (the tma family, or the
    descriptor family on an XPU), else the pointer kernel (always the pointer kernel with
    ``tma=False``). ``y``: a contiguous (M, N) tensor in x's dtype to fill, else a new one."""
    (M, K), (G, _, N) = x.shape, w.shape
    y = x.new_empty(M, N) if y is None else y
    if y.numel() == 0:
        return y
    if tma and allows("warp_specialized") and ws_unsupported(x, w, y) is None:
        return launch_grouped_mm_ws(x, w, offsets, y)
    if tma and _descriptor_kernels_unsupported(x, w, y) is None:
        return launch_grouped_mm_tma(x, w, offsets, y, dx=dx)

    def grid(meta):
        return ((triton.cdiv(M, meta["BLOCK_M"]) + G) * triton.cdiv(N, meta["BLOCK_N"]),)

    with device_guard(x):
        _grouped_mm_kernel(x.device.type, x.dtype)[grid](
            x, w, y, offsets, M, N, K, G, *x.stride(), *w.stride(), *y.stride(), bucket(M), int(dx),
            SEGMENTS=triton.next_power_of_2(G + 1))
    return y


def _launch_grouped_mm_dx(dy: Tensor, w: Tensor, offsets: Tensor, *, tma: bool = True) -> Tensor:
    """dx = dy @ w[g]^T per group, w (G, K, N) as the forward got it (float32 master weights
    are cast here): the warp-specialized kernel, else the descriptor kernel (tma or descriptor
    family), reading w as stored where they run on these tensors, else (and with ``tma=False``)
    the pointer kernel reading w^T through transposed strides."""
    w = w.to(dy.dtype)
    if tma:
        dx = dy.new_empty(dy.shape[0], w.shape[1])
        if allows("warp_specialized") and ws_unsupported(dy, w, dx, trans_w=True) is None:
            return launch_grouped_mm_ws(dy, w, offsets, dx, trans_w=True)
        if _descriptor_kernels_unsupported(dy, w, dx) is None:
            if dx.numel():
                launch_grouped_mm_tma(dy, w, offsets, dx, trans_w=True, dx=True)
            return dx
    return _launch_grouped_mm(dy, w.transpose(1, 2), offsets, dx=True, tma=False)


def _launch_grouped_mm_dw(x: Tensor, dy: Tensor, offsets: Tensor, float32_out: bool = False,
                          squares: bool = False, *, tma: bool = True) -> Tensor | tuple[Tensor, Tensor]:
    """dw[g] = x[rows of g]^T @ dy[rows of g], accumulated in float32 and stored in x's dtype or,
    with ``float32_out``, as float32 (the gradient of float32 master weights, no cast after):
    the descriptor dW kernel where it runs on these tensors (tma or descriptor family), else
    (and with ``tma=False``) the pointer dW kernel. With ``squares``: (dw, sum of dw's squares as a 0-d
    float32), the sum taken by the kernel from the values it stores (per program, then added in
    a fixed order) instead of by one more pass over dw."""
    (M, K), N, G = x.shape, dy.shape[1], offsets.shape[0]
    dw = x.new_empty(G, K, N, dtype=torch.float32 if float32_out else x.dtype)
    if dw.numel() == 0 or (M == 0 and squares):
        return (dw.zero_(), dw.new_zeros((), dtype=torch.float32)) if squares else dw
    if tma and _descriptor_kernels_unsupported(x, dw, dy) is None:
        slots = torch.zeros(_num_programs(x.device), dtype=torch.float32, device=x.device) if squares else None
        launch_grouped_mm_dw_tma(x, dy, offsets, dw, squares=slots)
        return (dw, slots.sum()) if squares else dw

    kernel = _grouped_mm_dw_kernel(x.device.type, x.dtype)
    slots = None
    if squares:  # one per program of the config with the most programs (the smallest tiles)
        most = max(triton.cdiv(K, c.kwargs["BLOCK_K"]) * triton.cdiv(N, c.kwargs["BLOCK_N"]) for c in kernel.configs)
        slots = torch.zeros(G * most, dtype=torch.float32, device=x.device)

    def grid(meta):
        return (G * triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    with device_guard(x):
        kernel[grid](x, dy, dw, offsets, dw if slots is None else slots, M, N, K, *x.stride(), *dy.stride(),
                     *dw.stride(), bucket(M), SQUARES=squares)
    return (dw, slots.sum()) if squares else dw


# ---------------------------------------------------------------- torch custom ops
# Custom ops make the kernels opaque, differentiable leaves to torch.compile; register_autograd
# plays the role of a torch.autograd.Function (and unlike one, is traced by AOTAutograd).
# dw_square (every op that makes dw): a 0-d float32 tensor that requires grad and takes part in
# nothing else; its gradient is the sum of dw's squares, which the dW kernel sums as it stores dw.
@torch.library.custom_op("optimus::grouped_mm", mutates_args=())
def _grouped_mm_op(x: Tensor, w: Tensor, offsets: Tensor, dw_square: Tensor | None = None) -> Tensor:
    return _launch_grouped_mm(x, w.to(x.dtype), offsets)


@_grouped_mm_op.register_fake
def _(x, w, offsets, dw_square=None):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("optimus::grouped_mm_dw", mutates_args=())
def _grouped_mm_dw_op(x: Tensor, dy: Tensor, offsets: Tensor, float32_out: bool = False) -> Tensor:
    return _launch_grouped_mm_dw(x, dy, offsets, float32_out)


@_grouped_mm_dw_op.register_fake
def _(x, dy, offsets, float32_out=False):
    return x.new_empty(offsets.shape[0], x.shape[1], dy.shape[1], dtype=torch.float32 if float32_out else x.dtype)


@torch.library.custom_op("optimus::grouped_mm_dw_squares", mutates_args=())
def _grouped_mm_dw_squares_op(x: Tensor, dy: Tensor, offsets: Tensor,
                              float32_out: bool = False) -> tuple[Tensor, Tensor]:
    return _launch_grouped_mm_dw(x, dy, offsets, float32_out, squares=True)


@_grouped_mm_dw_squares_op.register_fake
def _(x, dy, offsets, float32_out=False):
    dw = x.new_empty(offsets.shape[0], x.shape[1], dy.shape[1], dtype=torch.float32 if float32_out else x.dtype)
    return dw, x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("optimus::grouped_mm_dx", mutates_args=())
def _grouped_mm_dx_op(dy: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    return _launch_grouped_mm_dx(dy, w, offsets)


@_grouped_mm_dx_op.register_fake
def _(dy, w, offsets):
    return dy.new_empty(dy.shape[0], w.shape[1])


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])


def _grads(ctx, x, w, offsets, dy, float32_dw: bool):
    """(dx, dw, sum of dw's squares or None) of y = x @ w[g]: dx through w as given (a float32 w
    is cast inside the op), dw in float32 when the weight it belongs to is float32 master
    weights; the squares when the op's last input (dw_square) wants a gradient."""
    dx = _grouped_mm_dx_op(dy, w, offsets) if ctx.needs_input_grad[0] else None
    dw = square = None
    if ctx.needs_input_grad[1] and ctx.needs_input_grad[-1]:
        dw, square = _grouped_mm_dw_squares_op(x, dy, offsets, float32_dw)
    elif ctx.needs_input_grad[1]:
        dw = _grouped_mm_dw_op(x, dy, offsets, float32_dw)
    return dx, dw, square


def _backward(ctx, dy):
    x, w, offsets = ctx.saved_tensors  # w as given: a float32 w is cast again inside the op
    dx, dw, square = _grads(ctx, x, w, offsets, dy, w.dtype != x.dtype)
    return dx, dw, None, square


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


# keep_cast: float32 w, half-precision x. The cast copy is a second output so that setup_context
# can keep it for the backward (an op's internals are not visible to autograd).
@torch.library.custom_op("optimus::grouped_mm_keep_cast", mutates_args=())
def _grouped_mm_keep_cast_op(x: Tensor, w: Tensor, offsets: Tensor,
                             dw_square: Tensor | None = None) -> tuple[Tensor, Tensor]:
    w_lp = w.to(x.dtype)
    return _launch_grouped_mm(x, w_lp, offsets), w_lp


@_grouped_mm_keep_cast_op.register_fake
def _(x, w, offsets, dw_square=None):
    return x.new_empty(x.shape[0], w.shape[2]), w.new_empty(w.shape, dtype=x.dtype)


def _keep_cast_setup(ctx, inputs, output):
    x, _, offsets, _ = inputs
    ctx.save_for_backward(x, output[1], offsets)


def _keep_cast_backward(ctx, dy, _):
    x, w_lp, offsets = ctx.saved_tensors  # the forward's half-precision copy; the weight is float32
    dx, dw, square = _grads(ctx, x, w_lp, offsets, dy, True)
    return dx, dw, None, square


_grouped_mm_keep_cast_op.register_autograd(_keep_cast_backward, setup_context=_keep_cast_setup)


# w_cast: a half-precision copy of w kept current outside (the optimizer writes it), read by the
# forward and dx in place of a cast; dw is written for w, in w's dtype.
@torch.library.custom_op("optimus::grouped_mm_cast", mutates_args=())
def _grouped_mm_cast_op(x: Tensor, w: Tensor, w_cast: Tensor, offsets: Tensor,
                        dw_square: Tensor | None = None) -> Tensor:
    return _launch_grouped_mm(x, w_cast, offsets)  # w is an input only to receive its gradient


@_grouped_mm_cast_op.register_fake
def _(x, w, w_cast, offsets, dw_square=None):
    return x.new_empty(x.shape[0], w.shape[2])


def _cast_setup(ctx, inputs, output):
    x, w, w_cast, offsets, _ = inputs
    ctx.float32_dw = w.dtype != x.dtype
    ctx.save_for_backward(x, w_cast, offsets)


def _cast_backward(ctx, dy):
    x, w_cast, offsets = ctx.saved_tensors
    dx, dw, square = _grads(ctx, x, w_cast, offsets, dy, ctx.float32_dw)
    return dx, dw, None, None, square


_grouped_mm_cast_op.register_autograd(_cast_backward, setup_context=_cast_setup)


class _AsCast(torch.autograd.Function):
    """w_cast in the forward, the gradient back to w in w's dtype: w.to(w_cast.dtype) without
    the cast (the "loop" and "torch" backends, which take w in x's dtype)."""

    @staticmethod
    def forward(ctx, w, w_cast):
        ctx.w_dtype = w.dtype
        return w_cast.view_as(w_cast)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.w_dtype), None


class _SquareOfGrad(torch.autograd.Function):
    """w unchanged in the forward; in the backward, w's gradient as it is, and its sum of
    squares (float32) as the gradient of ``square``: dw_square for the loop and torch backends,
    by one more pass over the gradient (the triton backend's dW kernel sums them as it stores)."""

    @staticmethod
    def forward(ctx, w, square):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        g = grad.float()
        return grad, torch.dot(g.flatten(), g.flatten())


def _check_square(w: Tensor, dw_square: Tensor) -> None:
    if dw_square.shape != () or dw_square.dtype != torch.float32 or dw_square.device != w.device \
            or not dw_square.requires_grad:
        raise ValueError(f"grouped_mm: dw_square must be a 0-d float32 tensor that requires grad, on w's "
                         f"device {w.device}; got {tuple(dw_square.shape)} {dw_square.dtype} on {dw_square.device}, "
                         f"requires_grad={dw_square.requires_grad}")


def _check_cast(x: Tensor, w: Tensor, w_cast: Tensor) -> None:
    if w_cast.shape != w.shape or w_cast.dtype != x.dtype or w_cast.device != w.device:
        raise ValueError(f"grouped_mm: w_cast must be w's shape {tuple(w.shape)} on {w.device} in x's dtype "
                         f"{x.dtype}, got {tuple(w_cast.shape)} {w_cast.dtype} on {w_cast.device}")
    if w_cast.requires_grad:
        raise ValueError("grouped_mm: w_cast must not require grad (the gradient goes to w)")
