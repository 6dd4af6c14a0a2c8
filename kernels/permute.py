"""Token permutation around the experts: group token copies by expert, and the weighted
top-k combine back.

    permute(x_TD, topk_idx_Tk, n_experts, *, backend="triton", n_rows=None)
        -> (x_sorted_RD, offsets_E, sorted_idx_R)
    unpermute(y_sorted_RD, sorted_idx_R, topk_weights_Tk, *, backend="triton") -> out_TD
    permute_reference(...), unpermute_reference(...): the same in plain torch.

Shape suffixes: T tokens, k experts per token (top-k), R = T*k assignments, D features,
E experts. Assignment a = t*k + j is token t's j-th choice, topk_idx[t, j].

- permute: x_TD any float dtype; topk_idx_Tk integer, values in [0, E). Returns
  x_sorted (R, D) with x_sorted[i] = x[sorted_idx[i] // k], rows grouped by expert in ascending
  expert order and, within an expert, in token order (a stable sort); offsets int32 (E,), the
  cumulative group ends that grouped_mm takes; sorted_idx int64 (R,), the assignment of each
  sorted row. Differentiable in x: dx[t] = sum_j dx_sorted[pos(t*k+j)].
  ``n_rows`` (a host int <= R): only the first n_rows sorted rows are made, (n_rows, D). For
  callers that know how many assignments go to real experts, the rest sorting last into a
  phantom group no expert computes (expert parallelism: another rank's experts) — those rows
  would cost a copy, the GEMMs' zero tails and the elementwise passes for nothing.
- unpermute: out[t] = sum_j topk_weights[t, j] * y_sorted[pos(t*k+j)], pos the inverse of
  sorted_idx. Products and sum run in (at least) float32; out has y_sorted's dtype. Differentiable
  in y_sorted (dy_sorted[i] = w[a] * dout[a // k], a = sorted_idx[i]) and in topk_weights
  (dw[a] = <dout[a // k], y_sorted[i]>, in topk_weights' dtype). y_sorted may hold only the
  first n <= R sorted rows (permute's ``n_rows``): assignments sorted past them add nothing and
  get dw = 0.

Backends: "loop" and "torch" both run the plain-torch reference; "triton" runs our kernels
(the expert sort itself is torch.sort either way). Nothing here syncs with the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import autotuned, check_launchable, device_guard, jit, row_configs, tl, triton

BACKENDS = ("loop", "torch", "triton")


def permute_reference(x: Tensor, topk_idx: Tensor, n_experts: int,
                      n_rows: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)
    sorted_idx = torch.argsort(flat, stable=True)
    # Counted with index_add, not bincount, whose output size depends on the data (a host sync,
    # and a shape torch.compile cannot trace).
    counts = flat.new_zeros(n_experts).index_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    return x[sorted_idx[:n_rows] // k], offsets, sorted_idx


def unpermute_reference(y_sorted: Tensor, sorted_idx: Tensor, topk_weights: Tensor) -> Tensor:
    T, k = topk_weights.shape
    missing = len(sorted_idx) - len(y_sorted)  # rows not made (permute's n_rows) count as zeros
    y_sorted = torch.cat([y_sorted, y_sorted.new_zeros(missing, y_sorted.shape[1])]) if missing else y_sorted
    y = y_sorted[torch.argsort(sorted_idx)]  # the inverse permutation: back to (t, j) order
    acc = torch.promote_types(y.dtype, torch.float32)  # at least float32, as the kernel sums
    out = (y.view(T, k, y.shape[1]).to(acc) * topk_weights.to(acc).unsqueeze(-1)).sum(1)
    return out.to(y_sorted.dtype)


def permute(x: Tensor, topk_idx: Tensor, n_experts: int, *, backend: str = "triton",
            n_rows: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Group token copies by expert; see the module docstring."""
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"permute: need x (T, D) and topk_idx (T, k), "
                         f"got {tuple(x.shape)} and {tuple(topk_idx.shape)}")
    if n_rows is not None and not 0 <= n_rows <= topk_idx.numel():
        raise ValueError(f"permute: n_rows = {n_rows} must be in [0, T*k = {topk_idx.numel()}]")
    if backend in ("loop", "torch"):
        return permute_reference(x, topk_idx, n_experts, n_rows)
    if backend != "triton":
        raise ValueError(f"permute: backend must be one of {BACKENDS}, got {backend!r}")
    check_launchable("permute", x, topk_idx)
    sorted_experts, sorted_idx = torch.sort(topk_idx.reshape(-1), stable=True)
    # Group ends by binary search in the sorted experts: unlike bincount, no host sync.
    experts = torch.arange(n_experts, device=x.device, dtype=sorted_experts.dtype)
    offsets = torch.searchsorted(sorted_experts, experts, right=True, out_int32=True)
    n_rows = sorted_idx.numel() if n_rows is None else n_rows
    return torch.ops.optimus.permute_rows(x, sorted_idx, topk_idx.shape[1], n_rows), offsets, sorted_idx


