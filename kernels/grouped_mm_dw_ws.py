"""The grouped GEMM's dW as a warp-specialized Hopper kernel on the cooperative schedule, in Gluon.

    launch_grouped_mm_dw_ws(x_MK, dy_MN, offsets_G, dw_GKN, *, squares=None)
    dw_ws_unsupported(x_MK, dy_MN, dw_GKN) -> str | None   # why it cannot run these, or None

The contract of grouped_mm_tma.launch_grouped_mm_dw_tma: dw[g] = x[rows of g]^T @ dy[rows of g]
accumulated in float32 and stored in dw's dtype (float32 for float32 master weights, bf16 for
the experts' bf16 gradients), an empty group's dw zero, and with ``squares`` each program's sum
of the squares of the values it stored in its own entry. Not taken by grouped_mm's dW: a
candidate for the next GPU measurement (bench/kernels.py --dw-configs times it beside the TMA
kernel's configs and torch._grouped_mm; why it was written, and what it is predicted to do:
bench/NOTES.md, twenty-third session). The eighteenth session's warp-specialized dW (ping-pong,
a 128 x 128 tile per consumer) was deleted; this one differs in the tile and in what its
consumers share.

Items are (group, K tile, N tile) of dw, groups largest first (grouped_mm_tiles.groups_by_size,
ranked once per call into a (G, 3) table by a Triton kernel: the loader's single warp has no
registers for the comparison), dealt round-robin to one persistent program per SM:

    loader      1 warp: per item, device-side TMA descriptors of the group's rows of x and dy
                (TMA reads zeros past the group's end: the next group's rows, or NaN past
                offsets[-1], never enter), then the item's row blocks into a STAGES-deep ring:
                x's BLOCK_R x BLOCK_K block and dy's BLOCK_R x BLOCK_N block per stage
    consumer 0  4 warps (the default partition) and
    consumer 1  4 warps: both on every item, consumer c on the N columns c * BLOCK_N / 2 + [0,
                BLOCK_N / 2) of its 128 x 256 tile (a 128 x 128 float32 accumulator, 128
                registers a thread): wgmma of the stage's x block, transposed and shared by
                both, with their half of its dy block. A stage goes back to the loader once
                both have arrived on its empty barrier.

Each item reduces over its group's rows, so its ring positions depend on the row counts of the
program's earlier items; every partition walks the same items and counts them alike. The
descriptors are rewritten in place (one scratch slot per call site, the allocator's), so before
rewriting the loader waits for its last STAGES loads to land. The tile is stored with masked
pointer stores from the registers (at K and N): a float32 staging tile would cost the ring two
of its stages.

Needs what kernels/grouped_mm_ws.py needs (Triton 3.6+ with Gluon's Hopper language, an sm90
GPU, 16-bit inputs); on a CPU the kernel is only compiled (compile_for_sm90, sm90_report).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from . import grouped_mm_tma
from ._triton import device_guard, jit, ptxas_report, tl, triton
from .grouped_mm_tiles import groups_by_size
from .grouped_mm_ws import (CONSUMER_REGISTERS, CONSUMER_WARPS, LOADER_REGISTERS, MAX_REGISTERS, _compile_sm90,
                            _device_unsupported, gluon)

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from .grouped_mm_ws import _add, _ring_products, _tma_load

# (BLOCK_R, BLOCK_K, BLOCK_N, STAGES): rows reduced per stage, the tile of dw[g] (BLOCK_N / 2
# columns a consumer), the ring's depth. Shared memory: STAGES * BLOCK_R * (BLOCK_K + BLOCK_N) * 2
# bytes, 192 KB here: 48 KB a stage for 128 x 256 x 64 products.
# SPLIT_ROWS: each consumer on half the tile's rows (a 64 x 256 share, wgmma m64n256, as the
# forward's cooperative tile) rather than half its columns (128 x 128, two m64n128 per k-step).
CONFIGS = {"cols": {"BLOCK_R": 64, "BLOCK_K": 128, "BLOCK_N": 256, "STAGES": 4, "SPLIT_ROWS": 0},
           "rows": {"BLOCK_R": 64, "BLOCK_K": 128, "BLOCK_N": 256, "STAGES": 4, "SPLIT_ROWS": 1}}
CONFIG = CONFIGS["cols"]


def dw_ws_unsupported(x: Tensor, dy: Tensor, dw: Tensor) -> str | None:
    """Why the warp-specialized dW kernel cannot run on these tensors, or None."""
    return _device_unsupported(x) or _shape_unsupported(x, dy, dw)


def _shape_unsupported(x: Tensor, dy: Tensor, dw: Tensor) -> str | None:
    if x.dtype not in (torch.bfloat16, torch.float16) or dy.dtype != x.dtype:
        return f"the warp-specialized dW kernel is for 16-bit inputs of one dtype, got {x.dtype}, {dy.dtype}"
    if not dw.is_contiguous():
        return "dw must be contiguous"
    return grouped_mm_tma.tma_unaligned(x=x, dy=dy)


@jit
def _rank_table_kernel(offsets_ptr, table_ptr, M, G, SEGMENTS: tl.constexpr, CHUNK: tl.constexpr):
    """table[j] = (g, first row, end row) of the group ranked j by groups_by_size (largest first)."""
    seg, starts, ends, rank = groups_by_size(offsets_ptr, M, G, SEGMENTS, CHUNK)
    mine = seg < G
    tl.store(table_ptr + rank * 3, seg, mask=mine)
    tl.store(table_ptr + rank * 3 + 1, starts, mask=mine)
    tl.store(table_ptr + rank * 3 + 2, ends, mask=mine)


def rank_table(offsets: Tensor, M: int) -> Tensor:
    """(G, 3) int32 on offsets' device: per rank j (largest group first), the group's index, its
    first row and its end row (clipped to M)."""
    G = offsets.shape[0]
    table = torch.empty(G, 3, dtype=torch.int32, device=offsets.device)
    if G:
        segments = triton.next_power_of_2(G)
        with device_guard(offsets):
            _rank_table_kernel[(1,)](offsets, table, M, G, SEGMENTS=segments, CHUNK=min(segments, 32))
    return table


if gluon is not None:

    _WARPS = gl.constexpr(CONSUMER_WARPS)  # a kernel reads module globals only as constexprs
    _CONSUMER_REGISTERS = gl.constexpr(CONSUMER_REGISTERS)
    _LOADER_REGISTERS = gl.constexpr(LOADER_REGISTERS)

    @gluon.jit
    def _item(item, table_ptr, K, N, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr):
        """Item ``item``'s group g, first row, row count, tile (k0, n0) of dw[g] and row blocks."""
        num_n = gl.cdiv(N, BLOCK_N)
        tiles = gl.cdiv(K, BLOCK_K) * num_n  # per group
        entry = table_ptr + item // tiles * 3
        g = gl.load(entry)
        row_start = gl.load(entry + 1)
        rows = gl.load(entry + 2) - row_start
        k0 = item % tiles // num_n * BLOCK_K
        n0 = item % num_n * BLOCK_N
        return g, row_start, rows, k0, n0, gl.cdiv(rows, BLOCK_R)

    @gluon.jit
    def _loader(x_ptr, dy_ptr, x_ring, dy_ring, ready, empty, table_ptr, N, K, G, stride_xm, stride_dym):
        BLOCK_R: gl.constexpr = x_ring.type.shape[1]
        BLOCK_K: gl.constexpr = x_ring.type.shape[2]
        BLOCK_N: gl.constexpr = dy_ring.type.shape[2]
        STAGES: gl.constexpr = x_ring.type.shape[0]
        items = G * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
        pos = 0
        for item in range(gl.program_id(0), items, gl.num_programs(0)):
            g, row_start, rows, k0, n0, blocks = _item(item, table_ptr, K, N, BLOCK_K, BLOCK_N, BLOCK_R)
            if blocks > 0:
                # The descriptors are rewritten in place, so the loads still in flight through
                # the last item's must land first: the last STAGES positions (older ones were
                # consumed before their stage was refilled). No stage was re-armed since, so
                # each ready barrier's parity is that position's.
                for q in range(gl.maximum(pos - STAGES, 0), pos):
                    mbarrier.wait(ready.index(q % STAGES), q // STAGES & 1)
                x_desc = tma.make_tensor_descriptor(x_ptr + row_start.to(gl.int64) * stride_xm, [rows, K],
                                                    [stride_xm, 1], [BLOCK_R, BLOCK_K], x_ring.type.layout)
                dy_desc = tma.make_tensor_descriptor(dy_ptr + row_start.to(gl.int64) * stride_dym, [rows, N],
                                                     [stride_dym, 1], [BLOCK_R, BLOCK_N], dy_ring.type.layout)
                for b in range(blocks):
                    s = pos % STAGES
                    mbarrier.wait(empty.index(s), (pos // STAGES & 1) ^ 1)  # fresh barriers pass phase 1
                    bar = ready.index(s)
                    mbarrier.expect(bar, x_desc.block_type.nbytes + dy_desc.block_type.nbytes)
                    _tma_load(x_desc, [b * BLOCK_R, k0], bar, x_ring.index(s))
                    _tma_load(dy_desc, [b * BLOCK_R, n0], bar, dy_ring.index(s))
                    pos += 1

    @gluon.jit
    def _consumer(x_ring, dy_ring, ready, empty, dw_ptr, squares_ptr, table_ptr, N, K, G, WHICH: gl.constexpr,
                  SPLIT_ROWS: gl.constexpr, SQUARES: gl.constexpr):
        BLOCK_R: gl.constexpr = x_ring.type.shape[1]
        BLOCK_K: gl.constexpr = x_ring.type.shape[2]
        BLOCK_N: gl.constexpr = dy_ring.type.shape[2]
        # this consumer's share of the tile: half its rows (SPLIT_ROWS) or half its columns
        ROWS: gl.constexpr = BLOCK_K // (1 + SPLIT_ROWS)
        COLS: gl.constexpr = BLOCK_N // (2 - SPLIT_ROWS)
        ROW0: gl.constexpr = WHICH * ROWS * SPLIT_ROWS
        COL0: gl.constexpr = WHICH * COLS * (1 - SPLIT_ROWS)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_WARPS, 1],
                                                             instr_shape=[16, COLS, 16])
        items = G * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
        squares = 0.0
        pos = 0
        for item in range(gl.program_id(0), items, gl.num_programs(0)):
            g, row_start, rows, k0, n0, blocks = _item(item, table_ptr, K, N, BLOCK_K, BLOCK_N, BLOCK_R)
            acc = gl.zeros([ROWS, COLS], gl.float32, acc_layout)
            acc = _ring_products(x_ring, dy_ring, ready, empty, acc, pos, blocks, ROW0, COL0, True, False)
            pos += blocks
            out = acc.to(dw_ptr.dtype.element_ty)  # an empty group's tile: zeros
            ks = k0 + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
            ns = n0 + COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, acc_layout))
            ptrs = dw_ptr + g.to(gl.int64) * K * N + gl.expand_dims(ks.to(gl.int64) * N, 1) + gl.expand_dims(ns, 0)
            gl.store(ptrs, out, mask=gl.expand_dims(ks < K, 1) & gl.expand_dims(ns < N, 0))
            if SQUARES:  # past K and N the tile is zeros: TMA zero-filled both operands
                stored = out.to(gl.float32)
                squares += gl.reduce(gl.reduce(stored * stored, 1, _add), 0, _add)
        if SQUARES:  # two adds onto a zero: the same sum in either order
            gl.atomic_add(squares_ptr + gl.program_id(0), squares)

    @gluon.jit
    def _grouped_mm_dw_ws_kernel(x_ptr, dy_ptr, dw_ptr, table_ptr, squares_ptr, N, K, G, stride_xm, stride_dym,
                                 BLOCK_R: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
                                 STAGES: gl.constexpr, SPLIT_ROWS: gl.constexpr, SQUARES: gl.constexpr):
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_K], dtype)
        dy_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], dtype)
        x_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, BLOCK_K], x_layout)
        dy_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, BLOCK_N], dy_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # both consumers read every stage
        gl.warp_specialize([
            (_consumer, (x_ring, dy_ring, ready, empty, dw_ptr, squares_ptr, table_ptr, N, K, G, 0, SPLIT_ROWS, SQUARES)),
            (_consumer, (x_ring, dy_ring, ready, empty, dw_ptr, squares_ptr, table_ptr, N, K, G, 1, SPLIT_ROWS, SQUARES)),
            (_loader, (x_ptr, dy_ptr, x_ring, dy_ring, ready, empty, table_ptr, N, K, G, stride_xm, stride_dym)),
        ], [_WARPS, 1], [_CONSUMER_REGISTERS, _LOADER_REGISTERS])


