#!/usr/bin/env python3
"""Data + expert parallel training steps on the GPUs of one host (not a test).

    python bench/distributed.py [--suites ablation weak strong exchange] [--max-gpus 4] [--layers 8] [--quick]
    python bench/distributed.py --suites strong --layers 16  # the whole OLMoE-1B-7B, 1 -> 8 GPUs
    python bench/distributed.py --suites weak ablation --only 'weak|ep1-triton'   # a subset of the points
    python bench/distributed.py --suites weak --repeat 3     # every point 3 times, in turns
    python bench/distributed.py --suites weak --compile      # blocks under torch.compile (execution.compile)
    python bench/distributed.py --ingest bench/results/distributed-ablation-<device>.jsonl

Model: ``mula-7b-a1b`` full width, ``--layers`` of its 16 (default 8; OLMoE-1B-7B shapes), sequence 4096, bf16
autocast, float32 master weights and AdamW state, micro-batches of 2 sequences. Each point is
one fresh launch of n ranks (one GPU each, NCCL) timing the trainer core's step with its phases
(stages/scaling.py, optimus_core/train/measure.py): compute, expert all-to-all, gradient
reduce-scatter / all-gather (``grad_sync``), optimizer (grad norm + AdamW) and idle.

Suites:
    ablation  2 GPUs, 2 sequences per GPU: experts loop | triton x optimizer dp_sharded | ep_aware
              x EP 1 | 2. The paper's ablation: baseline = loop + dp_sharded (the paper's baseline
              optimizer: the dense state sharded over the data-parallel ranks, replicated over the
              EP group), both = triton + ep_aware; at EP 1 the two optimizers are one layout.
    weak      2 sequences per GPU on 1 and 2 GPUs (triton, ep_aware, EP = n):
              efficiency = T(1) / T(2).
    strong    a fixed 8 sequences per step on 1, 2, 4 ... --max-gpus GPUs (triton, ep_aware,
              EP = n and EP = 1): efficiency = T(1) / (n T(n)).
    exchange  the expert exchange (execution.expert_exchange): the all-to-all against the paper's
              all-gather / reduce-scatter at EP = 2 and, where the host has 8, EP = 8: 2 sequences
              per GPU (triton, ep_aware); the summary's ``exchange_all_gather_over_all_to_all_ep<n>``
              is the ratio of their tokens/s (above 1: the paper's exchange is faster there).

Every point of several ranks trains fully sharded (optimus_core.parallel.sharding): each layer
gathered before its forward and backward, its gradients reduced under the backward. (A point of
several ranks whose record has no ``sharding`` ran a ZeRO-1 optimizer instead; ``-nooverlap``
labels A/Bs of its chunked reduction.)

``--repeat N`` measures the whole plan N times in turns (pass 1 of every point, then pass 2 ...):
2-GPU points move by about 4 % between launches, as much as the gaps being judged, so ratios are
taken within a pass (weak-1 and weak-2 launched one after the other) and the median of the
passes is reported, with every pass's value beside it.

Summary line: ``optimizer_speedup`` = (grad_sync + optimizer) of the paper's baseline optimizer
(dp_sharded) over the EP-aware one at EP=2 (at EP=1 the two are one layout), ``ablation_speedup``
per EP (both over baseline, tokens per s), ``weak_efficiency`` (synced steps) and
``weak_efficiency_back_to_back`` (steps queued back to back, as a run trains: what the one-GPU
update beside the forward gains shows only there), ``strong_efficiency``. Output: a table, bench/results/
distributed-<suites>-<device>.jsonl, and (where the store imports) run
``bench-distributed-<suites>-<device>``.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from bench.common import device_slug, ingest, publish, write_jsonl  # noqa: E402

MODEL = {"model.n_layers": 8, "data.seq_len": 4096, "execution.dtype": "bfloat16"}
QUICK = {"data.seq_len": 64, "model.n_layers": 2}  # preset @laptop, CPU: a smoke check only


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suites", nargs="+", default=["ablation", "weak", "strong"],
                   choices=["ablation", "weak", "strong", "exchange"])
    p.add_argument("--layers", type=int, default=MODEL["model.n_layers"], help="of mula-7b-a1b's 16")
    p.add_argument("--max-gpus", type=int, default=0, help="largest device count of the strong suite (0: all)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=1, help="passes over every point, in turns (module doc)")
    p.add_argument("--compile", action="store_true",
                   help="every point with its blocks compiled (execution.compile; one GPU's fastest setting)")
    p.add_argument("--only", default=None, help="a regular expression: measure only the points whose label it matches")
    p.add_argument("--quick", action="store_true", help="the laptop preset on CPU ranks (gloo): a smoke check")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--store", default=str(ROOT / "results" / "store.zarr"))
    p.add_argument("--trace", default=None,
                   help="every rank of every point also writes a two-step timeline here (bench/trace_gaps.py)")
    p.add_argument("--ingest", default=None, help="write an existing JSONL file to the store and exit")
    return p.parse_args(argv)


def plan(args, n_gpus: int) -> list[dict]:
    """Every point as (label, suite, devices, per-point ScalingConfig fields)."""
    mb = args.micro_batch
    points = []
    if "ablation" in args.suites and n_gpus >= 2:
        for ep in (1, 2):
            for backend in ("loop", "triton"):
                for optimizer in ("dp_sharded", "ep_aware"):
                    points.append(dict(label=f"ablation-ep{ep}-{backend}-{optimizer}", suite="ablation", devices=2,
                                       ep=ep, backend=backend, optimizer=optimizer, global_batch=2 * mb))
    if "weak" in args.suites:
        for n in (1, 2) if n_gpus >= 2 else (1,):
            points.append(dict(label=f"weak-{n}", suite="weak", devices=n, ep=n, backend="triton",
                               optimizer="ep_aware", global_batch=n * mb))
    if "strong" in args.suites:
        top = min(args.max_gpus or n_gpus, n_gpus)
        counts = [n for n in (1, 2, 4, 8) if n <= top]
        for ep_rule in ("all", 1):
            for n in counts:
                if ep_rule == 1 and n == 1:
                    continue  # the same point as ep "all" at one rank
                points.append(dict(label=f"strong-ep{ep_rule}-{n}", suite="strong", devices=n,
                                   ep=n if ep_rule == "all" else 1, ep_rule=str(ep_rule), backend="triton",
                                   optimizer="ep_aware", global_batch=4 * mb))
    if "exchange" in args.suites:
        for n in sorted({2, 8} & set(range(2, n_gpus + 1))):
            for exchange in ("all_to_all", "all_gather"):
                points.append(dict(label=f"exchange-ep{n}-{exchange}", suite="exchange", devices=n, ep=n,
                                   backend="triton", optimizer="ep_aware", global_batch=n * mb,
                                   overrides={"execution.expert_exchange": exchange}))
    if args.only:
        points = [p for p in points if re.search(args.only, p["label"])]
    return points


def measure(p: dict, args, device_type: str) -> dict:
    from stages.scaling import ScalingConfig, measure_point

    overrides = {**MODEL, "model.n_layers": args.layers, "execution.experts": p["backend"],
                 "execution.compile": args.compile, **p.get("overrides", {})}
    preset = "mula-7b-a1b"
    if args.quick:
        preset += "@laptop"
        overrides = {**QUICK, "execution.experts": "loop",  # the CPU has no fast grouped GEMM
                     "execution.compile": args.compile, **p.get("overrides", {})}
    config = ScalingConfig(preset=preset, devices=(p["devices"],), ep=p["ep"], optimizer=p["optimizer"],
                           global_batch=p["global_batch"], micro_batch=min(args.micro_batch, p["global_batch"]),
                           steps=args.steps, warmup=args.warmup, device=device_type, overrides=overrides)
    return {**p, **measure_point(config, p["devices"])}


def _median_by_label(records: list[dict]) -> dict[str, dict]:
    """One record per label: each number the median over its passes (the first pass's other fields)."""
    by_label: dict[str, list[dict]] = {}
    for r in records:
        if "error" not in r:
            by_label.setdefault(r["label"], []).append(r)
    out = {}
    for label, rs in by_label.items():
        merged = dict(rs[0])
        for key, value in rs[0].items():
            if isinstance(value, float) and all(isinstance(r.get(key), float) for r in rs):
                merged[key] = statistics.median(r[key] for r in rs)
        out[label] = merged
    return out


def _paired(records: list[dict], a: str, b: str, key: str) -> list[float]:
    """a's ``key`` over b's, per pass where both were measured."""
    by_pass: dict[int, dict[str, dict]] = {}
    for r in records:
        if "error" not in r and key in r:
            by_pass.setdefault(r.get("pass", 0), {})[r["label"]] = r
    return [pts[a][key] / pts[b][key] for _, pts in sorted(by_pass.items()) if a in pts and b in pts]


def summarize(records: list[dict], device: str) -> dict:
    ok = _median_by_label(records)

    def after_backward(r):
        return r["grad_sync_s"] + r["optimizer_s"]

    out = {"bench": "distributed_summary", "device": device}
    for ep in (1, 2):
        base, both = ok.get(f"ablation-ep{ep}-loop-dp_sharded"), ok.get(f"ablation-ep{ep}-triton-ep_aware")
        kern = ok.get(f"ablation-ep{ep}-triton-dp_sharded")
        aware = ok.get(f"ablation-ep{ep}-loop-ep_aware")
        if base and both:
            out[f"ablation_speedup_ep{ep}"] = both["tokens_per_s"] / base["tokens_per_s"]
        if base and kern:
            out[f"kernels_speedup_ep{ep}"] = kern["tokens_per_s"] / base["tokens_per_s"]
        if base and aware:
            out[f"optimizer_only_speedup_ep{ep}"] = aware["tokens_per_s"] / base["tokens_per_s"]
        for backend in ("triton", "loop"):
            u, a = ok.get(f"ablation-ep{ep}-{backend}-dp_sharded"), ok.get(f"ablation-ep{ep}-{backend}-ep_aware")
            if u and a:
                out[f"optimizer_speedup_ep{ep}_{backend}"] = after_backward(u) / after_backward(a)
                out[f"optimizer_update_speedup_ep{ep}_{backend}"] = u["optimizer_s"] / a["optimizer_s"]
    out["optimizer_speedup"] = out.get("optimizer_speedup_ep2_triton")
    out["ablation_speedup"] = out.get("ablation_speedup_ep2")
    for key, name in (("step_s", ""), ("step_back_to_back_s", "_back_to_back")):
        ratios = _paired(records, "weak-1", "weak-2", key)  # T(1) / T(2), within each pass
        if ratios:
            out[f"weak_efficiency{name}"] = statistics.median(ratios)
            if len(ratios) > 1:
                out[f"weak_efficiency{name}_passes"] = ratios
    strong = {}
    for rule in ("all", "1"):
        pts = sorted([r for r in records if r.get("suite") == "strong" and "error" not in r
                      and (r.get("ep_rule") == rule or r["devices"] == 1)], key=lambda r: r["devices"])
        if pts and pts[0]["devices"] == 1:
            strong[f"ep_{rule}"] = {str(r["devices"]): pts[0]["step_s"] / (r["devices"] * r["step_s"]) for r in pts}
    out["strong_efficiency"] = strong
    for n in (2, 8):
        a2a, gather = ok.get(f"exchange-ep{n}-all_to_all"), ok.get(f"exchange-ep{n}-all_gather")
        if a2a and gather:
            out[f"exchange_all_gather_over_all_to_all_ep{n}"] = gather["tokens_per_s"] / a2a["tokens_per_s"]
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.ingest:
        print(ingest(args.ingest, args.store, key="label"))
        return
    import torch

    if args.quick:
        device_type, n_gpus = "cpu", 2
    elif torch.cuda.is_available() and torch.cuda.device_count() >= 1:
        device_type, n_gpus = "cuda", torch.cuda.device_count()
    else:
        sys.exit("bench/distributed.py needs CUDA GPUs; `--quick` runs a CPU smoke check of the script")
    name = device_slug(device_type)
    suites = "-".join(sorted(args.suites)) + ("-compile" if args.compile else "")
    path = Path(args.out) / f"distributed-{suites}-{name}.jsonl"  # one file per suite set
    records = []
    cols = ("step_s", "compute_s", "a2a_s", "grad_sync_s", "optimizer_s", "idle_s")
    print(f"{'point':>34} {'tokens/s':>9} " + " ".join(f"{c[:-2]:>9}" for c in cols) + " (ms)")
    if args.repeat < 1:
        sys.exit(f"--repeat {args.repeat}: must be >= 1")
    points = plan(args, n_gpus)
    for i, p in enumerate(points * args.repeat):
        p = {**p, "pass": i // len(points)}
        if args.trace:  # read by optimus_core/train/measure.py in the launched ranks: a folder per point
            os.environ["OPTIMUS_TRACE_DIR"] = str(Path(args.trace).resolve() / p["label"])
        try:
            r = measure(p, args, device_type)
        except Exception as e:  # keep the other points: an OOM or a crash is recorded, not fatal
            traceback.print_exc()
            r = {**p, "error": f"{type(e).__name__}: {e}"[:500]}
            print(f"{p['label']:>34} failed", flush=True)
        else:
            print(f"{p['label']:>34} {r['tokens_per_s']:>9,.0f} " + " ".join(f"{r[c] * 1e3:>9.1f}" for c in cols),
                  flush=True)
        records.append(r)
        write_jsonl(path, records)  # nothing measured is lost if the call is cut short
    publish(path, records, summarize(records, name), args.store, key="label")


if __name__ == "__main__":
    main()
