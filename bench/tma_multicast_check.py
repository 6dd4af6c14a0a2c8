#!/usr/bin/env python3
"""Whether the installed Triton's Gluon emits a multicast TMA load on Hopper (not a benchmark).

    python bench/tma_multicast_check.py                       # the installed Triton
    pip install --no-deps --target /tmp/tN triton==N          # another one, on the CPU
    PYTHONPATH=/tmp/tN python bench/tma_multicast_check.py

Why: CUTLASS's grouped GEMMs (torch._grouped_mm's) load each shared operand tile once per 2-CTA
cluster and multicast it to both CTAs' shared memory; our dW kernel loads it once per CTA and
moves 23-30 % more L2 bytes (bench/NOTES.md, twenty-second to twenty-fourth sessions). Whether a kernel of ours
can do the same depends on the Triton the GPU machine runs, and that is answered here without a
GPU: a 64 x 64 bf16 tile, laid out as broadcast across a 2-CTA cluster (every CTA holds all of
it), is loaded by TMA and compiled for sm90 on the CPU, and the PTX says whether the load carries
``.multicast::cluster``. Where Gluon's TMA load takes ``multicast=`` the probe asks for it; where
it does not, the same broadcast layout is compiled without it, to see whether the compiler
multicasts on its own.

Prints one JSON line: Triton's version, the load compiled, ``multicast`` (true / false) and the
PTX of the load. Exit status 0 either way; 1 if the kernel did not compile.
"""
from __future__ import annotations

import inspect
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

CTAS = 2  # the cluster: CUTLASS's 2 x 1 for these GEMMs
TILE = 64
_TILE = gl.constexpr(TILE)  # the same, as the kernel reads it
BROADCAST = [[0, 0]]  # one CGA basis, all zero: both CTAs of the cluster hold the whole tile


def _multicast_copy() -> str | None:
    """The name of Gluon's TMA load when it takes ``multicast=`` (async_copy_global_to_shared in
    3.7, async_load from 3.8), else None."""
    for name in ("async_load", "async_copy_global_to_shared"):
        fn = getattr(tma, name, None)
        if fn is not None and "multicast" in inspect.signature(fn).parameters:
            return name
    return None


MULTICAST_COPY = _multicast_copy()

if MULTICAST_COPY == "async_load":
    @gluon.jit
    def _tma_load(desc, bar, tile):
        tma.async_load(desc, [0, 0], bar, tile, multicast=True)
elif MULTICAST_COPY == "async_copy_global_to_shared":
    @gluon.jit
    def _tma_load(desc, bar, tile):
        tma.async_copy_global_to_shared(desc, [0, 0], bar, tile, multicast=True)
else:  # no way to ask: the compiler sees only the broadcast layout
    @gluon.jit
    def _tma_load(desc, bar, tile):
        tma.async_copy_global_to_shared(desc, [0, 0], bar, tile)


def _barrier_layout() -> tuple:
    """(layout, elements) of the load's barrier: one element per CTA, split across the cluster,
    where the layout knows clusters (Gluon from 3.7); a per-CTA barrier before."""
    multicta = getattr(mbarrier.MBarrierLayout, "multicta", None)
    return (multicta(CTAS), CTAS) if multicta is not None else (mbarrier.MBarrierLayout(), 1)


@gluon.jit
def _load_tile(desc, out_ptr, SMEM: gl.constexpr, REG: gl.constexpr, BAR: gl.constexpr, BAR_SIZE: gl.constexpr):
    tile = gl.allocate_shared_memory(gl.bfloat16, [_TILE, _TILE], SMEM)
    bar = gl.allocate_shared_memory(gl.int64, [BAR_SIZE], BAR)
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, _TILE * _TILE * 2)
    _tma_load(desc, bar, tile)
    mbarrier.wait(bar, 0)
    x = tile.load(REG)
    rows = gl.arange(0, _TILE, layout=gl.SliceLayout(1, REG))
    cols = gl.arange(0, _TILE, layout=gl.SliceLayout(0, REG))
    gl.store(out_ptr + rows[:, None] * _TILE + cols[None, :], x)


def check() -> dict:
    smem = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=BROADCAST)
    reg = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=BROADCAST)
    bar_layout, bar_size = _barrier_layout()
    constexprs = {"SMEM": smem, "REG": reg, "BAR": bar_layout, "BAR_SIZE": bar_size}
    signature = {"desc": f"tensordesc<bf16[{TILE}, {TILE}],{smem!r}>", "out_ptr": "*bf16",
                 **{name: "constexpr" for name in constexprs}}
    compiled = triton.compile(GluonASTSource(_load_tile, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": CTAS})
    loads = [line.strip() for line in compiled.asm["ptx"].splitlines() if "cp.async.bulk.tensor" in line]
    asked = f"tma.{MULTICAST_COPY}(multicast=True)" if MULTICAST_COPY else "tma.async_copy_global_to_shared"
    return {"triton": triton.__version__, "load": asked, "cluster": CTAS,
            "multicast": any(".multicast::cluster" in line for line in loads), "tma_loads": loads}


def main() -> int:
    try:
        result = check()
    except Exception as exc:  # a Gluon whose calls differ from those above
        print(json.dumps({"triton": triton.__version__, "error": f"{type(exc).__name__}: {exc}"[:500]}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