def launch_grouped_mm_dw_ws(x: Tensor, dy: Tensor, offsets: Tensor, dw: Tensor, *,
                            squares: Tensor | None = None, config: dict | None = None) -> Tensor:
    """Fill dw (G, K, N), contiguous, in any float dtype, with dw[g] = x[rows of g]^T @
    dy[rows of g] (float32 accumulation). The caller checks dw_ws_unsupported first. squares: a
    float32 buffer of at least grouped_mm_tma._num_programs(x.device) zeros; each program adds the
    sum of the squares of the values it stored to its own entry (launch_grouped_mm_dw_tma's
    contract: the caller adds the entries in a fixed order)."""
    (M, K), (G, _, N) = x.shape, dw.shape
    if dw.numel() == 0:
        return dw
    if M == 0:  # no rows at all: nothing for a descriptor to address
        return dw.zero_()
    programs = grouped_mm_tma._num_programs(x.device)
    if squares is not None and (squares.dtype != torch.float32 or squares.numel() < programs):
        raise ValueError(f"launch_grouped_mm_dw_ws: squares must be >= {programs} float32 zeros")
    config = config or CONFIG
    items = G * triton.cdiv(K, config["BLOCK_K"]) * triton.cdiv(N, config["BLOCK_N"])
    table = rank_table(offsets, M)
    triton.set_allocator(grouped_mm_tma._scratch(x.device))  # the loader's per-item descriptors
    with device_guard(x):
        _grouped_mm_dw_ws_kernel[(min(programs, items),)](
            x, dy, dw, table, grouped_mm_tma._no_squares(x.device) if squares is None else squares, N, K, G,
            x.stride(0), dy.stride(0), SQUARES=squares is not None, num_warps=CONSUMER_WARPS,
            maxnreg=MAX_REGISTERS, **config)
    return dw


