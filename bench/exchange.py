#!/usr/bin/env python3
"""The two expert exchanges on one rank of the paper's EP-12 layouts, and that rank's peak memory
beside the memory model (not a test).

    python bench/exchange.py [--experiments pretrain-mula-20b-a2b ...] [--steps 5] [--warmup 3] [--device cuda]

For each registry run (default: the three scale-up runs, 3072 tiles, EP 12 on one node of 12
tiles) and each exchange (execution.expert_exchange: the all-to-all, the paper's all-gather /
reduce-scatter), rank 0 is rehearsed (optimus_core.rehearsal: its real share of the real model,
real steps of its micro-batches, torch's fake process group standing in for the other ranks with
loopback collectives, so nothing crosses a link). Its step time is then the rank's own work: the
exchange's local part (the index work, the rows gathered or sent, the partial sums) and
everything else, without the collectives' transfers, which the performance model prices from
the machine file (workflow/perfmodel). Warm-up steps (compilation, autotuning) run untimed and
outside the peak; the median of the timed steps is reported, with their peak allocated memory
and the memory model's estimate of it. A timed step can still autotune: the grouped GEMMs tune
once per power-of-two bucket of their rows, and a rank's rows (about top_k x its tokens, 16384
at one sequence of 2048) sit on a bucket's edge, so a step that crosses it for the first time
tunes then (seconds, and the tuner's buffers in the peak); every step's time is recorded (optimus_core.memory: the all-gather's gathered tokens and partial sums, ep x
the rank's tokens x width, each way).

Output: a table, and bench/results/exchange-<device>.jsonl (one record per run and exchange,
then a summary line: each run's all-gather step time over the all-to-all's).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from bench.common import device_slug, write_jsonl  # noqa: E402

EXCHANGES = ("all_to_all", "all_gather")
SCALE_UP = ("pretrain-mula-20b-a2b", "pretrain-mula-100b-a7b", "pretrain-mula-220b-a10b")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experiments", nargs="+", default=list(SCALE_UP))
    p.add_argument("--steps", type=int, default=5, help="timed steps per rehearsal")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, outside the peak")
    p.add_argument("--micro-batches", type=int, default=2, help="at most this many of the rank's micro-batches a step")
    p.add_argument("--device", default="cuda")
    p.add_argument("--site", default="aurora", help="whose memory budget resolves the recomputation")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")

    import torch

    from optimus_core.config import apply_overrides
    from optimus_core.rehearsal import rehearse
    from workflow.commands import rehearsal_jobs
    from workflow.sites import load_site

    jobs = rehearsal_jobs(args.experiments, [], load_site(args.site, account="x"))
    device = torch.device(args.device)
    records = []
    print(f"{'run':28s} {'tiles':>5s} {'ep':>3s} {'exchange':>10s} {'step s':>8s} {'peak GiB':>8s} {'model GiB':>9s}")
    for job in jobs:
        for exchange in EXCHANGES:
            cfg = apply_overrides(job.run, {"execution.expert_exchange": exchange})
            r = rehearse(cfg, job.world, steps=args.steps, device=args.device, micro_batches=args.micro_batches,
                         checkpointing=job.checkpointing, warmup=args.warmup)
            step_s = statistics.median(r["step_s"])
            records.append({"bench": "exchange", "name": job.name, "exchange": exchange, "world": job.world,
                            "ep": r["ep"], "device": device_slug(device), "step_s": step_s,
                            "steps_s": r["step_s"], "peak_allocated_gib": r["peak_allocated_gib"],
                            "model_gib": r["model_gib"], "model_error": r["model_error"],
                            "checkpointing": r["checkpointing"], "micro_batch": r["micro_batch"],
                            "accumulation": r["accumulation"], "torch": torch.__version__,
                            "device_name": r.get("device_name", "")})
            print(f"{job.name:28s} {job.world:5d} {r['ep']:3d} {exchange:>10s} {step_s:8.3f} "
                  f"{r['peak_allocated_gib']:8.2f} {r['model_gib']:9.2f}", flush=True)
    by = {(r["name"], r["exchange"]): r for r in records}
    summary = {"bench": "exchange_summary", "device": device_slug(device),
               "all_gather_over_all_to_all_step": {job.name: by[job.name, "all_gather"]["step_s"]
                                                   / by[job.name, "all_to_all"]["step_s"] for job in jobs}}
    print(summary)
    path = Path(args.out) / f"exchange-{device_slug(device)}.jsonl"
    write_jsonl(path, records + [summary])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
