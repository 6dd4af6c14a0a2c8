"""Probe this machine for the performance model's CPU machine file (workflow/machines/cpu.yaml).

    .venv/bin/python bench/probe_machine.py            # ~1 minute; prints a table
    .venv/bin/python bench/probe_machine.py --quick    # smaller messages, fewer repeats

Measures what workflow/perfmodel/ needs, the way our CPU runs use the machine (one torch
thread per rank, gloo between local processes):

- float32 (and bfloat16) matmul GFLOP/s on one thread, square sizes, best of a few repeats;
- copy bandwidth (GB/s of bytes read + written) of a large float32 tensor on one thread;
- gloo all-to-all / reduce-scatter / all-gather / all-reduce between 2 local processes over
  message sizes, each fitted to ``t = latency x steps + factor x S / busbw`` (the bus-bandwidth
  convention of nccl-tests: factor (n-1)/n for all-to-all, reduce-scatter and all-gather,
  2 (n-1)/n for all-reduce; steps n-1, or 2 (n-1) for all-reduce), which is the form the
  model predicts with.

Writes bench/results/probe-cpu.json (atomically). A benchmark, not a test: the machine may be
shared, so numbers move by tens of percent between runs; the JSON records when and where.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from optimus_core.atomic import atomic_write  # noqa: E402

KINDS = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce")
NPROC = 2


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (allocations, first-touch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def probe_matmul(sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """GFLOP/s of an n x n x n matmul (2 n^3 FLOPs) on one thread, per dtype."""
    out: dict[str, dict[int, float]] = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        out[name] = {}
        for n in sizes:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            s = _best_seconds(lambda: torch.mm(a, b), repeats)
            out[name][n] = 2 * n**3 / s / 1e9
    return out


def probe_copy(mbytes: int, repeats: int) -> float:
    """GB/s of bytes moved (read + write) by a float32 tensor copy on one thread."""
    src = torch.randn(mbytes * 2**20 // 4)
    dst = torch.empty_like(src)
    s = _best_seconds(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / s / 1e9


def _collective(kind: str, nbytes: int, world: int):
    """A closure running one collective on a message of ``nbytes`` (the nccl-tests size S)."""
    import torch.distributed as dist

    numel = max(world, nbytes // 4 // world * world)
    if kind == "all_to_all":
        x, y = torch.randn(numel), torch.empty(numel)
        return lambda: dist.all_to_all_single(y, x)
    if kind == "reduce_scatter":
        x, y = torch.randn(numel), torch.empty(numel // world)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: fn(y, x)
    if kind == "all_gather":
        x, y = torch.randn(numel // world), torch.empty(numel)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: fn(y, x)
    x = torch.randn(numel)
    return lambda: dist.all_reduce(x)


def _rank_main(sizes: list[int], repeats: int, out_path: str) -> None:
    torch.set_num_threads(1)  # as our CPU runs: one thread per rank
    import torch.distributed as dist

    from optimus_core.config import ParallelConfig
    from optimus_core.parallel import init_distributed, shutdown

    mesh = init_distributed(ParallelConfig(), device="cpu")
    result: dict[str, list[float]] = {}
    for kind in KINDS:
        result[kind] = []
        for nbytes in sizes:
            run = _collective(kind, nbytes, mesh.world_size)
            reps = repeats if nbytes >= 2**20 else repeats * 4
            for _ in range(2):
                run()
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            # The slowest rank finishes the collective: take the max over ranks of each median.
            med = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            result[kind].append(float(med))
    if mesh.rank == 0:
        Path(out_path).write_text(json.dumps(result))
    shutdown(mesh)


def fit_collective(kind: str, sizes: list[int], times: list[float], n: int) -> dict[str, float]:
    """Least squares of ``t = a + factor S / busbw`` weighted by 1/t (relative error);
    latency per step = a / steps (see the module docstring for factor and steps)."""
    factor = (n - 1) / n * (2 if kind == "all_reduce" else 1)
    steps = (n - 1) * (2 if kind == "all_reduce" else 1)
    S, t = np.asarray(sizes, float), np.asarray(times, float)
    A = np.stack([np.ones_like(S), factor * S], axis=1) / t[:, None]
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    a = max(a, 0.0)
    if b <= 0:  # latency-dominated everywhere: take the largest message's rate
        b = (t[-1] - a) / (factor * S[-1]) if t[-1] > a else t[-1] / (factor * S[-1])
    return {"busbw": 1.0 / b, "latency": a / steps}


def probe_collectives(sizes: list[int], repeats: int) -> dict[str, dict]:
    from optimus_core.parallel.launch import spawn_local

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "coll.json")
        spawn_local(_rank_main, nproc=NPROC, args=(sizes, repeats, out))
        raw = json.loads(Path(out).read_text())
    return {kind: {"bytes": sizes, "time_s": raw[kind], **fit_collective(kind, sizes, raw[kind], NPROC)}
            for kind in KINDS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "probe-cpu.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    mm_sizes = [256, 512] if args.quick else [256, 512, 1024]
    coll_sizes = [2**12, 2**16, 2**20, 2**22] if args.quick else [2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26]
    repeats = 3 if args.quick else 12

    collectives = probe_collectives(coll_sizes, repeats)  # first: the children start from a quiet parent
    matmul = probe_matmul(mm_sizes, repeats)
    copy_gbs = probe_copy(64 if not args.quick else 16, repeats)

    result = {
        "bench": "probe_machine", "device": "cpu",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "bench/probe_machine.py" + (" --quick" if args.quick else ""),
        "host": platform.node(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "threads_per_rank": 1, "nproc": NPROC,
        "matmul_gflops": {d: {str(n): v for n, v in sizes.items()} for d, sizes in matmul.items()},
        "copy_gbs": copy_gbs,
        "collectives": collectives,
        "seconds": time.perf_counter() - t_start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(result, indent=2) + "\n")

    print(f"probe on {result['host']} ({result['cpu_count']} CPUs, torch {result['torch']}, 1 thread per rank)")
    for dtype, sizes in matmul.items():
        print(f"  matmul {dtype:9s} " + "  ".join(f"n={n}: {v:6.1f} GFLOP/s" for n, v in sizes.items()))
    print(f"  copy           {copy_gbs:6.2f} GB/s (read + write)")
    print(f"  {'gloo, 2 procs':16s} {'busbw GB/s':>10s} {'latency us':>11s}   time per size (bytes: ms)")
    for kind, c in collectives.items():
        per = "  ".join(f"{b}: {t * 1e3:.3g}" for b, t in zip(c["bytes"], c["time_s"]))
        print(f"  {kind:16s} {c['busbw'] / 1e9:10.3f} {c['latency'] * 1e6:11.1f}   {per}")
    print(f"wrote {args.out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
