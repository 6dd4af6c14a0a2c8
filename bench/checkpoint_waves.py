#!/usr/bin/env python3
"""How many ranks write a checkpoint at once, by train.checkpoint_write_waves (not a test).

    python bench/checkpoint_waves.py [--ranks 4] [--waves 1 2 4] [--store results/store.zarr]

For each wave count, ``--ranks`` local gloo ranks (one data-parallel replica each) train the
laptop mula-7b-a1b for two steps on synthetic tokens and write its final checkpoint; the peak
number of ranks writing at once is read back from the manifests' write windows
(optimus_core.train.checkpoint.concurrent_writers), beside the span from the first write's start
to the last one's end. Output: a table, bench/results/checkpoint-waves-<device>.jsonl (a record
per wave count, then the summary) and the store (``--store``).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from bench.common import publish, write_synthetic_tokens  # noqa: E402


def _rank(cfg_json: str, data_dir: str, run_dir: str) -> None:
    import torch

    from optimus_core.config import RunConfig
    from optimus_core.parallel import init_distributed, shutdown
    from optimus_core.train.loop import Trainer

    torch.set_num_threads(1)
    cfg = RunConfig.from_json(cfg_json)
    mesh = init_distributed(cfg.parallel, cfg.model.moe.n_experts, device="cpu")
    try:
        Trainer(cfg, data_dir, run_dir, progress=False, mesh=mesh).fit()
    finally:
        shutdown(mesh)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--waves", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--store", default="")
    args = p.parse_args(argv)
    from optimus_core import presets
    from optimus_core.parallel.launch import spawn_local
    from optimus_core.train import checkpoint as ckpt

    records = []
    with tempfile.TemporaryDirectory(prefix="checkpoint-waves-") as tmp:
        data = write_synthetic_tokens(Path(tmp) / "tokens", 200_000, 20_000)
        for waves in args.waves:
            cfg = presets.get("mula-7b-a1b@laptop").run_config(**{
                "train.steps": 2, "train.eval_batches": 1, "train.device": "cpu", "data.seq_len": 128,
                "train.global_batch": args.ranks, "train.checkpoint_write_waves": waves,
                "model.vocab_size": 50304})  # the synthetic tokens' vocabulary (bench.common)
            run = Path(tmp) / f"run-{waves}"
            spawn_local(_rank, args.ranks, (cfg.to_json(), str(data), str(run)), start_method="fork")
            [step] = ckpt.list_step_dirs(run)
            windows = [json.loads(m.read_text())["write_window"] for m in (step / ckpt.MANIFESTS).glob("*.json")]
            records.append({"bench": "checkpoint_waves", "waves": waves, "ranks": args.ranks,
                            "peak_writers": ckpt.concurrent_writers(step),
                            "span_s": max(e for _, e in windows) - min(s for s, _ in windows),
                            "mib": sum(f.stat().st_size for f in step.glob("*.distcp")) / 2**20})
    print(f"{'waves':>5} {'peak writers':>12} {'span s':>8} {'MiB':>6}")
    for r in records:
        print(f"{r['waves']:>5} {r['peak_writers']:>8} of {r['ranks']} {r['span_s']:>8.3f} {r['mib']:>6.1f}")
    summary = {"bench": "checkpoint_waves_summary", "ranks": args.ranks, "device": "cpu (gloo)",
               "peak_writers": {str(r["waves"]): r["peak_writers"] for r in records}}
    publish(ROOT / "bench" / "results" / "checkpoint-waves-cpu.jsonl", records, summary, args.store, key="waves")


if __name__ == "__main__":
    main()
