#!/usr/bin/env python3
"""The attention's QK-norm + RoPE on one GPU: our kernel against torch's paths (not a test).

    python bench/qk_norm_rope.py [--shapes 8x4096x2048 2x4096x2048 1x4096x4096] [--reps 50] [--sweep]
    python bench/qk_norm_rope.py --ingest bench/results/qk-norm-rope-nvidia-h200.jsonl   # into the store

Per shape (batch x sequence x width, head dim 128, bf16 in and out, float32 weight as the one-GPU
model keeps it) and path, the median time of the forward and of forward + backward (dy given,
dx and dweight made): the device time of the kernels a call launches (the profiler's, summed
per call over ``--reps`` calls after a warm-up: inside a compiled block the host's launch cost is
hidden), and beside it the wall time between CUDA events (host overhead included):

    eager     the model's torch ops (RMSNorm, then apply_rotary): what FSDP2 runs execute
    compiled  the same ops under torch.compile: a compiled block's path without the kernel
    triton    optimus_kernels.qk_norm_rope

beside the floor: the fewest bytes (forward: read x, write y; backward: read x and dy, write dx;
2 bytes each in bf16) over the device's copy bandwidth, measured in the same call. ``--sweep``
adds the kernel at other tiles (optimus_kernels.qk_norm_rope's TILE_ELEMENTS, WARPS and
BACKWARD_PROGRAMS), as paths named ``triton[elements/warps/programs]``. Each path is
first checked against the float64 reference on the same bf16 inputs (relative error of y, dx,
dweight). Output: a table, bench/results/qk-norm-rope-<device>.jsonl (one line per shape and
path, and a summary), and run ``bench-qk-norm-rope-<device>`` in the store where it imports.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from bench.common import device_slug, ingest, publish  # noqa: E402

HEAD_DIM = 128
PATHS = ("eager", "compiled", "triton")
SWEEP = [(e, w, p) for e in (1024, 2048, 4096) for w in (4, 8, 16) for p in (512, 2048)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["8x4096x2048", "2x4096x2048", "1x4096x4096"],
                   help="BxSxD: batch, sequence, width (heads x 128)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="also the kernel at the tiles of SWEEP")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--store", default=str(ROOT / "results" / "store.zarr"))
    p.add_argument("--ingest", default=None, help="write an existing JSONL file to the store and exit")
    return p.parse_args(argv)


def copy_bandwidth(device, n_bytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    import torch

    from bench.kernels import Timer

    a = torch.empty(n_bytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() / (Timer(device, reps=20, warmup=3)(lambda: b.copy_(a)) / 1e3)


def kernel_ms(fn, reps: int) -> float:
    """Device time of the kernels ``fn`` launches, per call (the profiler's, summed)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    us = sum(e.time_range.elapsed_us() for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    return us / 1e3 / reps


def path_fn(path: str, norm, cos, sin):
    """y = f(x) of one path, with ``norm`` (an RMSNorm module) holding the weight: the model's
    own modules for eager and compiled."""
    import torch

    from optimus_kernels import qk_norm_rope
    from optimus_core.model.layers import apply_rotary

    if path == "triton":
        return lambda x: qk_norm_rope(x, norm.weight, cos, sin, eps=norm.eps)

    def torch_ops(x):
        B, S, D = x.shape
        n = norm(x).view(B, S, D // HEAD_DIM, HEAD_DIM)
        return apply_rotary(n, cos[:, None], sin[:, None]).reshape(B, S, D)

    return torch.compile(torch_ops) if path == "compiled" else torch_ops


def measure(shape: str, path: str, reps: int, bandwidth: float, device) -> dict:
    import torch

    from bench.kernels import Timer
    from optimus_kernels import qk_norm_rope_reference
    from optimus_core.model.layers import RMSNorm, RotaryEmbedding

    B, S, D = map(int, shape.split("x"))
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(B, S, D, device=device, generator=gen).mul_(3).bfloat16()
    norm = RMSNorm(D, eps=1e-5).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, device=device, generator=gen).add_(0.5))
    dy = torch.randn(B, S, D, device=device, generator=gen).bfloat16()
    cos, sin = RotaryEmbedding(HEAD_DIM, 10000.0, S).to(device)(S)
    fn = path_fn(path, norm, cos, sin)

    xa = x.clone().requires_grad_()
    y = fn(xa)
    y.backward(dy)
    xr, wr = x.double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    yr = qk_norm_rope_reference(xr, wr, cos.double(), sin.double(), eps=1e-5)
    yr.backward(dy.double())
    err = {name: ((a.double() - b).norm() / b.norm()).item()
           for name, a, b in (("y", y, yr), ("dx", xa.grad, xr.grad), ("dweight", norm.weight.grad, wr.grad))}
    del xr, wr, yr

    def forward():
        with torch.no_grad():
            fn(x)

    def both():
        xa.grad = norm.weight.grad = None
        fn(xa).backward(dy)

    fwd_ms, both_ms = kernel_ms(forward, reps), kernel_ms(both, reps)
    wall = Timer(device, reps, warmup=3)  # device events around each call: the host's launches included
    wall_fwd_ms, wall_both_ms = wall(forward), wall(both)
    elem = B * S * D
    floor_fwd_ms = 4 * elem / bandwidth * 1e3  # read x, write y (bf16)
    floor_bwd_ms = 6 * elem / bandwidth * 1e3  # read x and dy, write dx
    return {"bench": "qk_norm_rope", "series": f"{shape}-{path}", "shape": shape, "path": path, "tokens": B * S,
            "width": D, "forward_ms": fwd_ms, "forward_backward_ms": both_ms, "backward_ms": both_ms - fwd_ms,
            "wall_forward_ms": wall_fwd_ms, "wall_forward_backward_ms": wall_both_ms,
            "floor_forward_ms": floor_fwd_ms, "floor_backward_ms": floor_bwd_ms,
            "forward_over_floor": fwd_ms / floor_fwd_ms,
            "backward_over_floor": (both_ms - fwd_ms) / floor_bwd_ms,
            **{f"rel_err_{k}": v for k, v in err.items()}}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.ingest:
        print(ingest(args.ingest, args.store, key="series"))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/qk_norm_rope.py times CUDA kernels and found no CUDA device")
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    records = []
    print(f"{'shape':>14} {'path':>22} {'fwd ms':>7} {'x floor':>7} {'bwd ms':>7} {'x floor':>7} "
          f"{'err y':>8} {'err dx':>8} {'err dw':>8}")
    tiles = importlib.import_module("optimus_kernels.qk_norm_rope")  # the package's qk_norm_rope is the function
    default = (tiles.TILE_ELEMENTS, tiles.WARPS, tiles.BACKWARD_PROGRAMS)
    runs = [(path, None) for path in args.paths] + ([("triton", t) for t in SWEEP if t != default] if args.sweep else [])
    for shape in args.shapes:
        for path, tile in runs:
            torch._dynamo.reset()
            tiles.TILE_ELEMENTS, tiles.WARPS, tiles.BACKWARD_PROGRAMS = tile or default
            try:
                r = measure(shape, path, args.reps, bandwidth, device)
            finally:
                tiles.TILE_ELEMENTS, tiles.WARPS, tiles.BACKWARD_PROGRAMS = default
            if tile:
                r.update(path=f"triton[{'/'.join(map(str, tile))}]", series=f"{shape}-triton[{'/'.join(map(str, tile))}]")
            records.append(r)
            print(f"{shape:>14} {r['path']:>22} {r['forward_ms']:>7.3f} {r['forward_over_floor']:>7.2f} "
                  f"{r['backward_ms']:>7.3f} {r['backward_over_floor']:>7.2f} {r['rel_err_y']:>8.1e} "
                  f"{r['rel_err_dx']:>8.1e} {r['rel_err_dweight']:>8.1e}", flush=True)
    by = {(r["shape"], r["path"]): r for r in records}
    speedups = {shape: {f"triton_vs_{p}": by[shape, p]["forward_backward_ms"] / by[shape, "triton"]["forward_backward_ms"]
                        for p in args.paths if p != "triton" and (shape, "triton") in by}
                for shape in args.shapes}
    fastest = {shape: min((r for r in records if r["shape"] == shape and r["path"].startswith("triton")),
                          key=lambda r: r["forward_backward_ms"])["path"] for shape in args.shapes}
    summary = {"bench": "qk_norm_rope_summary", "device": torch.cuda.get_device_name(device),
               "copy_bandwidth_tb_s": bandwidth / 1e12, "head_dim": HEAD_DIM, "tile": list(default),
               "speedup_forward_backward": speedups, "fastest_triton_tile": fastest}
    publish(Path(args.out) / f"qk-norm-rope-{device_slug(device)}.jsonl", records, summary, args.store, key="series")


if __name__ == "__main__":
    main()
