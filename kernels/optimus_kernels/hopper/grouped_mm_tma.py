"""The grouped GEMM's tensor-descriptor kernels (TMA on Hopper) and a persistent grid.

    launch_grouped_mm_tma(x_MK, w, offsets_G, y_MN, *, trans_w=False, dx=False)
    launch_grouped_mm_dw_tma(x_MK, dy_MN, offsets_G, dw_GKN, *, config=None, squares=None)
    tma_unsupported(x_MK, w, y_MN) -> str | None         # NVIDIA sm90+: why not, or None
    descriptor_unsupported(x_MK, w, y_MN) -> str | None  # Intel XPU: why not, or None

Two of grouped_mm.py's kernel families run these kernels: "tma" on NVIDIA sm90+ GPUs, and
"descriptor" on Intel XPU (Max / PVC), with configs of its own per device type (_tma_configs,
_dw_tma_configs) and one program per Xe core. Intel's Triton (intel-xpu-backend-for-triton
v3.6.0) rewrites device-side descriptors into block pointers in its make_ttir
(third_party/intel/lib/Dialect/Triton/Transforms/TensorDescToBlockPointer.cpp), which become 2D
block loads and stores where the row pitch is a multiple of 16 bytes and the last stride 1
(third_party/intel/lib/TritonIntelGPUTransforms/MaterializeBlockPointer.cpp), the rule
tma_unaligned checks; there a masked load of a tensor of pointers, as the pointer kernels' are
(rows against a group's end), gets no block IO (MaterializeTensorOfPointers).

y[rows of g] = x[rows of g] @ B_g with B_g = w[g] for w (G, K, N), or, with trans_w, B_g = w[g]^T
for w (G, N, K): that is dx = dy @ w[g]^T read straight from the forward's weight, transposed in
shared memory instead of copied. And dw[g] = x[rows of g]^T @ dy[rows of g], the weight
gradient. Same contracts as grouped_mm.py's pointer kernels (rows past offsets[-1] come out zero
or add nothing, empty groups, any sizes); kernels/optimus_kernels/grouped_mm.py chooses between them.

Forward and dx: one program per SM loops over the (row tile, column tile) work items, numbered
from offsets on the device (grouped_mm_tiles), so there is no host sync and no idle tail of tiny
programs. Descriptors: x as (M, K), w as one (G*K, N) (or (G*N, K)) matrix, y as (M, N), made
once per program on the device (tl.make_tensor_descriptor; the descriptors live in a small
scratch buffer from the allocator set with triton.set_allocator). Loads past a descriptor's
shape read zeros, stores past it are dropped; that is all the clipping TMA does, so:
- x's rows past a group's end belong to the next group: they feed only output rows that are
  never stored (rows are independent in a matmul).
- w's rows of a K block running past K belong to group g + 1: the last partial K block is
  zeroed in registers (x's columns past K read as zeros already, but 0 * inf would be NaN).
  Transposed, they land in output columns >= N, which the store drops.
- A row tile that ends inside its group (the partial last tile) is stored with masked pointer
  stores: a TMA store would write into the next group's rows, which another program owns.

dW: one program per SM loops over (group, K tile, N tile) items, the groups largest first
(grouped_mm_tiles.groups_by_size), so that the programs running at one time share a group's
rows of x and dy in L2 and the round-robin deal stays balanced under skewed routing. Each item
reduces over its group's rows, BLOCK_R at a time, acc_KN += x_blk^T @ dy_blk, through
descriptors made per item for that group alone: x[rows of g] as (rows, K), dy[rows of g] as
(rows, N), dw[g] as (K, N). So TMA's clipping is the whole of the masking: the last partial
row block reads zeros past the group's end (both operands: rows past offsets[-1] may hold NaN,
and 0 * NaN is NaN), and a K or N tile past dw[g]'s edge is dropped, not written into
dw[g + 1]. An empty group's tiles are stored as zeros (dw is new_empty). The float32 store's
shared-memory staging tile is large (128 KB for a 128 x 256 tile, beside 48 KB per pipeline
stage), so configs with SPLIT_N = 2 store the tile as two BLOCK_K x BLOCK_N/2 halves.

Needs Triton with device-side descriptors (3.4+), an NVIDIA sm90+ GPU or an Intel XPU, 16-bit
inputs with 16-byte aligned rows (K, N multiples of 8), or the interpreter (float32, any
TMA-legal shape). On an XPU, v3.6.0's MaterializeBlockPointer skips block IO for the transposed
A operand of a dot, which dW's x_blk^T is: its x loads may be gathers (not measured on a PVC).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._triton import (INTERPRET, XPU_LARGE_GRF, autotuned, bucket, device_guard, jit, ptxas_report, tile_configs,
                       tl, triton)
from ..grouped_mm_tiles import group_of_rank, groups_by_size, locate_tile, segment_tiles


def tma_unsupported(x: Tensor, w: Tensor, y: Tensor) -> str | None:
    """Why the TMA kernels cannot run on these tensors (w as the kernel reads it), or None; for
    dW: tma_unsupported(x, dw, dy)."""
    problem = tma_device_unsupported(x.device)
    if problem is None and not INTERPRET and x.dtype not in (torch.bfloat16, torch.float16):
        problem = f"the TMA kernel is for 16-bit inputs (float32 runs on FMA units), got {x.dtype}"
    return problem or tma_layout_unsupported(x, w, y)


def tma_device_unsupported(device: torch.device) -> str | None:
    """Why the TMA kernels cannot run on ``device`` (its Triton, its GPU), or None; the Triton
    interpreter runs them on the CPU."""
    if triton is None or not hasattr(tl, "make_tensor_descriptor") or not hasattr(triton, "set_allocator"):
        return f"Triton {getattr(triton, '__version__', None)} has no device-side tensor descriptors"
    if INTERPRET and device.type == "cpu":
        return None
    if device.type != "cuda" or torch.version.cuda is None:
        return f"tensor descriptors (TMA) need an NVIDIA GPU, got {device.type}"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "tensor descriptors (TMA) need compute capability 9.0+"
    return None


def descriptor_unsupported(x: Tensor, w: Tensor, y: Tensor) -> str | None:
    """Why the descriptor family (these kernels on an Intel XPU) cannot run on these tensors (w as
    the kernel reads it), or None; for dW: descriptor_unsupported(x, dw, dy). The same rules as
    tma_unsupported bar the device: 16-bit inputs, 16-byte aligned rows and base (2D block IO's
    pitch and base), w contiguous."""
    problem = descriptor_device_unsupported(x.device)
    if problem is None and not INTERPRET and x.dtype not in (torch.bfloat16, torch.float16):
        problem = f"the descriptor kernel is for 16-bit inputs (float32 runs the pointer kernels), got {x.dtype}"
    return problem or tma_layout_unsupported(x, w, y)


def descriptor_device_unsupported(device: torch.device) -> str | None:
    """Why the descriptor family cannot run on ``device`` (its Triton, its GPU), or None: an Intel
    XPU with Triton's device-side tensor descriptors; the Triton interpreter runs it on the CPU."""
    if triton is None or not hasattr(tl, "make_tensor_descriptor") or not hasattr(triton, "set_allocator"):
        return f"Triton {getattr(triton, '__version__', None)} has no device-side tensor descriptors"
    if INTERPRET and device.type == "cpu":
        return None
    if device.type != "xpu":
        return f"the descriptor kernels' configs are for an Intel XPU, got {device.type}"
    return None


