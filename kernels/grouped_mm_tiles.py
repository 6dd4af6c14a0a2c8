"""The row-tile numbering the grouped GEMM kernels share, computed on the device from offsets.

    seg, starts, ends, tiles, tiles_end = segment_tiles(offsets_ptr, M, G, SEGMENTS, BLOCK_M)
    g, row_start, row_end = locate_tile(tile, seg, starts, ends, tiles, tiles_end, BLOCK_M)

Segments 0..G-1 are the groups, segment G the rows past offsets[-1] (zero output); SEGMENTS is a
power of two >= G + 1 and the lanes past G are empty. Row tiles of BLOCK_M rows are numbered
segment after segment, each segment starting a fresh tile, so a tile never spans two segments
and there are at most cdiv(M, BLOCK_M) + G of them (each segment adds at most one partial tile).
Every program rebuilds the numbering from the G offsets, so the host never reads group sizes.
"""

from __future__ import annotations

from ._triton import jit, tl


@jit
def segment_tiles(offsets_ptr, M, G, SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per segment: first row, end row, row-tile count and the running tile total (inclusive)."""
    seg = tl.arange(0, SEGMENTS)
    ends = tl.minimum(tl.load(offsets_ptr + seg, mask=seg < G, other=M), M)  # clamp: never address past M
    starts = tl.load(offsets_ptr + seg - 1, mask=(seg > 0) & (seg <= G), other=0)
    starts = tl.where(seg > G, M, tl.minimum(starts, M))
    tiles = tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M)
    return seg, starts, ends, tiles, tl.cumsum(tiles, 0)


@jit
def locate_tile(tile, seg, starts, ends, tiles, tiles_end, BLOCK_M: tl.constexpr):
    """The segment holding row tile `tile` (> G past the last tile) and the tile's rows
    row_start .. min(row_start + BLOCK_M, row_end)."""
    g = tl.sum((tiles_end <= tile).to(tl.int32), 0)
    row_end = tl.sum(tl.where(seg == g, ends, 0), 0)
    row_start = tl.sum(tl.where(seg == g, starts + (tile - tiles_end + tiles) * BLOCK_M, 0), 0)
    return g, row_start, row_end
