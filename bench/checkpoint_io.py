#!/usr/bin/env python3
"""Checkpoint save, load and the async save's cost to training, on one GPU (not a test).

    python bench/checkpoint_io.py [--layers 8] [--batch 2] [--dir /dev/shm] [--steps-during 6]

A Trainer of mula-7b-a1b (``--layers`` of its 16 layers; sequence 4096, synthetic tokens) takes a
few steps, so that AdamW's moments exist, then:

    sync save    ``Trainer.save()`` in the foreground: the write and this rank's manifest hash
    validate     ``latest_valid``'s checksums of what the resume reads (shared files + manifest)
    load         the weights, moments and RNG read back in place (``Trainer._load``)
    async save   train.async_checkpoint: ``save()`` returns after the host copy (the blocking
                 part); steps run while a thread writes and hashes; ``publish_checkpoint()``
                 waits for what is left. Peak host RSS and device memory during it.

Steps are timed with a device sync each (the median of --steps-during before the saves is the
baseline). Output: a table and bench/results/checkpoint-io-<device>.jsonl. The checkpoint
holds the fp32 weights and both moments (12 bytes a parameter): ``--dir`` needs that much
room, and the host as much again for the async copy.
"""
from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cli_vs_bench import SEQ, write_synthetic_tokens  # noqa: E402
from bench.common import device_slug, write_jsonl  # noqa: E402


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


def _overrides(pairs: list[str]) -> dict:
    from optimus_core.config import parse_value

    return {k: parse_value(v) for k, v in (pair.split("=", 1) for pair in pairs)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help="of mula-7b-a1b's 16")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--steps-during", type=int, default=6, help="steps timed before, and while, the async save")
    p.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                   help="where the run directory goes (default: a tmpfs where there is one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (a small model to try the benchmark on a CPU)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)

    import torch

    from optimus_core import presets
    from optimus_core.train import checkpoint as ckpt
    from optimus_core.train.loop import Trainer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    steps_total = 3 + 2 * args.steps_during + 100  # never the run's last step: saves stay in the background
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-io-") as tmp:
        data = write_synthetic_tokens(Path(tmp) / "data", (steps_total + 2) * args.batch * (SEQ + 1),
                                      2 * args.batch * (SEQ + 1))
        cfg = presets.get("mula-7b-a1b").run_config(**{
            "model.n_layers": args.layers, "train.global_batch": args.batch, "data.seq_len": SEQ,
            "train.steps": steps_total, "train.eval_batches": 1, "train.keep_checkpoints": 1,
            "train.async_checkpoint": False, **_overrides(args.set)})
        trainer = Trainer(cfg, data, Path(tmp) / "run", progress=False)
        params = sum(p.numel() for p in trainer.model.parameters())
        from tqdm import tqdm
        bar = tqdm(disable=True)

        def step_s() -> float:
            sync()
            t0 = time.perf_counter()
            trainer._one_step(trainer.guard, [], bar)
            sync()
            return time.perf_counter() - t0

        for _ in range(3):  # compile, autotune, AdamW's state made
            step_s()
        baseline = [step_s() for _ in range(args.steps_during)]

        t0 = time.perf_counter()
        path = trainer.save()
        save_s = time.perf_counter() - t0
        nbytes = _size(path)
        t0 = time.perf_counter()
        found = trainer._latest_valid()
        validate_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer._load(found)
        sync()
        load_s = time.perf_counter() - t0
        shutil.rmtree(path)  # room for the next one

        trainer.cfg = cfg.replace(train=cfg.train.replace(async_checkpoint=True))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        saved_step = trainer.step
        t0 = time.perf_counter()
        trainer.save()
        blocked_s = time.perf_counter() - t0
        during = [step_s() for _ in range(args.steps_during)]
        t1 = time.perf_counter()
        published = trainer.publish_checkpoint()
        wait_s = time.perf_counter() - t1
        async_total_s = time.perf_counter() - t0
        device_peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        assert published is not None and ckpt.validate(published)["step"] == saved_step

    base = statistics.median(baseline)
    record = {"bench": "checkpoint_io", "device": device_slug(device), "torch": torch.__version__,
              "layers": args.layers, "params": params, "checkpoint_bytes": nbytes, "dir": "tmpfs" if
              args.dir == "/dev/shm" else "disk", "save_s": save_s, "save_gb_per_s": nbytes / save_s / 1e9,
              "validate_s": validate_s, "load_s": load_s, "load_gb_per_s": nbytes / load_s / 1e9,
              "async_blocked_s": blocked_s, "async_wait_at_publish_s": wait_s, "async_total_s": async_total_s,
              "step_s_median": base, "step_s_during_async_median": statistics.median(during),
              "step_s_during_async": during, "device_peak_gib_during_async": device_peak,
              "host_peak_rss_gib": _host_peak_gib()}
    out = Path(args.out) / f"checkpoint-io-{device_slug(device)}.jsonl"
    write_jsonl(out, [record])
    print(f"| {args.layers} layers, {params / 1e9:.2f}B params, {nbytes / 1e9:.1f} GB | seconds |\n|---|---|")
    for name in ("save_s", "validate_s", "load_s", "async_blocked_s", "async_wait_at_publish_s", "async_total_s",
                 "step_s_median", "step_s_during_async_median"):
        print(f"| {name} | {record[name]:.2f} |")
    print(f"device peak during the async save {device_peak:.1f} GiB, host peak RSS {record['host_peak_rss_gib']:.1f} GiB")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