def tma_layout_unsupported(x: Tensor, w: Tensor, y: Tensor) -> str | None:
    """What in these tensors' shapes and strides no TMA kernel here can read (w as one (G*K, N)
    matrix), or None: tma_unsupported less its Triton and device checks."""
    if x.shape[1] == 0:
        return "K = 0: nothing for a descriptor to load"
    if not w.is_contiguous():
        return "w must be contiguous (it is read as one (G*K, N) matrix)"
    return tma_unaligned(x=x, w=w, y=y)


def tma_unaligned(**tensors: Tensor) -> str | None:
    """Which of the named tensors a tensor descriptor cannot address (TMA; Intel's 2D block IO:
    rows contiguous, rows and base 16-byte aligned), or None."""
    for name, t in tensors.items():
        if t.stride(-1) != 1 or any(s * t.element_size() % 16 for s in t.stride()[:-1]) or t.data_ptr() % 16:
            return (f"{name} needs 16-byte aligned rows and base for tensor descriptors, got strides {t.stride()} "
                    f"of {t.element_size()}-byte elements")
    return None


def _tma_configs(device_type: str, dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Shared memory per stage is (BM + BN) * BK * 2
    bytes, plus BM * BN * 2 for the TMA store's staging tile: 128 x 256 x 64 with 3 stages is
    208 KB of the H200's 227 KB. One program per SM: configs small enough for two per SM, so
    that one's epilogue would run under the other's products, measured no faster than these.
    Intel XPU (PVC): the tiles of Intel's PVC GEMM configs (intel-xpu-backend-for-triton v3.6.0,
    benchmarks/triton_kernels_benchmark/gemm_benchmark.py, get_matmul_autotune_configs), 32 warps
    with 256 registers each, one work-group per Xe core: 256 x 256 x 32, and 256 x 128 x 32 and
    64 x 128 x 32 for groups of few rows (stages as there; not yet measured on a PVC)."""
    if INTERPRET:
        return tile_configs([(16, 16, 16, 1, 1)])
    if device_type == "xpu":
        return tile_configs([(256, 256, 32, 32, 3), (256, 128, 32, 32, 3), (64, 128, 32, 32, 2)],
                            grf_mode=XPU_LARGE_GRF)
    return tile_configs([(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                         (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (256, 128, 64, 8, 3)])


@jit(do_not_specialize=["DX"])  # a key only: one compiled kernel for both
def _grouped_mm_tma_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr,
    M, N, K, G, stride_xm, stride_ym,
    M_BUCKET, DX,  # autotune keys only: the row count's bucket, forward (0) or dx (1)
    SEGMENTS: tl.constexpr,  # a power of two >= G + 1
    TRANS_W: tl.constexpr,  # w is (G, N, K): multiply by w[g]^T
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    if TRANS_W:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G * N, K], strides=[K, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G * K, N], strides=[N, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[stride_ym, 1],
                                       block_shape=[BLOCK_M, BLOCK_N])

    seg, starts, ends, tiles, tiles_end = segment_tiles(offsets_ptr, M, G, SEGMENTS, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    work = tl.sum(tiles, 0) * num_n  # row tiles x column tiles, the tail segment's included
    for item in tl.range(tl.program_id(0), work, tl.num_programs(0)):
        tile = item // num_n
        n0 = item % num_n * BLOCK_N
        g, row_start, row_end = locate_tile(tile, seg, starts, ends, tiles, tiles_end, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.where(g < G, K, 0)  # the tail segment keeps acc = 0
        if TRANS_W:
            k_main = k_end  # a K block past K is clipped by x's and w's descriptors alike
        else:
            k_main = k_end - k_end % BLOCK_K
        for k in range(0, k_main, BLOCK_K):
            a = x_desc.load([row_start, k])
            if TRANS_W:
                b = tl.trans(w_desc.load([g * N + n0, k]))
            else:
                b = w_desc.load([g * K + k, n0])
            acc = tl.dot(a, b, acc, input_precision="ieee")
        if not TRANS_W:
            if k_main < k_end:  # the partial last K block, with the next group's rows zeroed
                a = x_desc.load([row_start, k_main])
                b = w_desc.load([g * K + k_main, n0])
                ks = k_main + tl.arange(0, BLOCK_K)
                b = tl.where((ks < K)[:, None], b, tl.zeros_like(b))
                acc = tl.dot(a, b, acc, input_precision="ieee")

        out = acc.to(y_ptr.dtype.element_ty)
        if row_start + BLOCK_M <= row_end:
            y_desc.store([row_start, n0], out)  # columns past N are dropped by the descriptor
        else:
            rows = row_start + tl.arange(0, BLOCK_M)
            cols = n0 + tl.arange(0, BLOCK_N)
            tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], out,
                     mask=(rows < row_end)[:, None] & (cols < N)[None, :])


_grouped_mm_tma_tuned = autotuned(_tma_configs, key=["N", "K", "M_BUCKET", "DX", "TRANS_W"])(_grouped_mm_tma_kernel)


@functools.cache
def _num_programs(device: torch.device) -> int:
    """One program per SM, or per Xe core of an Intel XPU (gpu_subslice_count in torch's XPU
    device properties: every XPU config is one 32-warp work-group that fills an Xe core's
    threads in the 256-register mode); in the interpreter a few, so that each loops over
    several tiles."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "xpu":
        return torch.xpu.get_device_properties(device).gpu_subslice_count
    return 3


