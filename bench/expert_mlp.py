#!/usr/bin/env python3
"""The experts' MLP on one GPU: kernels.expert_mlp against the three ops apart (not a test).

    python bench/expert_mlp.py [--tokens 8192 32768] [--routing balanced zipf] [--reps 30]
    python bench/expert_mlp.py --ingest bench/results/expert-mlp-nvidia-h200.jsonl   # into the store

Shapes: Mula-7B-A1B's experts (64 of hidden 1024, top-8, d_model 2048), bf16 activations and
weights (the one-GPU plan's bf16 copies), T tokens per GPU, so M = 8T sorted rows; routing as
bench/kernels.py. Paths, each timed forward and forward + backward (dy given; dx, both weights'
gradients and the routing weights' made):

    fused     kernels.expert_mlp: SwiGLU in the up projection's epilogue, its backward in the
              down projection's dx epilogue
    unfused   grouped_mm -> swiglu -> grouped_mm, the triton backend
    torch     the same three ops with torch._grouped_mm (backend "torch")

Each path is first compared with the float64 loop on the same bf16 inputs (relative error of y
and every gradient). Timing: bench/kernels.py's Timer, the paths in turns (clock drift hits
each alike), median of --reps. Output: a table, bench/results/expert-mlp-<device>.jsonl (one
line per tokens, routing, path and pass, and a summary) and run ``bench-expert-mlp-<device>``
in the store where it imports.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import device_slug, ingest, publish  # noqa: E402

E, TOP_K, D, F = 64, 8, 2048, 1024
PATHS = ("fused", "unfused", "torch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--routing", nargs="+", default=["balanced", "zipf"], choices=["balanced", "zipf"])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--store", default=str(ROOT / "results" / "store.zarr"))
    p.add_argument("--ingest", default=None, help="write an existing JSONL file to the store and exit")
    return p.parse_args(argv)


def mlp_fn(path: str, offsets):
    import kernels

    if path == "fused":
        return lambda x, w_up, w_down, rw: kernels.expert_mlp(x, w_up, w_down, offsets, rw)
    backend = "triton" if path == "unfused" else "torch"

    def unfused(x, w_up, w_down, rw):
        h = kernels.swiglu(kernels.grouped_mm(x, w_up, offsets, backend=backend), row_weight=rw, backend=backend)
        return kernels.grouped_mm(h, w_down, offsets, backend=backend)
    return unfused


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from bench.kernels import Timer, route
    from kernels import expert_mlp_reference, permute

    if args.ingest:
        print(ingest(args.ingest, args.store, key="series"))
        return
    if not torch.cuda.is_available():
        sys.exit("bench/expert_mlp.py needs a CUDA GPU (the fused kernels are Hopper TMA kernels)")
    device = torch.device("cuda")
    slug = device_slug(device)
    out = Path(args.out) / f"expert-mlp-{slug}.jsonl"
    timer = Timer(device, args.reps, warmup=3)
    records = []
    print(f"{'tokens':>7} {'routing':>9} {'path':>8} {'fwd ms':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}  max rel err")
    for T in args.tokens:
        for routing in args.routing:
            gen = torch.Generator().manual_seed(0)
            topk_idx = route(T, E, TOP_K, routing, gen).to(device)
            x_T = torch.randn(T, D, generator=gen).to(device, torch.bfloat16)
            x, offsets, _ = permute(x_T, topk_idx, E)
            M = x.shape[0]
            w_up = (torch.randn(E, D, 2 * F, generator=gen) / D**0.5).to(device, torch.bfloat16)
            w_down = (torch.randn(E, F, D, generator=gen) / F**0.5).to(device, torch.bfloat16)
            rw = torch.rand(M, generator=gen).to(device)
            dy = torch.randn(M, D, generator=gen).to(device, torch.bfloat16)
            leaves = [t.detach().clone().requires_grad_() for t in (x, w_up, w_down, rw)]
            exact_leaves = [t.detach().double().requires_grad_() for t in (x, w_up, w_down, rw)]
            y64 = expert_mlp_reference(exact_leaves[0], exact_leaves[1], exact_leaves[2], offsets, exact_leaves[3])
            exact = [y64.detach(), *torch.autograd.grad(y64, exact_leaves, dy.double())]
            del y64, exact_leaves
            flop = 2 * M * D * 2 * F + 2 * M * F * D  # forward: up and down
            fns_fwd, fns_all, errors = {}, {}, {}
            for path in args.paths:
                fn = mlp_fn(path, offsets)
                y = fn(*leaves)
                got = [y.detach(), *torch.autograd.grad(y, leaves, dy)]
                errors[path] = max(((g.double() - e).norm() / e.norm().clamp_min(1e-30)).item()
                                   for g, e in zip(got, exact))
                del y, got
                fns_fwd[path] = lambda fn=fn: fn(*leaves)
                fns_all[path] = lambda fn=fn: torch.autograd.grad(fn(*leaves), leaves, dy)
            del exact
            with torch.no_grad():
                fwd = timer.interleaved({p: (lambda f=f: f()) for p, f in fns_fwd.items()})
            both = timer.interleaved(fns_all)
            for path in args.paths:
                rec = {"bench": "expert_mlp", "series": f"{path}@{T}-{routing}", "path": path, "tokens": T,
                       "routing": routing, "rows": M, "fwd_ms": fwd[path], "fwd_bwd_ms": both[path],
                       "tflops_fwd_bwd": 3 * flop / (both[path] / 1e3) / 1e12, "max_rel_err": errors[path]}
                records.append(rec)
                print(f"{T:>7} {routing:>9} {path:>8} {fwd[path]:>8.3f} {both[path]:>11.3f} "
                      f"{rec['tflops_fwd_bwd']:>8.1f}  {errors[path]:.2e}", flush=True)
    base = {(r["tokens"], r["routing"]): r for r in records if r["path"] == "unfused"}
    speedups = {f"{r['tokens']}-{r['routing']}": {"fwd": base[(r["tokens"], r["routing"])]["fwd_ms"] / r["fwd_ms"],
                                                  "fwd_bwd": base[(r["tokens"], r["routing"])]["fwd_bwd_ms"] / r["fwd_bwd_ms"]}
                for r in records if r["path"] == "fused" and (r["tokens"], r["routing"]) in base}
    summary = {"bench": "expert_mlp", "summary": True, "device": slug, "fused_over_unfused": speedups,
               "torch": torch.__version__}
    publish(out, records, summary, args.store, key="series")


if __name__ == "__main__":
    main()
