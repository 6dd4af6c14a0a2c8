#!/usr/bin/env python3
"""Our expert GEMM and torch._grouped_mm on the same operands, the forward (y = x @ w per group) or
dW (x^T @ dy per group), each launched once after a warm-up inside its own NVTX range, for
Nsight Compute's counters (not a timing benchmark: bench/kernels.py times both).

    ncu --nvtx --nvtx-include "ours/" --nvtx-include "torch/" \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \\
        python bench/ncu_grouped_mm.py [--op up|down] [--pass fwd|dw] [--tokens 32768] [--ws-configs]

--ws-configs (forward, Hopper): also each config of the warp-specialized kernel
(kernels/optimus_kernels/hopper/grouped_mm_ws.CONFIGS), one range each, "ws-<config>/" (add --nvtx-include "ws-*/" or
one config's name): the ping-pong and cooperative schedules' bytes side by side.

The question it serves: whether our kernels move more bytes from DRAM and L2 than
torch._grouped_mm, where they run slower than it (bench/kernels.py times both on the same GPU).
Shapes: mula-7b-a1b's experts (64, top-8, d_model 2048, hidden 1024), the up projection
(K = 2048, N = 2 * 1024) or the down (K = 1024, N = 2048), balanced routing, bf16.
Prints the two products' largest difference, so that a run shows both computed the same thing.
On a CPU (TRITON_INTERPRET=1) it runs a tiny float32 shape: a check of the script, not of the kernels.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from optimus_kernels import grouped_mm  # noqa: E402
from optimus_kernels.grouped_mm import _launch_grouped_mm_dw  # noqa: E402

EXPERTS, TOP_K, D_MODEL, HIDDEN = 64, 8, 2048, 1024


def operands(op: str, tokens: int, device: torch.device):
    """x (M, K), w (E, K, N), offsets (E,) int32 of a balanced routing, in the device's dtype."""
    if device.type == "cpu":  # the interpreter: a tiny float32 shape with 16-byte rows
        experts, rows, (K, N), dtype = 4, 8, (16, 32), torch.float32
    else:
        experts, rows, dtype = EXPERTS, tokens * TOP_K // EXPERTS, torch.bfloat16
        K, N = (D_MODEL, 2 * HIDDEN) if op == "up" else (HIDDEN, D_MODEL)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(experts * rows, K, device=device, dtype=dtype, generator=gen)
    w = torch.randn(experts, K, N, device=device, dtype=dtype, generator=gen) / K**0.5
    offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows
    return x, w, offsets


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--op", choices=("up", "down"), default="up")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "dw"), default="fwd",
                   help="dw: x^T @ dy per group, in the inputs' dtype (the step's bf16 expert gradients)")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per GPU (rows = tokens x top-8)")
    p.add_argument("--ws-configs", action="store_true",
                   help="forward: also each config of the warp-specialized kernel, a range each")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, w, offsets = operands(args.op, args.tokens, device)
    extra = {}  # range name -> the product, beside ours and torch's
    if args.pass_ == "fwd":
        ours = lambda: grouped_mm(x, w, offsets)  # noqa: E731
        theirs = lambda: torch._grouped_mm(x, w, offs=offsets)  # noqa: E731
        if args.ws_configs:
            extra = ws_ranges(x, w, offsets)
    else:  # dy shaped as the forward's output; the offsets split the reduction dimension
        dy = torch.randn(x.shape[0], w.shape[2], device=device, dtype=x.dtype) / w.shape[2] ** 0.5
        ours = lambda: _launch_grouped_mm_dw(x, dy, offsets, False)  # noqa: E731
        theirs = lambda: torch._grouped_mm(x.t(), dy, offs=offsets)  # noqa: E731
    for _ in range(3):  # autotuning and compiles outside the profiled ranges
        a, b = ours(), theirs()
        products = {name: fn() for name, fn in extra.items()}
    if device.type == "cuda":
        torch.cuda.synchronize()
        for name, fn in (("ours", ours), ("torch", theirs), *extra.items()):
            torch.cuda.nvtx.range_push(name)
            fn()
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    for name, product in (("ours", a), *products.items()):
        print(f"{args.op} {args.pass_} M={x.shape[0]} K={x.shape[1]} N={w.shape[2]} on {device.type}, {name}: "
              f"largest difference {(product.float() - b.float()).abs().max().item():.3g} "
              f"(|product| up to {b.float().abs().max().item():.3g})")


def ws_ranges(x, w, offsets) -> dict:
    """{"ws-<config>": () -> the forward by the warp-specialized kernel with that config}, for
    each config in kernels/optimus_kernels/hopper/grouped_mm_ws.CONFIGS; {} where the kernel cannot run (it says why)."""
    from optimus_kernels.hopper import grouped_mm_ws as ws
    y = torch.empty(x.shape[0], w.shape[2], device=x.device, dtype=x.dtype)
    if (reason := ws.ws_unsupported(x, w, y)) is not None:
        print(f"--ws-configs: skipped, {reason}")
        return {}
    return {f"ws-{ws.config_name(c)}": lambda c=c: ws.launch_grouped_mm_ws(x, w, offsets, torch.empty_like(y),
                                                                         config=ws.config_dict(*c))
            for c in ws.CONFIGS}


if __name__ == "__main__":
    main()