def unpermute(y_sorted: Tensor, sorted_idx: Tensor, topk_weights: Tensor, *,
              backend: str = "triton") -> Tensor:
    """Weighted top-k combine back to token order; see the module docstring."""
    R = topk_weights.numel()
    if y_sorted.dim() != 2 or topk_weights.dim() != 2 or sorted_idx.shape != (R,) or len(y_sorted) > R:
        raise ValueError(f"unpermute: need y_sorted (n <= T*k, D), sorted_idx (T*k,), topk_weights (T, k); "
                         f"got {tuple(y_sorted.shape)}, {tuple(sorted_idx.shape)}, {tuple(topk_weights.shape)}")
    if backend in ("loop", "torch"):
        return unpermute_reference(y_sorted, sorted_idx, topk_weights)
    if backend != "triton":
        raise ValueError(f"unpermute: backend must be one of {BACKENDS}, got {backend!r}")
    check_launchable("unpermute", y_sorted, sorted_idx, topk_weights)
    return torch.ops.optimus.unpermute(y_sorted, sorted_idx, topk_weights)


# ---------------------------------------------------------------- kernels
@autotuned(row_configs, key=["D"])
@jit
def _permute_kernel(x_ptr, sorted_idx_ptr, out_ptr, R, D, stride_x, stride_out,
                    TOPK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[i] = x[sorted_idx[i] // TOPK]: a row gather, BLOCK_R rows x BLOCK_D columns."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    src = tl.load(sorted_idx_ptr + rows, mask=rows < R, other=0) // TOPK
    v = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=mask)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], v, mask=mask)