@functools.cache
def _no_squares(device: torch.device) -> Tensor:
    """The dW kernel's squares_ptr argument where it stores no squares (SQUARES off): never
    written by the kernel, only zeroed by the autotuner (reset_to_zero)."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def _scratch(device: torch.device):
    def allocate(size: int, alignment: int, stream):  # the descriptors' device-side scratch
        return torch.empty(size, dtype=torch.int8, device=device)

    return allocate


def launch_grouped_mm_tma(x: Tensor, w: Tensor, offsets: Tensor, y: Tensor, *,
                          trans_w: bool = False, dx: bool = False, config: dict | None = None) -> Tensor:
    """Fill y (M, N) with the grouped product; w is (G, K, N), or (G, N, K) with trans_w. The
    caller checks tma_unsupported first. dx: an autotune key only (the forward and dx tune apart).
    config: fixed meta-parameters instead of autotuning, e.g. {"BLOCK_M": 128, "BLOCK_N": 256,
    "BLOCK_K": 64, "num_warps": 8, "num_stages": 3} (bench/kernels.py --tma-configs)."""
    (M, K), G, N = x.shape, offsets.shape[0], y.shape[1]
    if y.numel() == 0:
        return y
    programs = _num_programs(x.device)

    def grid(meta):
        return (min(programs, (triton.cdiv(M, meta["BLOCK_M"]) + G) * triton.cdiv(N, meta["BLOCK_N"])),)

    # The allocator is a context variable: set it on every launch, since the backward runs
    # on autograd's own thread, which does not see the main thread's setting.
    triton.set_allocator(_scratch(x.device))
    args = (x, w, y, offsets, M, N, K, G, x.stride(0), y.stride(0), bucket(M), int(dx))
    with device_guard(x):
        if config is None:
            _grouped_mm_tma_tuned(x.device.type, x.dtype)[grid](
                *args, SEGMENTS=triton.next_power_of_2(G + 1), TRANS_W=trans_w)
        else:
            _grouped_mm_tma_kernel[grid](*args, SEGMENTS=triton.next_power_of_2(G + 1), TRANS_W=trans_w, **config)
    return y


def _dw_tma_configs(device_type: str, dtype: torch.dtype):
    """(BLOCK_R, BLOCK_K, BLOCK_N, warps, stages, SPLIT_N): a BLOCK_K x BLOCK_N tile of dw[g],
    BLOCK_R rows per reduction step. Shared memory per stage is BLOCK_R * (BLOCK_K + BLOCK_N) * 2
    bytes, plus the store's staging tile, BLOCK_K * BLOCK_N / SPLIT_N * out_dtype's size:
    64 x 128 x 256 with 3 stages and a split float32 store is 144 + 64 = 208 KB of the H200's
    227 KB. A bf16 dw (the experts' gradients on their copies, the step's default) halves the
    staging tile, but deeper pipelines in the room it leaves measured slower on an H100, so both
    output dtypes share this list. Output tiles 128+ wide in K, as the pointer kernel measured
    best. Each item also pays its pipeline's fill and its tile's store with the tensor cores idle
    (Triton 3.6's automatic Hopper warp specialization, asked for on either loop, specializes few
    of these compiles and gains nothing): as long as 300-400 rows of products, fitted from
    measured rates, so about a quarter of an item at 1024 rows per expert; two programs per SM
    with half the shared memory each, to hide one's store under the other's products, measured
    slower. Each config compiles for sm90 within shared memory and without register spills, for
    either output (dw_sm90_report, a CPU test); the GPU test
    test_every_dw_tma_config_compiles_and_matches runs them.
    Intel XPU (PVC): the forward's PVC tiles with K in the role of M, BLOCK_R = 32 rows a step
    (256 x 256 x 32, 256 x 128 x 32, 64 x 128 x 32; 32 warps, 256 registers each), whole stores:
    the split halves an sm90 TMA store's shared-memory staging tile, which a PVC store has not."""
    options = {}
    if INTERPRET:
        shapes = [(16, 16, 16, 1, 1, 2)]
    elif device_type == "xpu":
        shapes = [(32, 256, 256, 32, 3, 1), (32, 256, 128, 32, 3, 1), (32, 64, 128, 32, 2, 1)]
        options = {"grf_mode": XPU_LARGE_GRF}
    else:
        shapes = [(64, 128, 256, 8, 3, 2), (64, 256, 128, 8, 3, 2), (64, 128, 128, 8, 4, 1),
                  (64, 128, 128, 4, 4, 1), (32, 128, 256, 8, 5, 2), (128, 128, 128, 8, 2, 1)]
    return [triton.Config({"BLOCK_R": r, "BLOCK_K": k, "BLOCK_N": n, "SPLIT_N": split, **options},
                          num_warps=w, num_stages=st) for r, k, n, w, st, split in shapes]


