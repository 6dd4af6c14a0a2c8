#!/usr/bin/env python3
"""Two ways to execute one run, same seeds and data: do their loss curves agree within the
spread the seed alone gives? For execution choices that change the numbers by rounding (the
bf16 residual stream). Not a test.

    python bench/loss_parity.py --data results/data/tokens                 # A: as is, B: float32 residual
    python bench/loss_parity.py --data results/data/tokens --preset mula-7b-a1b@laptop --steps 240 \\
        --seeds 0 1 2 --dtype bfloat16 --b execution.fp32_residual=true [--a KEY=VALUE ...] [--set KEY=VALUE]
    python bench/loss_parity.py --ingest bench/results/loss-parity-cpu.jsonl          # into the store

Each (side, seed) is one training run of the trainer core (optimus_core.train.loop.Trainer) on this
machine's device, its run directory a temporary folder, its metrics kept in memory: the preset's
run config with ``train.steps``, ``train.seed`` (which also seeds the data order), the
overrides of ``--set`` (both sides) and the side's own. Reported per side and seed: the mean training loss over the last
``--window`` steps and the final held-out loss; then, over the seeds, the mean of B - A and the
standard deviation of A's and of B's final-window losses. The verdict, ``within_seed_spread``: |mean
of B - A| is at most A's standard deviation over the seeds (a difference the seed alone makes).

Output: a table, bench/results/loss-parity-<device>.jsonl (one line per run with its whole loss
curve, and a summary line, written atomically) and, where the results store imports, run
``bench-loss-parity-<device>``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

import torch  # noqa: E402

from bench.common import device_slug, ingest, publish  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="a tokenized data directory (optimus tokenize)")
    p.add_argument("--preset", default="mula-7b-a1b@laptop")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="execution.dtype")
    p.add_argument("--a", nargs="*", default=[], metavar="KEY=VALUE", help="side A's overrides (default: none)")
    p.add_argument("--b", nargs="*", default=["execution.fp32_residual=true"], metavar="KEY=VALUE",
                   help="side B's overrides")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="both sides' overrides")
    p.add_argument("--window", type=int, default=40, help="final steps whose mean training loss is compared")
    p.add_argument("--threads", type=int, default=None, help="torch threads on a CPU (default: torch's)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder of the JSON lines file")
    p.add_argument("--store", default=str(ROOT / "results" / "store.zarr"), help="'' for none")
    p.add_argument("--ingest", metavar="JSONL", help="only write an earlier run's JSON lines to --store")
    args = p.parse_args(argv)
    if not args.ingest and not args.data:
        p.error("--data is needed (or --ingest)")
    if args.window < 1 or args.window > args.steps:
        p.error(f"--window {args.window}: must be 1 to --steps ({args.steps})")
    if len(set(args.seeds)) < 2:
        p.error("--seeds: at least two distinct seeds (the spread is the yardstick)")
    return args


class _Rows:
    """The loop's metrics sink (optimus_core.train.loop.MetricsSink), kept in memory."""

    def __init__(self):
        self.rows: dict[str, list[dict]] = {}

    def log(self, table, row, dims=None):
        self.rows.setdefault(table, []).append(dict(row))

    def update_attrs(self, **attrs):
        pass

    def flush(self):
        pass


def train_once(preset: str, data: str, steps: int, seed: int, dtype: str, overrides: dict) -> dict:
    """One run: its training losses per step, its final held-out loss and its wall time."""
    from optimus_core import presets
    from optimus_core.train.loop import Trainer

    cfg = presets.get(preset).run_config(**{"train.steps": steps, "train.seed": seed, "train.checkpoint_every": 0,
                                            "execution.dtype": dtype, **overrides})
    sink = _Rows()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="loss-parity-") as run_dir:
        summary = Trainer(cfg, data, run_dir, writer=sink, progress=False).fit()
    train = sorted(sink.rows.get("train", []), key=lambda r: r["step"])
    return {"loss": [float(r["loss"]) for r in train], "final_eval_loss": summary.final_eval.get("loss"),
            "wall_s": time.perf_counter() - start}


def compare(runs: list[dict], window: int) -> dict:
    """The verdict over the seeds (module doc) from records with side, seed and loss."""
    tail = {(r["side"], r["seed"]): statistics.fmean(r["loss"][-window:]) for r in runs}
    seeds = sorted({s for _, s in tail})
    a, b = [tail["A", s] for s in seeds], [tail["B", s] for s in seeds]
    diff = [y - x for x, y in zip(a, b)]
    spread_a = statistics.stdev(a)
    return {"window_loss_a": a, "window_loss_b": b, "mean_b_minus_a": statistics.fmean(diff),
            "max_abs_b_minus_a": max(abs(d) for d in diff), "seed_std_a": spread_a, "seed_std_b": statistics.stdev(b),
            "within_seed_spread": abs(statistics.fmean(diff)) <= spread_a}


def main(argv=None) -> None:
    args = parse_args(argv)
    slug = device_slug("auto")
    path = Path(args.out) / f"loss-parity-{slug}.jsonl"
    if args.ingest:
        print(ingest(args.ingest, args.store, key="name"))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    from workflow.commands import parse_overrides

    both = parse_overrides(args.set)
    sides = {"A": {**both, **parse_overrides(args.a)}, "B": {**both, **parse_overrides(args.b)}}
    runs = []
    print(f"{'side':>4} {'seed':>4} {'final-window loss':>18} {'held-out loss':>14} {'wall s':>7}  overrides")
    for seed in args.seeds:  # seeds outermost: a cut-short sweep still has both sides of each seed
        for side, overrides in sides.items():
            got = train_once(args.preset, args.data, args.steps, seed, args.dtype, overrides)
            record = {"bench": "loss_parity", "name": f"{side}-seed{seed}", "side": side, "seed": seed,
                      "overrides": overrides, "preset": args.preset, "dtype": args.dtype, "steps": args.steps,
                      "window_loss": statistics.fmean(got["loss"][-args.window:]), **got}
            runs.append(record)
            held_out = "-" if got["final_eval_loss"] is None else f"{got['final_eval_loss']:.4f}"
            print(f"{side:>4} {seed:>4} {record['window_loss']:18.4f} {held_out:>14} {got['wall_s']:7.1f}  "
                  f"{overrides or '(none)'}", flush=True)
    summary = {"bench": "loss_parity_summary", "device": slug, "preset": args.preset, "dtype": args.dtype,
               "steps": args.steps, "seeds": args.seeds, "window": args.window, "a": sides["A"], "b": sides["B"],
               "torch": torch.__version__, **compare(runs, args.window)}
    publish(path, runs, summary, args.store, key="name")


if __name__ == "__main__":
    main()