def compile_for_sm90(dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.float32, *,
                     squares: bool = True, config: dict | None = None):
    """The kernel compiled for an sm90 target on this machine, no GPU needed (grouped_mm_ws's
    compile_for_sm90 for the dW kernel)."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    ty, out = names[dtype], names[out_dtype]
    signature = {"x_ptr": f"*{ty}", "dy_ptr": f"*{ty}", "dw_ptr": f"*{out}", "table_ptr": "*i32",
                 "squares_ptr": "*fp32", "N": "i32", "K": "i32", "G": "i32", "stride_xm": "i32", "stride_dym": "i32"}
    return _compile_sm90(_grouped_mm_dw_ws_kernel, signature, {**(config or CONFIG), "SQUARES": squares})


def sm90_report() -> dict[str, dict]:
    """Each config compiled for sm90 for a float32 and a bf16 dw: {"cols float32": {"shared": bytes,
    "warp_specialized", "wgmma", "ptxas": ptxas's register, spill and warning lines}, ...}. In a
    fresh process, as grouped_mm_ws.sm90_report."""
    report = {}
    for (name, config), out in itertools.product(CONFIGS.items(), (torch.float32, torch.bfloat16)):
        compiled = compile_for_sm90(out_dtype=out, config=config)
        report[f"{name} {str(out).removeprefix('torch.')}"] = {
            "shared": compiled.metadata.shared, "warp_specialized": "ttg.warp_specialize" in compiled.asm["ttgir"],
            "wgmma": "wgmma.mma_async" in compiled.asm["ptx"], "ptxas": ptxas_report(compiled)}
    return report