@autotuned(row_configs, key=["D"])
@jit
def _combine_kernel(y_ptr, inv_ptr, w_ptr, out_ptr, T, D, N_Y, stride_y, stride_out,
                    TOPK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[inv[t*TOPK + j]]: each token gathers its k rows, so the sum
    needs no atomics and is deterministic. Rows at or past N_Y (not made) add nothing."""
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = tokens < T
    mask = t_ok[:, None] & (cols < D)[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        a = tokens.to(tl.int64) * TOPK + j
        pos = tl.load(inv_ptr + a, mask=t_ok, other=0)
        made = t_ok & (pos < N_Y)
        weight = tl.load(w_ptr + a, mask=made, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + pos[:, None] * stride_y + cols[None, :], mask=mask & made[:, None], other=0.0)
        acc += weight[:, None] * y.to(tl.float32)
    tl.store(out_ptr + tokens[:, None].to(tl.int64) * stride_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@autotuned(row_configs, key=["D"])
@jit
def _unpermute_bwd_kernel(dout_ptr, y_ptr, sorted_idx_ptr, w_ptr, dy_ptr, dw_ptr, R, D,
                          stride_dout, stride_y, stride_dy,
                          TOPK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Both gradients of unpermute in one pass over the sorted rows i (assignment a):
    dy[i] = w[a] * dout[a // TOPK] and dw[a] = <dout[a // TOPK], y[i]>. A program owns whole
    rows (it loops over D), so each dw entry is a plain store."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < R
    a = tl.load(sorted_idx_ptr + rows, mask=r_ok, other=0)
    weight = tl.load(w_ptr + a, mask=r_ok, other=0.0).to(tl.float32)
    src = a // TOPK
    rows64 = rows.to(tl.int64)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for d in range(0, D, BLOCK_D):
        cols = d + tl.arange(0, BLOCK_D)
        mask = r_ok[:, None] & (cols < D)[None, :]
        g = tl.load(dout_ptr + src[:, None] * stride_dout + cols[None, :], mask=mask, other=0.0)
        g = g.to(tl.float32)
        y = tl.load(y_ptr + rows64[:, None] * stride_y + cols[None, :], mask=mask, other=0.0)
        y = y.to(tl.float32)
        tl.store(dy_ptr + rows64[:, None] * stride_dy + cols[None, :],
                 (weight[:, None] * g).to(dy_ptr.dtype.element_ty), mask=mask)
        dot += tl.sum(g * y, 1)
    tl.store(dw_ptr + a, dot.to(dw_ptr.dtype.element_ty), mask=r_ok)


# ---------------------------------------------------------------- launchers
def _rows_grid(n_rows: int, D: int):
    return lambda meta: (triton.cdiv(n_rows, meta["BLOCK_R"]), triton.cdiv(D, meta["BLOCK_D"]))


def _launch_permute(x: Tensor, sorted_idx: Tensor, k: int, n_rows: int) -> Tensor:
    x, sorted_idx = x.contiguous(), sorted_idx.contiguous()  # no-ops when already contiguous
    R, D = n_rows, x.shape[1]  # the first n_rows sorted rows
    out = x.new_empty(R, D)
    if out.numel():
        with device_guard(x):
            _permute_kernel(x.device.type)[_rows_grid(R, D)](
                x, sorted_idx, out, R, D, x.stride(0), out.stride(0), TOPK=k)
    return out


def _launch_unpermute(y_sorted: Tensor, sorted_idx: Tensor, weights: Tensor) -> Tensor:
    y_sorted, sorted_idx, weights = y_sorted.contiguous(), sorted_idx.contiguous(), weights.contiguous()
    (T, k), D = weights.shape, y_sorted.shape[1]
    # inv[a] = the sorted row of assignment a: a scatter, so no sort and no host sync
    positions = torch.arange(len(sorted_idx), device=sorted_idx.device)
    inv = torch.empty_like(sorted_idx).scatter_(0, sorted_idx, positions)
    out = y_sorted.new_empty(T, D)
    if out.numel():
        with device_guard(y_sorted):
            _combine_kernel(y_sorted.device.type)[_rows_grid(T, D)](
                y_sorted, inv, weights, out, T, D, y_sorted.shape[0], y_sorted.stride(0), out.stride(0), TOPK=k)
    return out


def _launch_unpermute_bwd(dout: Tensor, y_sorted: Tensor, sorted_idx: Tensor,
                          weights: Tensor) -> tuple[Tensor, Tensor]:
    dout, y_sorted, weights = dout.contiguous(), y_sorted.contiguous(), weights.contiguous()
    sorted_idx = sorted_idx.contiguous()
    (R, D), k = y_sorted.shape, weights.shape[1]
    dy = torch.empty_like(y_sorted)
    # Assignments sorted past the rows made (permute's n_rows) get no store below: dw = 0.
    dw = torch.empty_like(weights) if R == weights.numel() else torch.zeros_like(weights)
    if R:
        with device_guard(dout):
            _unpermute_bwd_kernel(dout.device.type)[lambda meta: (triton.cdiv(R, meta["BLOCK_R"]),)](
                dout, y_sorted, sorted_idx, weights, dy, dw, R, D,
                dout.stride(0), y_sorted.stride(0), dy.stride(0), TOPK=k)
    return dy, dw


# ---------------------------------------------------------------- torch custom ops
# register_autograd plays the role of a torch.autograd.Function, and torch.compile traces it.
@torch.library.custom_op("optimus::permute_rows", mutates_args=())
def _permute_rows_op(x: Tensor, sorted_idx: Tensor, k: int, n_rows: int) -> Tensor:
    return _launch_permute(x, sorted_idx, k, n_rows)


@_permute_rows_op.register_fake
def _(x, sorted_idx, k, n_rows):
    return x.new_empty(n_rows, x.shape[1])


def _permute_setup(ctx, inputs, output):
    x, sorted_idx, k, _ = inputs
    ctx.save_for_backward(sorted_idx)
    ctx.shape = (x.shape[0], k)


def _permute_backward(ctx, dx_sorted):
    (sorted_idx,) = ctx.saved_tensors
    # dx[t] = sum of its k copies' gradients: the combine with unit weights.
    ones = torch.ones(ctx.shape, device=dx_sorted.device, dtype=torch.float32)
    return _unpermute_op(dx_sorted, sorted_idx, ones), None, None, None


_permute_rows_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("optimus::unpermute", mutates_args=())
def _unpermute_op(y_sorted: Tensor, sorted_idx: Tensor, topk_weights: Tensor) -> Tensor:
    return _launch_unpermute(y_sorted, sorted_idx, topk_weights)


@_unpermute_op.register_fake
def _(y_sorted, sorted_idx, topk_weights):
    return y_sorted.new_empty(topk_weights.shape[0], y_sorted.shape[1])


@torch.library.custom_op("optimus::unpermute_backward", mutates_args=())
def _unpermute_backward_op(dout: Tensor, y_sorted: Tensor, sorted_idx: Tensor,
                           topk_weights: Tensor) -> tuple[Tensor, Tensor]:
    return _launch_unpermute_bwd(dout, y_sorted, sorted_idx, topk_weights)


@_unpermute_backward_op.register_fake
def _(dout, y_sorted, sorted_idx, topk_weights):
    return y_sorted.new_empty(y_sorted.shape), topk_weights.new_empty(topk_weights.shape)


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unpermute_backward(ctx, dout):
    y_sorted, sorted_idx, weights = ctx.saved_tensors
    dy, dw = _unpermute_backward_op(dout, y_sorted, sorted_idx, weights)
    return dy, None, dw


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)
