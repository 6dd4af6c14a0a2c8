#!/usr/bin/env python3
"""What the kernels' self-check (kernels/optimus_kernels/selfcheck.py) costs a run's start, on one GPU (not a test).

    python bench/selfcheck.py [--tokens 8192]
    python bench/selfcheck.py --ingest bench/results/selfcheck-nvidia-h200.jsonl   # into the store

Every case runs in a fresh process with an empty Triton cache (TRITON_CACHE_DIR), as a rank of a
new job on a new node would:

    check-<family>        optimus_kernels.selfcheck.check(family) for experts, adamw, cross_entropy
    experts-first         the first forward + backward of an MoE layer's expert compute at
                          mula-7b-a1b width (permute, grouped_mm up, swiglu, grouped_mm down,
                          unpermute; --tokens rows x top-8 of 64 experts, bf16): its compiles
                          and autotuning
    experts-first+check   the self-check of the experts, then the same first step: what the
                          check adds to a run's start is this case's total minus experts-first

Output: a table, bench/results/selfcheck-<device>.jsonl (one line per case and a summary) and,
where the results store imports, run ``bench-selfcheck-<device>``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

FAMILIES = ("experts", "adamw", "cross_entropy")


def _first_step(tokens: int) -> float:
    import torch

    import optimus_kernels

    D, F, E, k = 2048, 1024, 64, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    idx = torch.randint(0, E, (tokens, k), device="cuda", generator=g)
    w_topk = torch.rand(tokens, k, device="cuda", generator=g)
    w_up = (torch.randn(E, D, 2 * F, device="cuda", generator=g) / D ** 0.5).bfloat16().requires_grad_()
    w_down = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).bfloat16().requires_grad_()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    xs, offsets, sorted_idx = optimus_kernels.permute(x, idx, E)
    h = optimus_kernels.swiglu(optimus_kernels.grouped_mm(xs, w_up, offsets))
    y = optimus_kernels.unpermute(optimus_kernels.grouped_mm(h, w_down, offsets), sorted_idx, w_topk)
    y.float().square().sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_case(case: str, tokens: int) -> dict:
    """One case in this process (``--case``)."""
    from optimus_kernels import selfcheck

    out: dict = {"case": case}
    if case.startswith("check-"):
        t0 = time.perf_counter()
        why = selfcheck.check(case[len("check-"):], "cuda")
        out.update(seconds=time.perf_counter() - t0, passed=why is None, why=why)
    elif case in ("experts-first", "experts-first+check"):
        check_s = 0.0
        if case.endswith("+check"):
            t0 = time.perf_counter()
            why = selfcheck.check("experts", "cuda")
            check_s = time.perf_counter() - t0
            out.update(passed=why is None, why=why)
        step_s = _first_step(tokens)
        out.update(check_s=check_s, step_s=step_s, seconds=check_s + step_s, tokens=tokens)
    else:
        raise SystemExit(f"case {case!r}: unknown")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="rows of the first step (2 x 4096: micro-batch 2)")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--store", default=str(REPO / "results" / "store.zarr"))
    p.add_argument("--ingest", type=Path, help="put a results file into the store and stop")
    args = p.parse_args(argv)
    from bench.common import device_slug, ingest, publish

    if args.ingest:
        print(ingest(args.ingest, args.store, key="case"))
        return 0
    if args.case:
        print(json.dumps(run_case(args.case, args.tokens)))
        return 0
    import torch
    import triton

    records = []
    for case in [*(f"check-{f}" for f in FAMILIES), "experts-first", "experts-first+check"]:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            done = subprocess.run([sys.executable, __file__, "--case", case, "--tokens", str(args.tokens)],
                                  env=env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            records.append({"case": case, "error": done.stderr[-2000:]})
            print(f"{case}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        records.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'case':22s} {'seconds':>8s} {'check_s':>8s} {'step_s':>8s} passed")
    for r in records:
        if "error" in r:
            print(f"{r['case']:22s} error")
            continue
        print(f"{r['case']:22s} {r['seconds']:8.2f} {r.get('check_s', float('nan')):8.2f} "
              f"{r.get('step_s', float('nan')):8.2f} {r.get('passed', '-')}")
    by = {r["case"]: r for r in records if "error" not in r}
    summary = {"bench": "selfcheck_summary", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "triton": triton.__version__, "tokens": args.tokens}
    if "experts-first" in by and "experts-first+check" in by:
        summary["check_adds_s"] = by["experts-first+check"]["seconds"] - by["experts-first"]["seconds"]
        print(f"the experts' self-check adds {summary['check_adds_s']:.2f} s to a cold start")
    publish(Path(args.out) / f"selfcheck-{device_slug('cuda')}.jsonl", records, summary, args.store, key="case")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
