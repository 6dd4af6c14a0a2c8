"""The grouped GEMM's forward and dx as a warp-specialized Hopper kernel, written in Gluon.

    launch_grouped_mm_ws(x_MK, w, offsets_G, y_MN, *, trans_w=False, config=None,
                         swiglu_out=None, row_weight=None)
    launch_grouped_mm_ws_swiglu_backward(dy_MN, w_GHN, offsets_G, h_M2H, dh_M2H, row_weight=None)
    ws_unsupported(x_MK, w, y_MN, trans_w=False) -> str | None   # why it cannot run these, or None
    swiglu_unsupported(...), swiglu_backward_unsupported(...)   # the same for the SwiGLU epilogues

grouped_mm's forward and dx take it wherever ws_unsupported returns None (kernels/optimus_kernels/grouped_mm.py);
the experts' MLP (kernels/optimus_kernels/expert_mlp.py) takes its SwiGLU epilogues: the up projection's forward
also writing silu(gate) * up * row_weight, and the down projection's dx writing the SwiGLU's
backward (dh, the row weights' gradient) instead of its own output.

The same contract as grouped_mm_tma.launch_grouped_mm_tma (y[rows of g] = x[rows of g] @ w[g],
or @ w[g]^T with trans_w; rows past offsets[-1] come out zero; empty groups; no host sync), and
the same work items (grouped_mm_tiles' numbering, rebuilt here in Gluon, whose tensors need
explicit layouts). What differs is who does what on an SM. The Triton kernel's warps do
everything in turn, so each output tile's epilogue (convert, store) and the next tile's
pipeline fill run with the tensor cores idle: a fixed cost per tile, measured to be what keeps
those kernels level with CUTLASS's instead of ahead. Here one persistent program per SM holds
three partitions:

    loader      1 warp: TMA loads of x's and w's K blocks into a STAGES-deep ring, running
                ahead across work items (the next tile's first blocks arrive during this
                tile's last products and epilogue)
    consumer 0  4 warps (the default partition) and
    consumer 1  4 warps: wgmma from the ring into a float32 accumulator in registers, then
                their own epilogues, on one of CUTLASS's two schedules (the config's COOP):
      ping-pong    each takes every other work item of the program, whole. The ring is filled
                   in item order, so while one consumer runs its epilogue the other runs its
                   products. The mainloops take turns (an order barrier, CUTLASS's ordered
                   barrier): a consumer may wait on a ring position only once every earlier
                   position has been waited on, since an mbarrier's parity cannot tell position
                   p from p - 2 * STAGES, and a consumer that ran ahead would read a stage the
                   loader has not filled.
      cooperative  both take every item, half its rows each, reading the same w tile of each
                   stage (which goes back to the loader once both have arrived on its empty
                   barrier); only the loads run ahead of the epilogues.

The program's item j reads ring positions j*KT .. (j+1)*KT - 1 (KT K blocks per item); items of
the tail segment (rows past offsets[-1]) are numbered last, need no loads, and are stored as
zeros.

Clipping is TMA's, as in grouped_mm_tma: x's rows past a group's end feed only output rows
that are never stored; a partial last row tile is stored with masked pointer stores (a TMA
store would write the next group's rows); transposed, w's rows past the group land in output
columns >= N, which the store drops. The forward's K must be a multiple of BLOCK_K (a partial K
block would read the next group's rows of w into the product; the Triton kernel zeroes them in
registers, which wgmma from shared memory cannot): ws_unsupported says so.

No dW kernel here: dW runs on grouped_mm_tma's; warp-specialized ones of this design (ping-pong or
cooperative) measured no faster for a bf16 dw.

Needs Triton with Gluon's Hopper language (3.5+), an NVIDIA sm90 GPU and 16-bit inputs; no
interpreter (Gluon has none), so on a CPU the kernel is only compiled (compile_for_sm90).

One module past 600 lines: the Gluon program (loader, two consumers, three epilogues), its
launcher and its compile check share one tile layout and its constants; apart, no piece reads
without the others.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from . import grouped_mm_tma
from .._triton import device_guard, ptxas_report, triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # Triton 3.7 renamed the TMA copies (3.6 is on the GPU machine, 3.9 in the CPU tests)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
except (ImportError, AttributeError):  # no Triton, or one without Gluon's Hopper language
    gluon = None

# Gluon's API moves between Triton releases (warp_specialize's arguments, the TMA copies' names):
# these kernels are written to 3.6's, run on a GPU under 3.6 and compiled on the CPU under 3.9.
MIN_TRITON = (3, 6)

CONSUMER_WARPS = 4  # one warpgroup: 128 threads, a 128 x 128 (or 64 x 256) float32 accumulator in 128 registers each
LOADER_REGISTERS = 40  # scalar TMA issue plus the SEGMENTS-lane work numbering, over 32 lanes
CONSUMER_REGISTERS = 232  # what is left of the SM's 64K for the two consumer warpgroups
MAX_REGISTERS = 168  # per thread at launch, over 3 warpgroups; setmaxnreg then moves them as above


def ws_unsupported(x: Tensor, w: Tensor, y: Tensor, trans_w: bool = False) -> str | None:
    """Why the warp-specialized kernel cannot run on these tensors (w as the kernel reads it:
    (G, K, N), or (G, N, K) with trans_w), or None."""
    return ws_device_unsupported(x.device) or _shape_unsupported(x, w, y, trans_w)


def ws_device_unsupported(device: torch.device) -> str | None:
    """Why the warp-specialized kernel cannot run on ``device`` (its Triton, its GPU), or None."""
    version = getattr(triton, "__version__", None)
    if gluon is None:
        return f"Triton {version} has no Gluon Hopper language"
    if tuple(int(part) for part in re.findall(r"\d+", version)[:2]) < MIN_TRITON:
        return f"Triton {version}: the warp-specialized kernel is written to Gluon's API of Triton 3.6+"
    if device.type != "cuda" or torch.version.cuda is None:
        return f"the warp-specialized kernel needs an NVIDIA GPU, got {device.type}"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "the warp-specialized kernel is for Hopper (compute capability 9.x: wgmma)"
    return None


def _shape_unsupported(x: Tensor, w: Tensor, y: Tensor, trans_w: bool) -> str | None:
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype or y.dtype != x.dtype:
        return f"the warp-specialized kernel is for one 16-bit dtype, got {x.dtype}, {w.dtype}, {y.dtype}"
    if not trans_w and x.shape[1] % 64:  # every config's BLOCK_K
        return f"K = {x.shape[1]} is not a multiple of 64: a partial K block would read the next group's weights"
    return grouped_mm_tma.tma_layout_unsupported(x, w, y)


# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, COOP): the tile, the ring's depth and the schedule.
# COOP = 0, ping-pong (above). COOP = 1, CUTLASS's cooperative schedule: both consumers on every
# tile, half its rows each, so a 128 x 256 tile fits (a whole one in one consumer would be 256
# accumulator registers a thread) and both read each stage's w tile: 48 KB of ring per
# 128 x 256 x 64 products where ping-pong's two 128 x 128 items load 64 KB, and one item in flight
# per SM instead of two, at the price of epilogues that overlap only the loads. Shared memory:
# STAGES * (BM + BN) * BK * 2 bytes of ring and two store staging tiles (BM x BN each ping-pong,
# half that cooperative), at most 227 KB. BLOCK_K is 64 (ws_unsupported's K rule).
# Measured: on an H100 the cooperative tile is the fastest at every shape (it moves fewer L2
# bytes), and the step faster with it; on an H200 it trails ping-pong slightly on the kernels
# alone and is level in the step.
CONFIGS = [(128, 256, 64, 3, 1), (128, 128, 64, 4, 0)]
SHARED_MEMORY_LIMIT = 232448  # bytes of shared memory one H100 / H200 block may use (227 KB)


def config_dict(block_m: int, block_n: int, block_k: int, stages: int, coop: int = 0) -> dict:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "STAGES": stages, "COOP": coop}


def config_name(config: tuple) -> str:
    """"128x128x64x4" for a CONFIGS entry, "128x256x64x3-coop" for a cooperative one."""
    return "x".join(map(str, config[:4])) + ("-coop" if config[4:] == (1,) else "")


def default_config(n: int) -> dict:
    """The config for a product of ``n`` output columns when the caller names none: the
    cooperative 128 x 256 tile (CONFIGS[0]: the H100's fastest, level in an H200's step; see
    the comment above CONFIGS), except where n is a multiple of 128 and not of 256
    (mula-220b-a10b's expert hidden size, 1152), where its last column tile would compute 128
    columns of nothing in every row tile and the SwiGLU backward's fused epilogue, which needs
    whole tiles, could not run: there the 128-column ping-pong tile."""
    return config_dict(*CONFIGS[1 if n % 256 == 128 else 0])


if gluon is not None:

    _WARPS = gl.constexpr(CONSUMER_WARPS)  # a kernel reads module globals only as constexprs
    # the consumers' epilogue: store y; or the forward's SwiGLU; or the SwiGLU's backward (dx)
    _STORE, _SWIGLU, _SWIGLU_BACKWARD = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
    _CONSUMER_REGISTERS = gl.constexpr(CONSUMER_REGISTERS)
    _LOADER_REGISTERS = gl.constexpr(LOADER_REGISTERS)

    @gluon.constexpr_function
    def _ring_block_n(w_ring_shape, trans_w):
        """BLOCK_N from w's ring: (STAGES, BLOCK_K, BLOCK_N), or (STAGES, BLOCK_N, BLOCK_K) transposed."""
        return w_ring_shape[1] if trans_w else w_ring_shape[2]

    # gl.sum is Triton's sum, whose combine function is a triton.jit function: under
    # TRITON_INTERPRET=1 (the CPU tests) that is an interpreted one, which Gluon cannot compile.
    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _segment_tiles(offsets_ptr, M, G, SEGMENTS: gl.constexpr, BLOCK_M: gl.constexpr, layout: gl.constexpr):
        """grouped_mm_tiles.segment_tiles with its lanes in ``layout``."""
        seg = gl.arange(0, SEGMENTS, layout=layout)
        ends = gl.minimum(gl.load(offsets_ptr + seg, mask=seg < G, other=M), M)
        starts = gl.load(offsets_ptr + seg - 1, mask=(seg > 0) & (seg <= G), other=0)
        starts = gl.where(seg > G, M, gl.minimum(starts, M))
        tiles = gl.cdiv(gl.maximum(ends - starts, 0), BLOCK_M)
        return seg, starts, ends, tiles, gl.associative_scan(tiles, 0, _add)

    @gluon.jit
    def _locate_tile(tile, seg, starts, ends, tiles, tiles_end, BLOCK_M: gl.constexpr):
        """grouped_mm_tiles.locate_tile: the tile's segment g (G: the tail) and rows."""
        g = gl.reduce((tiles_end <= tile).to(gl.int32), 0, _add)
        row_end = gl.reduce(gl.where(seg == g, ends, 0), 0, _add)
        row_start = gl.reduce(gl.where(seg == g, starts + (tile - tiles_end + tiles) * BLOCK_M, 0), 0, _add)
        return g, row_start, row_end

    @gluon.jit
    def _ring_products(x_ring, w_ring, ready, empty, acc, pos, blocks, ROW0: gl.constexpr, TRANS_W: gl.constexpr):
        """acc = the sum of x @ w over ``blocks`` ring stages from position ``pos`` (of the
        stage's x tile the rows ROW0 + [0, acc's rows): one consumer's half of a cooperative
        tile; w transposed where asked), by wgmma with one product in flight; each stage gets
        this consumer's arrival on its empty barrier once the product reading it is done.
        blocks = 0: acc unchanged."""
        STAGES: gl.constexpr = x_ring.type.shape[0]
        ROWS: gl.constexpr = acc.type.shape[0]
        for b in range(blocks):
            s = pos % STAGES
            mbarrier.wait(ready.index(s), pos // STAGES & 1)
            a = x_ring.index(s)
            if ROWS < x_ring.type.shape[1]:
                a = a.slice(ROW0, ROWS)
            w = w_ring.index(s)
            if TRANS_W:
                w = w.permute((1, 0))
            acc = warpgroup_mma(a, w, acc, use_acc=b > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # the product before has read its stage
            mbarrier.arrive(empty.index((pos + STAGES - 1) % STAGES), count=1, pred=b > 0)
            pos += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((pos + STAGES - 1) % STAGES), count=1, pred=blocks > 0)
        return acc

    @gluon.jit
    def _wait_turn(order, j, WHICH: gl.constexpr):
        """Ping-pong: block consumer WHICH until the other has finished the mainloop of the
        program's item j - 1 (its items are j = WHICH, WHICH + 2, ...). order[c] counts the
        mainloops the other consumer finished before c's; the first wait of consumer 0 passes on
        a fresh barrier (parity 1, as the loader's first waits on the empty barriers)."""
        mbarrier.wait(order.index(WHICH), (j // 2 & 1) ^ (1 - WHICH))

    @gluon.jit
    def _pass_turn(order, WHICH: gl.constexpr):
        """Ping-pong: this consumer's mainloop is done (every ring position of its item waited
        on and released); the other's may start. The epilogue runs after, beside it."""
        mbarrier.arrive(order.index(1 - WHICH), count=1)

    @gluon.jit
    def _order_barriers():
        """The two order barriers of the ping-pong schedule, one per consumer."""
        order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(order.index(c), count=1)
        return order

    @gluon.jit
    def _loader(x_desc, w_desc, x_ring, w_ring, ready, empty, offsets_ptr, M, N, K, G,
                SEGMENTS: gl.constexpr, TRANS_W: gl.constexpr, EPILOGUE: gl.constexpr, layout: gl.constexpr):
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = _ring_block_n(w_ring.type.shape, TRANS_W)
        HALF: gl.constexpr = BLOCK_N // 2
        STAGES: gl.constexpr = x_ring.type.shape[0]
        # the forward's SwiGLU: w's block is one half of a ring tile, the gate's columns and then the up's
        SWIGLU: gl.constexpr = EPILOGUE == _SWIGLU
        W_LOADS: gl.constexpr = 2 if SWIGLU else 1
        seg, starts, ends, tiles, tiles_end = _segment_tiles(offsets_ptr, M, G, SEGMENTS, BLOCK_M, layout)
        num_n = gl.cdiv(N, BLOCK_N)
        work = gl.reduce(tiles, 0, _add) * num_n
        k_blocks = gl.cdiv(K, BLOCK_K)
        pos = 0
        for item in range(gl.program_id(0), work, gl.num_programs(0)):
            tile = item // num_n
            n0 = item % num_n * BLOCK_N
            g, row_start, row_end = _locate_tile(tile, seg, starts, ends, tiles, tiles_end, BLOCK_M)
            if g < G:  # tail tiles (numbered last) load nothing
                for kb in range(k_blocks):
                    s = pos % STAGES
                    mbarrier.wait(empty.index(s), (pos // STAGES & 1) ^ 1)  # fresh barriers pass phase 1
                    bar = ready.index(s)
                    mbarrier.expect(bar, x_desc.block_type.nbytes + W_LOADS * w_desc.block_type.nbytes)
                    _tma_load(x_desc, [row_start, kb * BLOCK_K], bar, x_ring.index(s))
                    if TRANS_W:
                        _tma_load(w_desc, [g * N + n0, kb * BLOCK_K], bar, w_ring.index(s))
                    elif SWIGLU:  # gate columns n0 / 2 + [0, HALF), and the same up columns F further
                        w_tile = w_ring.index(s)
                        _tma_load(w_desc, [g * K + kb * BLOCK_K, n0 // 2], bar, w_tile.slice(0, HALF, dim=1))
                        _tma_load(w_desc, [g * K + kb * BLOCK_K, N // 2 + n0 // 2], bar,
                                  w_tile.slice(HALF, HALF, dim=1))
                    else:
                        _tma_load(w_desc, [g * K + kb * BLOCK_K, n0], bar, w_ring.index(s))
                    pos += 1

    @gluon.jit
    def _consumer(x_desc, w_desc, y_desc, out_desc, x_ring, w_ring, ready, empty, order, y_stage, y_ptr, stride_ym,
                  out_ptr, stride_om, rw_ptr, partial_ptr, offsets_ptr, M, N, K, G, WHICH: gl.constexpr,
                  SEGMENTS: gl.constexpr, TRANS_W: gl.constexpr, EPILOGUE: gl.constexpr, HAS_WEIGHT: gl.constexpr,
                  COOP: gl.constexpr, layout: gl.constexpr):
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]  # the tile's rows
        ROWS: gl.constexpr = y_stage.type.shape[0]  # this consumer's rows of it
        BLOCK_N: gl.constexpr = y_stage.type.shape[1]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        FIRST: gl.constexpr = _schedule(COOP, WHICH, ROWS)[0]
        STEP: gl.constexpr = _schedule(COOP, WHICH, ROWS)[1]
        ROW0: gl.constexpr = _schedule(COOP, WHICH, ROWS)[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        seg, starts, ends, tiles, tiles_end = _segment_tiles(offsets_ptr, M, G, SEGMENTS, BLOCK_M, layout)
        num_n = gl.cdiv(N, BLOCK_N)
        work = gl.reduce(tiles, 0, _add) * num_n
        k_blocks = gl.cdiv(K, BLOCK_K)
        j = FIRST  # the item's rank among this program's items
        for item in range(gl.program_id(0) + FIRST * gl.num_programs(0), work, STEP * gl.num_programs(0)):
            tile = item // num_n
            n0 = item % num_n * BLOCK_N
            g, row_start, row_end = _locate_tile(tile, seg, starts, ends, tiles, tiles_end, BLOCK_M)
            acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
            if not COOP:
                _wait_turn(order, j, WHICH)
            if g < G:
                acc = _ring_products(x_ring, w_ring, ready, empty, acc, j * k_blocks, k_blocks, ROW0, TRANS_W)
            if not COOP:
                _pass_turn(order, WHICH)
            row_start += ROW0  # past row_end (the second half of a group's last tile): nothing stored
            # Every epilogue reads the accumulator through y_stage, so it has one reader: a second
            # (masked pointer stores straight from it) makes ptxas serialize the wgmmas (C7514).
            tma.store_wait(pendings=0)  # this consumer's last store has left y_stage
            y_stage.store(acc.to(y_desc.dtype))
            if EPILOGUE == _SWIGLU:
                _swiglu_epilogue(y_desc, out_desc, y_stage, y_ptr, stride_ym, out_ptr, stride_om, rw_ptr,
                                 row_start, row_end, n0 // 2, N // 2, HAS_WEIGHT)
            elif EPILOGUE == _SWIGLU_BACKWARD:
                _swiglu_backward_epilogue(y_stage, out_ptr, stride_om, y_ptr, stride_ym, rw_ptr, partial_ptr,
                                          num_n, row_start, row_end, n0, N, HAS_WEIGHT)
            else:
                _store_tile(y_desc, y_stage, y_ptr, stride_ym, row_start, row_end, n0, N)
            j += STEP
        tma.store_wait(pendings=0)

    @gluon.constexpr_function
    def _schedule(coop, which, rows):
        """(first item, in programs; item step, in programs; first row of the tile) of consumer
        ``which``: ping-pong, every other item from its own, whole; cooperative, every item, its
        half of the rows."""
        return (0, 1, which * rows) if coop else (which, 2, 0)

    @gluon.jit
    def _store_tile(y_desc, y_stage, y_ptr, stride_ym, row_start, row_end, n0, N):
        """y's rows [row_start, row_end) x columns n0 + [0, BLOCK_N) from y_stage: by TMA, or
        the group's last, partial row tile by masked pointer stores (its rows past row_end are
        the next group's, which a TMA store would write)."""
        BLOCK_M: gl.constexpr = y_stage.type.shape[0]
        BLOCK_N: gl.constexpr = y_stage.type.shape[1]
        # 16-byte vectors along a row
        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_WARPS, 1], [1, 0])
        if row_start + BLOCK_M <= row_end:
            fence_async_shared()
            _tma_store(y_desc, [row_start, n0], y_stage)  # columns past N dropped
        else:
            rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
            ptrs = y_ptr + gl.expand_dims(rows.to(gl.int64) * stride_ym, 1) + gl.expand_dims(cols, 0)
            mask = gl.expand_dims(rows < row_end, 1) & gl.expand_dims(cols < N, 0)
            gl.store(ptrs, y_stage.load(store_layout), mask=mask)

    @gluon.jit
    def _swiglu_epilogue(h_desc, out_desc, h_stage, h_ptr, stride_hm, out_ptr, stride_om, rw_ptr, row_start,
                         row_end, c0, F, HAS_WEIGHT: gl.constexpr):
        """h_stage holds h's rows [row_start, row_end) at gate columns c0 + [0, HALF) in its first
        half and the same up columns (c0 + F + ...) in its second. Stores both to h, then
        out = silu(gate) * up (times the row's weight) to out's columns c0 + [0, HALF): the swiglu
        kernel's formula on the same 16-bit values, so the same bits as the unfused pair."""
        BLOCK_M: gl.constexpr = h_stage.type.shape[0]
        HALF: gl.constexpr = h_stage.type.shape[1] // 2
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_WARPS, 1], [1, 0])
        gate_stage = h_stage.slice(0, HALF, dim=1)
        up_stage = h_stage.slice(HALF, HALF, dim=1)
        full = row_start + BLOCK_M <= row_end
        if full:
            fence_async_shared()
            _tma_store(h_desc, [row_start, c0], gate_stage)
            _tma_store(h_desc, [row_start, F + c0], up_stage)
        gate16 = gate_stage.load(layout)
        up16 = up_stage.load(layout)
        rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = c0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
        row_ok = rows < row_end
        mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < F, 0)
        if not full:
            h_ptrs = h_ptr + gl.expand_dims(rows.to(gl.int64) * stride_hm, 1) + gl.expand_dims(cols, 0)
            gl.store(h_ptrs, gate16, mask=mask)
            gl.store(h_ptrs + F, up16, mask=mask)
        gate = gate16.to(gl.float32)
        out = gate * (1 / (1 + gl.exp(-gate))) * up16.to(gl.float32)  # tl.sigmoid's formula
        if HAS_WEIGHT:
            out = out * gl.expand_dims(gl.load(rw_ptr + rows, mask=row_ok, other=0.0).to(gl.float32), 1)
        out16 = out.to(out_desc.dtype)
        if full:
            tma.store_wait(pendings=0)  # the h stores have read the stage
            gate_stage.store(out16)
            fence_async_shared()
            _tma_store(out_desc, [row_start, c0], gate_stage)
        else:
            out_ptrs = out_ptr + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
            gl.store(out_ptrs, out16, mask=mask)

    @gluon.jit
    def _swiglu_backward_epilogue(da_stage, h_ptr, stride_hm, dh_ptr, stride_dhm, rw_ptr, partial_ptr, num_n,
                                  row_start, row_end, c0, F, HAS_WEIGHT: gl.constexpr):
        """da_stage holds the gradient of the SwiGLU's output (dx of the down projection, rounded
        to 16 bits as the dx kernel stores it) at rows [row_start, row_end), columns
        c0 + [0, BLOCK_N). Writes dh's gate and up columns from h's, and, with row weights, this
        tile's share of each row's weight gradient to partial[row, c0 / BLOCK_N] (summed after
        the kernel, in a fixed order). The swiglu backward kernel's formulas on the same values."""
        BLOCK_M: gl.constexpr = da_stage.type.shape[0]
        BLOCK_N: gl.constexpr = da_stage.type.shape[1]
        # 16 columns at a time, two threads a row: each access one 32-byte sector. 32 at a time
        # spill (ptxas), and so does a column mask: hence whole column tiles only.
        CHUNK: gl.constexpr = 16
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [_WARPS, 1], [1, 0])
        rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        row_ok = rows < row_end
        h_rows = gl.expand_dims(rows.to(gl.int64) * stride_hm, 1)
        dh_rows = gl.expand_dims(rows.to(gl.int64) * stride_dhm, 1)
        if HAS_WEIGHT:
            weight = gl.expand_dims(gl.load(rw_ptr + rows, mask=row_ok, other=0.0).to(gl.float32), 1)
        dot = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, layout))
        for c in gl.static_range(0, BLOCK_N, CHUNK):
            cols = gl.expand_dims(c0 + c + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout)), 0)
            mask = gl.expand_dims(row_ok, 1)  # every column is < F: whole tiles (swiglu_backward_unsupported)
            gate = gl.load(h_ptr + h_rows + cols, mask=mask, other=0.0).to(gl.float32)
            up = gl.load(h_ptr + h_rows + cols + F, mask=mask, other=0.0).to(gl.float32)
            dout = da_stage.slice(c, CHUNK, dim=1).load(layout).to(gl.float32)
            s = 1 / (1 + gl.exp(-gate))  # tl.sigmoid's formula
            silu = gate * s
            if HAS_WEIGHT:
                dot += gl.reduce(dout * silu * up, 1, _add)
                dout = dout * weight
            gl.store(dh_ptr + dh_rows + cols, (dout * up * (s + silu * (1.0 - s))).to(dh_ptr.dtype.element_ty),
                     mask=mask)
            gl.store(dh_ptr + dh_rows + cols + F, (dout * silu).to(dh_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            gl.store(partial_ptr + rows.to(gl.int64) * num_n + c0 // BLOCK_N, dot, mask=row_ok)

    @gluon.jit
    def _grouped_mm_ws_kernel(x_desc, w_desc, y_desc, out_desc, y_ptr, out_ptr, rw_ptr, partial_ptr, offsets_ptr,
                              M, N, K, G, stride_ym, stride_om, SEGMENTS: gl.constexpr, TRANS_W: gl.constexpr,
                              EPILOGUE: gl.constexpr, HAS_WEIGHT: gl.constexpr, STAGES: gl.constexpr,
                              BLOCK_N: gl.constexpr, COOP: gl.constexpr, W_TILE_LAYOUT: gl.constexpr,
                              Y_TILE_LAYOUT: gl.constexpr):
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        ROWS: gl.constexpr = BLOCK_M // (1 + COOP)  # one consumer's rows of a tile
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        W_TILE: gl.constexpr = [BLOCK_N, BLOCK_K] if TRANS_W else [BLOCK_K, BLOCK_N]
        x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + W_TILE, W_TILE_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1 + COOP)  # cooperative: both consumers read each stage
        order = _order_barriers()  # unused by the cooperative schedule
        stage0 = gl.allocate_shared_memory(y_desc.dtype, [ROWS, BLOCK_N], Y_TILE_LAYOUT)
        stage1 = gl.allocate_shared_memory(y_desc.dtype, [ROWS, BLOCK_N], Y_TILE_LAYOUT)
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [_WARPS], [0])
        loader_lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        gl.warp_specialize([
            (_consumer, (x_desc, w_desc, y_desc, out_desc, x_ring, w_ring, ready, empty, order, stage0, y_ptr,
                         stride_ym, out_ptr, stride_om, rw_ptr, partial_ptr, offsets_ptr, M, N, K, G, 0, SEGMENTS,
                         TRANS_W, EPILOGUE, HAS_WEIGHT, COOP, lanes)),
            (_consumer, (x_desc, w_desc, y_desc, out_desc, x_ring, w_ring, ready, empty, order, stage1, y_ptr,
                         stride_ym, out_ptr, stride_om, rw_ptr, partial_ptr, offsets_ptr, M, N, K, G, 1, SEGMENTS,
                         TRANS_W, EPILOGUE, HAS_WEIGHT, COOP, lanes)),
            (_loader, (x_desc, w_desc, x_ring, w_ring, ready, empty, offsets_ptr, M, N, K, G,
                       SEGMENTS, TRANS_W, EPILOGUE, loader_lanes)),
        ], [_WARPS, 1], [_CONSUMER_REGISTERS, _LOADER_REGISTERS])


def _layouts(dtype, cfg: dict, trans_w: bool, swiglu: bool = False):
    """((block, NVMMA shared layout) of x's, w's and y's descriptors, the layout of a w ring
    tile, the layout of a y staging tile): the swizzle TMA and wgmma share. y's block and the
    staging tile are one consumer's rows: half the tile's under the cooperative schedule. With
    ``swiglu`` w's and y's blocks are half a tile wide (the gate's columns and the up's, loaded
    and stored apart)."""
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    rows = bm // 2 if cfg["COOP"] else bm
    w_tile = [bn, bk] if trans_w else [bk, bn]
    blocks = ([bm, bk], [bk, bn // 2] if swiglu else w_tile, [rows, bn // 2] if swiglu else [rows, bn])

    def layout(block):
        return gl.NVMMASharedLayout.get_default_for(block, gdt)
    return [(block, layout(block)) for block in blocks], layout(w_tile), layout([rows, bn])


def swiglu_unsupported(x: Tensor, w: Tensor, h: Tensor, out: Tensor, row_weight: Tensor | None,
                       config: dict | None = None) -> str | None:
    """Why the forward cannot also write out = silu(gate) * up (times row_weight) beside
    h = x @ w[g] (launch_grouped_mm_ws's ``swiglu_out``, with ``config``: None, the default), or None."""
    if reason := ws_unsupported(x, w, h):
        return reason
    F = h.shape[1] // 2
    half = (config or default_config(h.shape[1]))["BLOCK_N"] // 2
    if h.shape[1] % 2 or F % half:
        return f"the fused SwiGLU needs a gate and an up of whole {half}-column blocks, got h of {h.shape[1]} columns"
    if out.shape != (h.shape[0], F) or out.dtype != h.dtype:
        return f"the SwiGLU output must be ({h.shape[0]}, {F}) in {h.dtype}, got {tuple(out.shape)} {out.dtype}"
    if row_weight is not None and (row_weight.shape != (h.shape[0],) or row_weight.stride(0) != 1):
        return f"row_weight must be a contiguous ({h.shape[0]},) vector, got {tuple(row_weight.shape)}"
    return grouped_mm_tma.tma_unaligned(out=out)


def swiglu_backward_unsupported(dy: Tensor, w: Tensor, h: Tensor, dh: Tensor, row_weight: Tensor | None,
                                config: dict | None = None) -> str | None:
    """Why dx = dy @ w[g]^T (w (G, H, N): the down projection's weights) cannot run with the
    SwiGLU's backward in its epilogue (launch_grouped_mm_ws_swiglu_backward, with ``config``:
    None, the default), or None."""
    H = w.shape[1]
    block_n = (config or default_config(H))["BLOCK_N"]
    if h.shape != (dy.shape[0], 2 * H) or dh.shape != h.shape or h.dtype != dy.dtype or dh.dtype != dy.dtype:
        return (f"h and dh must be ({dy.shape[0]}, {2 * H}) in {dy.dtype}, got {tuple(h.shape)} {h.dtype} "
                f"and {tuple(dh.shape)} {dh.dtype}")
    if h.stride(1) != 1 or dh.stride(1) != 1:
        return "h and dh need contiguous rows"
    if H % block_n:
        return f"the SwiGLU's backward in dx needs whole {block_n}-column tiles of H, got H = {H}"
    if row_weight is not None and (row_weight.shape != (dy.shape[0],) or row_weight.stride(0) != 1):
        return f"row_weight must be a contiguous ({dy.shape[0]},) vector, got {tuple(row_weight.shape)}"
    return ws_unsupported(dy, w, h[:, :H], trans_w=True)  # the product's output: (M, H) like h's gate


def launch_grouped_mm_ws(x: Tensor, w: Tensor, offsets: Tensor, y: Tensor, *, trans_w: bool = False,
                         config: dict | None = None, swiglu_out: Tensor | None = None,
                         row_weight: Tensor | None = None) -> Tensor:
    """Fill y (M, N) with the grouped product; w is (G, K, N), or (G, N, K) with trans_w. The
    caller checks ws_unsupported first. config: {"BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "COOP"}
    (config_dict); None: default_config(N).

    swiglu_out (M, N / 2), forward only (the caller checks swiglu_unsupported): y is the up
    projection's h = [gate | up], and the epilogue also writes swiglu_out = silu(gate) * up,
    times row_weight (M,) per row when given: the swiglu kernel's pass, fused (same bits)."""
    swiglu = swiglu_out is not None
    if swiglu and trans_w:
        raise ValueError("launch_grouped_mm_ws: the fused SwiGLU is the forward's (trans_w=False)")
    if y.numel() and offsets.shape[0] == 0 and swiglu:
        swiglu_out.zero_()
    _launch(x, w, offsets, y, y.shape[1], trans_w, _SWIGLU if swiglu else _STORE, config,
            out=swiglu_out, row_weight=row_weight)
    return y


def launch_grouped_mm_ws_swiglu_backward(dy: Tensor, w: Tensor, offsets: Tensor, h: Tensor, dh: Tensor,
                                         row_weight: Tensor | None = None, *,
                                         config: dict | None = None) -> Tensor | None:
    """The SwiGLU's backward in the down projection's dx epilogue: with da = dy @ w[g]^T per
    group (w (G, H, N), as the forward took it; da rounded to dy's dtype, as the dx kernel
    stores it, but never stored) and out = silu(gate) * up * row_weight the forward's, fill
    dh (M, 2H) = d out / d h (the swiglu backward kernel's formulas on the same values) and
    return d out / d row_weight (float32, (M,); summed from one float32 partial per row and
    BLOCK_N-column tile, in a fixed order), or None without row weights. The caller checks
    swiglu_backward_unsupported first. Rows past offsets[-1] get zero dh (and weight gradient)."""
    M, H = dy.shape[0], w.shape[1]
    if offsets.shape[0] == 0 or M == 0:  # no group: da is zero, and so is everything made of it
        dh.zero_()
        return None if row_weight is None else torch.zeros(M, device=dy.device, dtype=torch.float32)
    cfg = config or default_config(H)
    partials = None
    if row_weight is not None:
        partials = torch.empty(M, triton.cdiv(H, cfg["BLOCK_N"]), device=dy.device, dtype=torch.float32)
    _launch(dy, w, offsets, dh, H, True, _SWIGLU_BACKWARD, cfg, out=h, row_weight=row_weight, partials=partials)
    return None if partials is None else partials.sum(1)


def _launch(x: Tensor, w: Tensor, offsets: Tensor, y: Tensor, N: int, trans_w: bool, epilogue, config: dict | None,
            *, out: Tensor | None = None, row_weight: Tensor | None = None, partials: Tensor | None = None) -> None:
    """One launch of the kernel for N columns of products, its epilogue ``epilogue`` (y the
    product's output, or the forward's h, or the backward's dh; out the forward's SwiGLU
    output, or the backward's h)."""
    (M, K), G = x.shape, offsets.shape[0]
    if y.numel() == 0:
        return
    if G == 0:  # every row is past offsets[-1]; a descriptor of w needs at least one row
        y.zero_()
        return
    cfg = config or default_config(N)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    swiglu = epilogue == _SWIGLU
    ((xb, xl), (wb, wl), (yb, yl)), w_tile_layout, y_tile_layout = _layouts(x.dtype, cfg, trans_w, swiglu)
    x_desc = TensorDescriptor.from_tensor(x, xb, xl)
    w_desc = TensorDescriptor(w, [G * w.shape[1], w.shape[2]], [w.shape[2], 1], wb, wl)
    y_desc = TensorDescriptor.from_tensor(y, yb, yl)
    out_desc = TensorDescriptor.from_tensor(out, yb, yl) if swiglu else y_desc  # else unused
    out = y if out is None else out  # placeholders, never read or written
    rw = y if row_weight is None else row_weight
    items = (triton.cdiv(M, bm) + G) * triton.cdiv(N, bn)
    grid = (min(grouped_mm_tma._num_programs(x.device), items),)
    with device_guard(x):
        _grouped_mm_ws_kernel[grid](x_desc, w_desc, y_desc, out_desc, y, out, rw,
                                    rw if partials is None else partials, offsets, M, N, K, G, y.stride(0),
                                    out.stride(0), SEGMENTS=triton.next_power_of_2(G + 1), TRANS_W=trans_w,
                                    EPILOGUE=epilogue, HAS_WEIGHT=row_weight is not None, STAGES=cfg["STAGES"],
                                    BLOCK_N=bn, COOP=cfg["COOP"], W_TILE_LAYOUT=w_tile_layout,
                                    Y_TILE_LAYOUT=y_tile_layout,
                                    num_warps=CONSUMER_WARPS, maxnreg=MAX_REGISTERS)


def _compile_sm90(kernel, signature: dict, constexprs: dict):
    """Compile a Gluon ``kernel`` of this module for sm90 on the CPU; ``signature`` holds the
    runtime arguments' types, ``constexprs`` the values of the rest."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    source = GluonASTSource(kernel, {**signature, **{name: "constexpr" for name in constexprs}}, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": CONSUMER_WARPS, "maxnreg": MAX_REGISTERS})


def compile_for_sm90(dtype: torch.dtype = torch.bfloat16, *, trans_w: bool = False, config: dict | None = None,
                     groups: int = 8, epilogue: str = "store"):
    """Compile the kernel for an sm90 (Hopper) target without a GPU: Triton's front end, its
    passes and ptxas all run on the CPU. Returns the compiled kernel (its .asm holds the TTGIR,
    PTX and cubin, its .metadata the shared memory): the CPU tests check what can be checked
    before a GPU runs it (shared memory, the partitions, ptxas_report). ``epilogue``: "store",
    "swiglu" (the forward's, with row weights) or "swiglu_backward" (dx's, with row weights)."""
    cfg = config or config_dict(*CONFIGS[0])
    mode = {"store": _STORE, "swiglu": _SWIGLU, "swiglu_backward": _SWIGLU_BACKWARD}[epilogue]
    ((xb, xl), (wb, wl), (yb, yl)), w_tile_layout, y_tile_layout = _layouts(dtype, cfg, trans_w, mode == _SWIGLU)
    ty = "bf16" if dtype == torch.bfloat16 else "fp16"
    desc = lambda block, layout: f"tensordesc<{ty}[{', '.join(map(str, block))}],{layout!r}>"  # noqa: E731
    weighted = mode != _STORE
    signature = {"x_desc": desc(xb, xl), "w_desc": desc(wb, wl), "y_desc": desc(yb, yl), "out_desc": desc(yb, yl),
                 "y_ptr": f"*{ty}", "out_ptr": f"*{ty}", "rw_ptr": "*fp32" if weighted else f"*{ty}",
                 "partial_ptr": "*fp32" if weighted else f"*{ty}", "offsets_ptr": "*i32", "M": "i32", "N": "i32",
                 "K": "i32", "G": "i32", "stride_ym": "i32", "stride_om": "i32"}
    constexprs = {"SEGMENTS": triton.next_power_of_2(groups + 1), "TRANS_W": trans_w, "EPILOGUE": mode,
                  "HAS_WEIGHT": weighted, "STAGES": cfg["STAGES"], "BLOCK_N": cfg["BLOCK_N"], "COOP": cfg["COOP"],
                  "W_TILE_LAYOUT": w_tile_layout, "Y_TILE_LAYOUT": y_tile_layout}
    return _compile_sm90(_grouped_mm_ws_kernel, signature, constexprs)


KERNELS = {"forward": {"trans_w": False}, "dx": {"trans_w": True},
           "forward+swiglu": {"epilogue": "swiglu"}, "dx+swiglu_backward": {"trans_w": True, "epilogue": "swiglu_backward"}}


def sm90_report() -> dict[str, dict]:
    """Every config of every kernel (KERNELS) compiled for sm90 on this machine (no GPU needed):
    {"forward/128x256x64x3-coop": {"shared": bytes, "warp_specialized": TTGIR has the partitions,
    "wgmma": PTX has wgmma, "ptxas": ptxas's register, spill and warning lines}, ...}. Run it in
    a fresh process: a Triton interpreter run earlier in the same process leaves state that
    breaks Gluon's compiler (the CPU tests call it through a subprocess for that reason)."""
    def summary(compiled) -> dict:
        return {"shared": compiled.metadata.shared, "warp_specialized": "ttg.warp_specialize" in compiled.asm["ttgir"],
                "wgmma": "wgmma.mma_async" in compiled.asm["ptx"], "ptxas": ptxas_report(compiled)}

    return {f"{name}/{config_name(c)}": summary(compile_for_sm90(config=config_dict(*c), groups=64, **kwargs))
            for c in CONFIGS for name, kwargs in KERNELS.items()}
