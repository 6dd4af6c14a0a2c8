"""The work numbering the grouped GEMM kernels share, computed on the device from offsets.

    seg, starts, ends, tiles, tiles_end = segment_tiles(offsets_ptr, M, G, SEGMENTS, BLOCK_M)
    g, row_start, row_end = locate_tile(tile, seg, starts, ends, tiles, tiles_end, BLOCK_M)
    seg, starts, ends, rank = groups_by_size(offsets_ptr, M, G, SEGMENTS, CHUNK)   # dW
    g, row_start, row_end = group_of_rank(j, seg, starts, ends, rank)

Segments 0..G-1 are the groups, segment G the rows past offsets[-1] (zero output); SEGMENTS is a
power of two >= G + 1 and the lanes past G are empty. Row tiles of BLOCK_M rows are numbered
segment after segment, each segment starting a fresh tile, so a tile never spans two segments
and there are at most cdiv(M, BLOCK_M) + G of them (each segment adds at most one partial tile).
Every program rebuilds the numbering from the G offsets, so the host never reads group sizes.

dW's work items are whole groups' reductions instead (one per output tile of dw[g]), and they
cost in proportion to the group's rows. A persistent grid deals items out round-robin, so it
takes them largest group first: each round then holds groups of about one size, and the items
left for the last, partial round are the cheapest. groups_by_size ranks the groups (largest
first, ties by index) with a SEGMENTS x CHUNK comparison per step, CHUNK lanes at a time so
that the registers it needs stay small at G = 256.
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


@jit
def _group_rows(offsets_ptr, M, G, lanes):
    """First row, end row and row count of the groups in `lanes`; lanes >= G count -1 rows."""
    ends = tl.minimum(tl.load(offsets_ptr + lanes, mask=lanes < G, other=0), M)
    starts = tl.minimum(tl.load(offsets_ptr + lanes - 1, mask=(lanes > 0) & (lanes < G), other=0), ends)
    return starts, ends, tl.where(lanes < G, tl.maximum(ends - starts, 0), -1)


@jit
def groups_by_size(offsets_ptr, M, G, SEGMENTS: tl.constexpr, CHUNK: tl.constexpr):
    """Per lane (a power of two SEGMENTS >= G; CHUNK divides it): the group's first row, end row
    and rank by row count, largest first (ties by index); lanes >= G rank last."""
    seg = tl.arange(0, SEGMENTS)
    starts, ends, rows = _group_rows(offsets_ptr, M, G, seg)
    rank = tl.zeros([SEGMENTS], dtype=tl.int32)
    for c in range(0, SEGMENTS, CHUNK):
        other = c + tl.arange(0, CHUNK)
        _, _, other_rows = _group_rows(offsets_ptr, M, G, other)
        ahead = (other_rows[None, :] > rows[:, None]) | \
            ((other_rows[None, :] == rows[:, None]) & (other[None, :] < seg[:, None]))
        rank += tl.sum(ahead.to(tl.int32), 1)
    return seg, starts, ends, rank


@jit
def group_of_rank(j, seg, starts, ends, rank):
    """The group ranked j by groups_by_size, and its rows row_start .. row_end."""
    pick = rank == j
    g = tl.sum(tl.where(pick, seg, 0), 0)
    return g, tl.sum(tl.where(pick, starts, 0), 0), tl.sum(tl.where(pick, ends, 0), 0)
