"""Token permutation around the experts: group token copies by expert, and the weighted
top-k combine back.

    permute(x_TD, topk_idx_Tk, n_experts, *, backend="triton", n_rows=None)
        -> (x_sorted_RD, offsets_E, sorted_idx_R)
    unpermute(y_sorted_RD, sorted_idx_R, topk_weights_Tk, *, backend="triton") -> out_TD
    unpermute(y_sorted_RD, sorted_idx_R, None, top_k=k, *, backend="triton") -> out_TD  # unweighted
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
  With topk_weights None (and top_k given): the plain sum over each token's k rows, for rows
  that carry their routing weights already (optimus_core.model.experts applies them in the
  SwiGLU); its backward is a gather of dout (permute's kernel) and keeps only sorted_idx.

Backends: "loop" and "torch" both run the plain-torch reference; "triton" runs our kernels.
Nothing here syncs with the host.

The triton backend's expert sort (expert_sort) has no choice to configure; per call:
- the counting sort where it applies (counting_sort_applies: 1 <= groups <= MAX_SORT_GROUPS,
  the phantom group included; fewer than 2^31 assignments; not on Intel XPU): three small
  Triton launches, the custom op optimus::expert_sort: (1) per block of assignments, its count
  per group, into a (groups, blocks) table; (2) per group, the running sum of its row (in
  place); (3) per block, each assignment's position: its group's start (the exclusive sum of
  the totals over groups) + the earlier blocks' count of that group + its rank among the
  block's assignments to that group, in token order. Program 0 of (3) also writes the offsets.
  The result is exactly torch.sort(stable=True)'s order.
- elsewhere torch.sort(stable=True) of the expert ids (a radix sort: several launches) and
  torch.searchsorted for the group ends. On Intel XPU this one runs: the counting kernels
  (one-warp programs, sort_geometry) have not run there.
Both leave the inverse permutation to unpermute (a scatter), since unpermute takes sorted_idx.
expert_sort's private ``counting=False`` runs torch.sort where the counting sort applies, for
the tests and bench/kernels.py's "triton-sort-torch" rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import INTERPRET, autotuned, check_launchable, device_guard, jit, row_configs, tl, triton

BACKENDS = ("loop", "torch", "triton")

# The counting sort's limit: its work per assignment is a one-hot entry per group (groups
# rounded up to a power of two), so it grows with the group count where a radix sort's does
# not. 256 covers 128 experts plus the phantom group, or 256 experts without one; beyond it
# torch.sort runs.
MAX_SORT_GROUPS = 256


def permute_reference(x: Tensor, topk_idx: Tensor, n_experts: int,
                      n_rows: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)
    sorted_idx = torch.argsort(flat, stable=True)
    # Counted with index_add, not bincount, whose output size depends on the data (a host sync,
    # and a shape torch.compile cannot trace).
    counts = flat.new_zeros(n_experts).index_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    # Each token's k copies first, then a gather by a permutation (no index twice), so that the
    # backward sums a token's k rows as a reduction over k, in a fixed order. x[sorted_idx // k]
    # would sum them by index_put_ with accumulate, whose order varies from run to run on a
    # multi-threaded CPU (and index_add_'s, with atomics, on a GPU): two identical runs would
    # differ in the last bit.
    T, D = x.shape
    copies = x.unsqueeze(1).expand(T, k, D).reshape(T * k, D)
    return copies.index_select(0, sorted_idx[:n_rows]), offsets, sorted_idx


def unpermute_reference(y_sorted: Tensor, sorted_idx: Tensor, topk_weights: Tensor | None,
                        top_k: int | None = None) -> Tensor:
    if topk_weights is None:  # unweighted: unit weights, not differentiated
        topk_weights = y_sorted.new_ones(len(sorted_idx) // top_k, top_k, dtype=torch.float32)
    T, k = topk_weights.shape
    missing = len(sorted_idx) - len(y_sorted)  # rows not made (permute's n_rows) count as zeros
    y_sorted = torch.cat([y_sorted, y_sorted.new_zeros(missing, y_sorted.shape[1])]) if missing else y_sorted
    y = y_sorted.index_select(0, torch.argsort(sorted_idx))  # the inverse permutation: back to (t, j) order
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
    sorted_idx, offsets = expert_sort(topk_idx.reshape(-1), n_experts)
    n_rows = sorted_idx.numel() if n_rows is None else n_rows
    return torch.ops.optimus.permute_rows(x, sorted_idx, topk_idx.shape[1], n_rows), offsets, sorted_idx


def counting_sort_applies(ids: Tensor, n_groups: int) -> bool:
    """Whether expert_sort runs the counting sort on these ids (else torch.sort)."""
    return (1 <= n_groups <= MAX_SORT_GROUPS and ids.numel() < 2**31
            and ids.device.type != "xpu")  # untested on Intel GPUs (module docstring)


def expert_sort(ids: Tensor, n_groups: int, *, counting: bool = True) -> tuple[Tensor, Tensor]:
    """(sorted_idx int64 (R,), offsets int32 (n_groups,)) of the group ids (R,), values in
    [0, n_groups): the stable argsort and the cumulative group ends, by the counting sort where
    it applies, else torch.sort (always torch.sort with ``counting=False``: tests, benchmarks)."""
    if counting and counting_sort_applies(ids, n_groups):
        return torch.ops.optimus.expert_sort(ids, n_groups)
    sorted_ids, sorted_idx = torch.sort(ids, stable=True)
    # Group ends by binary search in the sorted ids: unlike bincount, no host sync.
    groups = torch.arange(n_groups, device=ids.device, dtype=sorted_ids.dtype)
    return sorted_idx, torch.searchsorted(sorted_ids, groups, right=True, out_int32=True)


def unpermute(y_sorted: Tensor, sorted_idx: Tensor, topk_weights: Tensor | None, *,
              top_k: int | None = None, backend: str = "triton") -> Tensor:
    """Weighted (or, with topk_weights None and top_k, plain) top-k combine back to token
    order; see the module docstring."""
    if topk_weights is None:
        if top_k is None or top_k < 1 or sorted_idx.dim() != 1 or len(sorted_idx) % top_k:
            raise ValueError(f"unpermute: without topk_weights, top_k must be given and divide "
                             f"len(sorted_idx) = {len(sorted_idx)}; got top_k = {top_k}")
        shape = (len(sorted_idx) // top_k, top_k)
    else:
        shape = tuple(topk_weights.shape)
    R = sorted_idx.numel()
    if y_sorted.dim() != 2 or len(shape) != 2 or shape[0] * shape[1] != R or sorted_idx.dim() != 1 \
            or len(y_sorted) > R:
        raise ValueError(f"unpermute: need y_sorted (n <= T*k, D), sorted_idx (T*k,), topk_weights (T, k); "
                         f"got {tuple(y_sorted.shape)}, {tuple(sorted_idx.shape)}, {shape}")
    if backend in ("loop", "torch"):
        return unpermute_reference(y_sorted, sorted_idx, topk_weights, top_k)
    if backend != "triton":
        raise ValueError(f"unpermute: backend must be one of {BACKENDS}, got {backend!r}")
    if topk_weights is None:
        check_launchable("unpermute", y_sorted, sorted_idx)
        return torch.ops.optimus.unpermute_sum(y_sorted, sorted_idx, top_k)
    check_launchable("unpermute", y_sorted, sorted_idx, topk_weights)
    return torch.ops.optimus.unpermute(y_sorted, sorted_idx, topk_weights)


# ---------------------------------------------------------------- kernels
@jit
def _group_count_kernel(ids_ptr, counts_ptr, R, G, NB, BLOCK,
                        CHUNK: tl.constexpr, GP: tl.constexpr):
    """counts[g, b] = how many of block b's assignments (b*BLOCK ... b*BLOCK + BLOCK - 1) go
    to group g, for g < G (GP >= G counters); the table is (G, NB), a group's row contiguous
    for the scan. Ids outside [0, G) count nowhere."""
    b = tl.program_id(0)
    groups = tl.arange(0, GP)
    counts = tl.zeros((GP,), dtype=tl.int32)
    for c in range(0, BLOCK, CHUNK):
        a = b * BLOCK + c + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + a, mask=a < R, other=-1)
        e = tl.where((e >= 0) & (e < G), e, -1).to(tl.int32)
        counts += tl.sum((e[:, None] == groups[None, :]).to(tl.int32), 0)
    tl.store(counts_ptr + groups * NB + b, counts, mask=groups < G)


@jit
def _group_scan_kernel(counts_ptr, NB, SCAN: tl.constexpr):
    """Row g of the (G, NB) count table -> its inclusive prefix sums, in place: program g."""
    row = counts_ptr + tl.program_id(0) * NB
    carry = tl.zeros((1,), dtype=tl.int32)
    for s in range(0, NB, SCAN):
        cols = s + tl.arange(0, SCAN)
        n = tl.load(row + cols, mask=cols < NB, other=0)
        tl.store(row + cols, tl.cumsum(n, 0) + carry, mask=cols < NB)
        carry += tl.sum(n, 0)


@jit
def _group_place_kernel(ids_ptr, scanned_ptr, sorted_idx_ptr, offsets_ptr, R, G, NB, BLOCK,
                        CHUNK: tl.constexpr, GP: tl.constexpr):
    """The counting sort's placement: block b's assignments into their sorted positions,
    sorted_idx[pos] = a. From the scanned count table: a group's rows start after all lower
    groups' (the exclusive scan of the totals, last column, over groups), and block b's rows
    of a group after the earlier blocks' (column b - 1). Inside the block, assignments keep
    token order: one (CHUNK, GP) one-hot tile per step, its column cumsum the rank in the
    group. Program 0 also writes the offsets (the group ends)."""
    b = tl.program_id(0)
    groups = tl.arange(0, GP)
    total = tl.load(scanned_ptr + groups * NB + NB - 1, mask=groups < G, other=0)
    before = tl.load(scanned_ptr + groups * NB + b - 1, mask=groups < tl.where(b > 0, G, 0), other=0)
    ends = tl.cumsum(total, 0)
    tl.store(offsets_ptr + groups, ends, mask=groups < tl.where(b == 0, G, 0))  # program 0 only
    next_pos = ends - total + before  # where block b's next row of each group goes
    for c in range(0, BLOCK, CHUNK):
        a = b * BLOCK + c + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + a, mask=a < R, other=-1)
        valid = (e >= 0) & (e < G) & (a < R)
        hit = (tl.where(valid, e, -1).to(tl.int32)[:, None] == groups[None, :])
        rank = tl.cumsum(hit.to(tl.int32), 0)  # 1, 2, ... down each group's column: token order
        pos = tl.sum(tl.where(hit, next_pos[None, :] + rank - 1, 0), 1)
        tl.store(sorted_idx_ptr + pos, a.to(tl.int64), mask=valid)
        next_pos += tl.sum(hit.to(tl.int32), 0)


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
                    TOPK: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[inv[t*TOPK + j]] (w = 1 without HAS_WEIGHT): each token
    gathers its k rows, so the sum needs no atomics and is deterministic. Rows at or past N_Y
    (not made) add nothing."""
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = tokens < T
    mask = t_ok[:, None] & (cols < D)[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        a = tokens.to(tl.int64) * TOPK + j
        pos = tl.load(inv_ptr + a, mask=t_ok, other=0)
        made = t_ok & (pos < N_Y)
        y = tl.load(y_ptr + pos[:, None] * stride_y + cols[None, :], mask=mask & made[:, None], other=0.0)
        if HAS_WEIGHT:
            weight = tl.load(w_ptr + a, mask=made, other=0.0).to(tl.float32)
            acc += weight[:, None] * y.to(tl.float32)
        else:
            acc += y.to(tl.float32)
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


def sort_geometry(R: int, G: int, block: int | None = None, chunk: int | None = None) -> dict:
    """The counting sort's launch shape for R assignments over G groups:
    GP     counters per program: G's power-of-two ceiling, >= 16;
    CHUNK  assignments per one-hot (CHUNK, GP) tile, about 4k entries: with one warp (WARPS,
           more for the largest GP) the tile's column scan stays inside the warp, several
           times fewer instructions per assignment than across warps (SASS counts for sm90);
    BLOCK  assignments per count / place program, a multiple of CHUNK: one chunk up to
           4096 programs, longer past that so that the table to scan stays (G, <= 4096);
    NB     count / place programs (blocks); SCAN entries per step of the per-group scan.
    ``chunk`` (a power of two) and ``block`` (a multiple of CHUNK) override them, for tests.
    The interpreter runs programs and loop steps one by one but each tile op at numpy speed,
    so it gets the same chunks, at most 4 blocks and short scan steps.

        >>> sort_geometry(8 * 8192, 65)  # on a GPU: 8k tokens, top-8, 64 experts + a phantom group
        {'GP': 128, 'CHUNK': 32, 'WARPS': 1, 'BLOCK': 32, 'NB': 2048, 'SCAN': 4096}
    """
    GP = max(16, triton.next_power_of_2(G))
    chunk = chunk or min(128, max(16, 4096 // GP))
    if chunk & (chunk - 1):
        raise ValueError(f"sort_geometry: chunk = {chunk} must be a power of two")
    nb_max, scan = (4, 8) if INTERPRET else (4096, 4096)  # on a GPU the scan is one step
    if block is None:
        block = chunk * max(1, triton.cdiv(triton.cdiv(R, nb_max), chunk))
    elif block <= 0 or block % chunk:
        raise ValueError(f"sort_geometry: block = {block} must be a positive multiple of the chunk {chunk}")
    return dict(GP=GP, CHUNK=chunk, WARPS=max(1, GP * chunk // 4096), BLOCK=block,
                NB=triton.cdiv(R, block), SCAN=scan)


def _launch_expert_sort(ids: Tensor, n_groups: int, block: int | None = None,
                        chunk: int | None = None) -> tuple[Tensor, Tensor]:
    ids = ids.contiguous()
    R, G = ids.numel(), n_groups
    sorted_idx = torch.empty(R, device=ids.device, dtype=torch.int64)
    if R == 0:
        return sorted_idx, torch.zeros(G, device=ids.device, dtype=torch.int32)
    offsets = torch.empty(G, device=ids.device, dtype=torch.int32)
    g = sort_geometry(R, G, block, chunk)
    NB, BLOCK, tile = g["NB"], g["BLOCK"], dict(CHUNK=g["CHUNK"], GP=g["GP"], num_warps=g["WARPS"])
    counts = torch.empty(G, NB, device=ids.device, dtype=torch.int32)  # every entry written
    with device_guard(ids):
        _group_count_kernel[(NB,)](ids, counts, R, G, NB, BLOCK, **tile)
        _group_scan_kernel[(G,)](counts, NB, SCAN=g["SCAN"], num_warps=8)
        _group_place_kernel[(NB,)](ids, counts, sorted_idx, offsets, R, G, NB, BLOCK, **tile)
    return sorted_idx, offsets


def _launch_permute(x: Tensor, sorted_idx: Tensor, k: int, n_rows: int) -> Tensor:
    x, sorted_idx = x.contiguous(), sorted_idx.contiguous()  # no-ops when already contiguous
    R, D = n_rows, x.shape[1]  # the first n_rows sorted rows
    out = x.new_empty(R, D)
    if out.numel():
        with device_guard(x):
            _permute_kernel(x.device.type)[_rows_grid(R, D)](
                x, sorted_idx, out, R, D, x.stride(0), out.stride(0), TOPK=k)
    return out


def _launch_unpermute(y_sorted: Tensor, sorted_idx: Tensor, weights: Tensor | None, k: int | None = None) -> Tensor:
    """The combine, weighted by weights (T, k), or a plain sum over k rows with weights None."""
    y_sorted, sorted_idx = y_sorted.contiguous(), sorted_idx.contiguous()
    if weights is not None:
        weights = weights.contiguous()
        k = weights.shape[1]
    T, D = len(sorted_idx) // k, y_sorted.shape[1]
    # inv[a] = the sorted row of assignment a: a scatter, so no sort and no host sync
    positions = torch.arange(len(sorted_idx), device=sorted_idx.device)
    inv = torch.empty_like(sorted_idx).scatter_(0, sorted_idx, positions)
    out = y_sorted.new_empty(T, D)
    if out.numel():
        with device_guard(y_sorted):
            _combine_kernel(y_sorted.device.type)[_rows_grid(T, D)](
                y_sorted, inv, y_sorted if weights is None else weights, out, T, D, y_sorted.shape[0],
                y_sorted.stride(0), out.stride(0), TOPK=k, HAS_WEIGHT=weights is not None)
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
@torch.library.custom_op("optimus::expert_sort", mutates_args=())
def _expert_sort_op(ids: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
    """The counting sort: (sorted_idx int64, offsets int32); integer outputs, no autograd."""
    return _launch_expert_sort(ids, n_groups)


@_expert_sort_op.register_fake
def _(ids, n_groups):
    return ids.new_empty(ids.numel(), dtype=torch.int64), ids.new_empty(n_groups, dtype=torch.int32)


@torch.library.custom_op("optimus::permute_rows", mutates_args=())
def _permute_rows_op(x: Tensor, sorted_idx: Tensor, k: int, n_rows: int) -> Tensor:
    return _launch_permute(x, sorted_idx, k, n_rows)


@_permute_rows_op.register_fake
def _(x, sorted_idx, k, n_rows):
    return x.new_empty(n_rows, x.shape[1])


def _permute_setup(ctx, inputs, output):
    _, sorted_idx, k, _ = inputs
    ctx.save_for_backward(sorted_idx)
    ctx.k = k


def _permute_backward(ctx, dx_sorted):
    (sorted_idx,) = ctx.saved_tensors
    # dx[t] = sum of its k copies' gradients: the unweighted combine.
    return _unpermute_sum_op(dx_sorted, sorted_idx, ctx.k), None, None, None


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


# The unweighted combine: rows that carry their routing weights already. Backward: each row's
# gradient is its token's, a gather by sorted_idx // k, which is what permute's kernel does.
@torch.library.custom_op("optimus::unpermute_sum", mutates_args=())
def _unpermute_sum_op(y_sorted: Tensor, sorted_idx: Tensor, k: int) -> Tensor:
    return _launch_unpermute(y_sorted, sorted_idx, None, k)


@_unpermute_sum_op.register_fake
def _(y_sorted, sorted_idx, k):
    return y_sorted.new_empty(len(sorted_idx) // k, y_sorted.shape[1])


def _unpermute_sum_setup(ctx, inputs, output):
    y_sorted, sorted_idx, k = inputs
    ctx.save_for_backward(sorted_idx)
    ctx.k, ctx.n_rows = k, y_sorted.shape[0]


def _unpermute_sum_backward(ctx, dout):
    (sorted_idx,) = ctx.saved_tensors
    return _permute_rows_op(dout, sorted_idx, ctx.k, ctx.n_rows), None, None


_unpermute_sum_op.register_autograd(_unpermute_sum_backward, setup_context=_unpermute_sum_setup)