@jit
def _dw_item(item, x_ptr, dy_ptr, dw_ptr, N, K, stride_xm, stride_dym, seg, starts, ends, rank,
             BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr,
             SQUARES: tl.constexpr):
    """One work item of the dW kernel: a BLOCK_K x BLOCK_N tile of dw[g], g the group ranked
    item // tiles, reduced over all of g's rows. Returns the sum of the squares of the values
    it stores with SQUARES (TMA zero-fills past every edge, so the tile's padding adds 0), else 0."""
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(K, BLOCK_K) * num_n  # per group
    g, row_start, row_end = group_of_rank(item // tiles, seg, starts, ends, rank)
    k0 = item % tiles // num_n * BLOCK_K
    n0 = item % num_n * BLOCK_N
    rows = row_end - row_start
    # This group's rows only: TMA reads zeros past them. A descriptor needs a row, so an
    # empty group gets one, never read (the loop below does not run).
    x_desc = tl.make_tensor_descriptor(x_ptr + row_start.to(tl.int64) * stride_xm,
                                       shape=[tl.maximum(rows, 1), K], strides=[stride_xm, 1],
                                       block_shape=[BLOCK_R, BLOCK_K])
    dy_desc = tl.make_tensor_descriptor(dy_ptr + row_start.to(tl.int64) * stride_dym,
                                        shape=[tl.maximum(rows, 1), N], strides=[stride_dym, 1],
                                        block_shape=[BLOCK_R, BLOCK_N])
    dw_desc = tl.make_tensor_descriptor(dw_ptr + g.to(tl.int64) * K * N, shape=[K, N], strides=[N, 1],
                                        block_shape=[BLOCK_K, BLOCK_N // SPLIT_N])
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r in range(0, rows, BLOCK_R):
        a = x_desc.load([r, k0])
        b = dy_desc.load([r, n0])
        acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
    out = acc.to(dw_ptr.dtype.element_ty)
    if SPLIT_N == 2:  # columns n0 .. n0 + BLOCK_N/2 and the rest, as Triton's persistent matmul
        left, right = tl.split(tl.permute(tl.reshape(out, (BLOCK_K, 2, BLOCK_N // 2)), (0, 2, 1)))
        dw_desc.store([k0, n0], left)
        dw_desc.store([k0, n0 + BLOCK_N // 2], right)
    else:
        dw_desc.store([k0, n0], out)
    if SQUARES:
        stored = out.to(tl.float32)
        return tl.sum(stored * stored)
    return 0.0


@jit
def _grouped_mm_dw_tma_kernel(
    x_ptr, dy_ptr, dw_ptr, offsets_ptr, squares_ptr,
    M, N, K, G, stride_xm, stride_dym,
    M_BUCKET,  # autotune key only: the row count's bucket
    SEGMENTS: tl.constexpr, CHUNK: tl.constexpr,  # powers of two, SEGMENTS >= G, CHUNK <= SEGMENTS
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_N: tl.constexpr,  # 1, or 2: store the tile as two column halves (half the staging)
    SQUARES: tl.constexpr,  # squares_ptr[program] = sum of the squares this program stored
):
    """dw[g] = x[rows of g]^T @ dy[rows of g], one (group, K tile, N tile) item at a time, the
    items in rank order (largest group first) dealt round-robin: program p takes items p,
    p + programs, p + 2 * programs, ..."""
    seg, starts, ends, rank = groups_by_size(offsets_ptr, M, G, SEGMENTS, CHUNK)
    items = G * tl.cdiv(K, BLOCK_K) * tl.cdiv(N, BLOCK_N)
    squares = 0.0
    for item in tl.range(tl.program_id(0), items, tl.num_programs(0)):
        squares += _dw_item(item, x_ptr, dy_ptr, dw_ptr, N, K, stride_xm, stride_dym, seg, starts, ends,
                            rank, BLOCK_R, BLOCK_K, BLOCK_N, SPLIT_N, SQUARES)
    if SQUARES:
        tl.store(squares_ptr + tl.program_id(0), squares)


# A launch of fewer programs than the one before leaves that one's squares in the tail: the
# squares are zeroed before each timed launch and before the real one.
_grouped_mm_dw_tma_tuned = autotuned(_dw_tma_configs, key=["N", "K", "M_BUCKET"],
                                     reset_to_zero=["squares_ptr"])(_grouped_mm_dw_tma_kernel)


def launch_grouped_mm_dw_tma(x: Tensor, dy: Tensor, offsets: Tensor, dw: Tensor, *,
                             config: dict | None = None, squares: Tensor | None = None) -> Tensor:
    """Fill dw (G, K, N), contiguous, in any float dtype (the float32 accumulator is stored in
    it), with dw[g] = x[rows of g]^T @ dy[rows of g]. The caller checks tma_unsupported(x, dw, dy)
    first. config: fixed meta-parameters instead of autotuning, e.g. {"BLOCK_R": 16, "BLOCK_K":
    16, "BLOCK_N": 32, "SPLIT_N": 1, "num_warps": 1, "num_stages": 1} (tests of each store).
    squares: a float32 buffer of at least _num_programs(x.device) zeros; each program writes
    the sum of the squares of the values it stored to its own entry (the caller adds the
    entries in a fixed order; the deal is fixed too, so the result is the same from run to run)."""
    (M, K), (G, _, N) = x.shape, dw.shape
    if dw.numel() == 0:
        return dw
    if M == 0:  # no rows at all: nothing for a descriptor to address
        return dw.zero_()
    programs = _num_programs(x.device)
    if squares is not None and (squares.dtype != torch.float32 or squares.numel() < programs):
        raise ValueError(f"launch_grouped_mm_dw_tma: squares must be >= {programs} float32 zeros")

    def grid(meta):
        return (min(programs, G * triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"])),)

    segments = triton.next_power_of_2(G)
    args = (x, dy, dw, offsets, _no_squares(x.device) if squares is None else squares,
            M, N, K, G, x.stride(0), dy.stride(0), bucket(M))
    triton.set_allocator(_scratch(x.device))  # per launch: see launch_grouped_mm_tma
    meta = dict(SEGMENTS=segments, CHUNK=min(segments, 32), SQUARES=squares is not None)
    with device_guard(x):
        if config is None:
            _grouped_mm_dw_tma_tuned(x.device.type, x.dtype)[grid](*args, **meta)
        else:
            _grouped_mm_dw_tma_kernel[grid](*args, **meta, **config)
    return dw


def dw_sm90_report() -> dict[str, dict]:
    """Every config of the dW kernel's list compiled for sm90 on this machine for a float32 and a
    bf16 dw, no GPU needed: {"bf16/64x128x256 w8 s3 split2": {"shared": bytes, "ptxas": ptxas's
    register, spill and warning lines}, ...}. Run it in a fresh process (an interpreted kernel
    earlier in the same process changes what Triton compiles)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"x_ptr": "*bf16", "dy_ptr": "*bf16", "offsets_ptr": "*i32", "squares_ptr": "*fp32", "M": "i32",
                 "N": "i32", "K": "i32", "G": "i32", "stride_xm": "i32", "stride_dym": "i32", "M_BUCKET": "i32"}
    report = {}
    for ty in ("fp32", "bf16"):
        for cfg in _dw_tma_configs("cuda", torch.bfloat16):
            meta = {"SEGMENTS": 64, "CHUNK": 32, "SQUARES": True, **cfg.kwargs}
            source = ASTSource(_grouped_mm_dw_tma_kernel, {**signature, "dw_ptr": f"*{ty}",
                                                           **{name: "constexpr" for name in meta}}, meta)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            k = cfg.kwargs
            name = (f"{ty}/{k['BLOCK_R']}x{k['BLOCK_K']}x{k['BLOCK_N']} w{cfg.num_warps} s{cfg.num_stages} "
                    f"split{k['SPLIT_N']}")
            report[name] = {"shared": compiled.metadata.shared, "ptxas": ptxas_report(compiled)}
    return report
