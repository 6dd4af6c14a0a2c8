#!/usr/bin/env python3
"""Checkpoint save, load and the async save's cost to training, on one GPU (not a test).

    python bench/checkpoint_io.py [--layers 8] [--batch 2] [--dir /dev/shm] [--threads 1 4 8]

A Trainer of mula-7b-a1b (``--layers`` of its 16 layers; sequence 4096, synthetic tokens) takes a
few steps, so that AdamW's moments exist, then:

    first save   ``Trainer.save()`` in the foreground: pins this rank's host buffers
                 (optimus_core/train/staging.py), copies, writes, hashes its manifest
    validate     ``latest_valid``'s checksums of what the resume reads (shared files + manifest)
    load         the weights, moments and RNG read back in place (``Trainer._load``)
    load, N      the same with N reader threads (``--threads``: files read at once,
                 optimus_core/train/checkpoint_reader.py)
    stage        the device-to-host copy alone, into the pinned buffers
    save, N      later saves with N DCP writer threads (``--threads``; each N files a rank)
    async save   train.async_checkpoint: ``save()`` returns after the host copy (the blocking
                 part); steps run while a thread writes and hashes; ``publish_checkpoint()``
                 waits for what is left. Peak device memory during it.

Steps are timed with a device sync each (the median of --steps-during before the saves is the
baseline); the host's peak RSS is read after each phase. Output: a table,
bench/results/checkpoint-io-<device>.jsonl (a record a phase, then the summary) and the store
(``--store``; ``--ingest FILE`` puts a committed file there later). The checkpoint holds the fp32 weights and both
moments (12 bytes a parameter): ``--dir`` needs that much room, and the host as much again for
the pinned copy (a tmpfs ``--dir`` is host memory too: 8 layers take about 86 GB of the two).
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
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from bench.common import SYNTHETIC_SEQ as SEQ, write_synthetic_tokens  # noqa: E402
from bench.common import device_slug, ingest, publish  # noqa: E402

# The summary's timings, one store record each (key "phase"); the saves by thread count beside them.
PHASES = {"first save": "save_first_s", "stage": "stage_s", "save": "save_s", "validate": "validate_s",
          "load": "load_s", "async save blocked": "async_blocked_s", "async save wait": "async_wait_at_publish_s",
          "async save total": "async_total_s", "step": "step_s_median", "step during async save": "step_s_during_async_median"}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help="of mula-7b-a1b's 16")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--steps-during", type=int, default=6, help="steps timed before, and while, the async save")
    p.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                   help="where the run directory goes (default: a tmpfs where there is one)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8],
                   help="writer threads to time a save with, and reader threads a load")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (a small model to try the benchmark on a CPU)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--store", default=str(ROOT / "results" / "store.zarr"))
    p.add_argument("--ingest", default=None, help="write an existing results file to the store and exit")
    args = p.parse_args(argv)
    if args.ingest:
        print(ingest(args.ingest, args.store, key="phase"))
        return

    import torch

    from optimus_core import presets
    from optimus_core.train import checkpoint as ckpt
    from optimus_core.train import checkpoint_reader
    from optimus_core.train.loop import Trainer
    from workflow.commands import parse_overrides

    default_threads = ckpt.WRITE_THREADS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    steps_total = 3 + 2 * args.steps_during + 100  # never the run's last step: saves stay in the background
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-io-") as tmp:
        data = write_synthetic_tokens(Path(tmp) / "data", (steps_total + 2) * args.batch * (SEQ + 1),
                                      2 * args.batch * (SEQ + 1))
        cfg = presets.get("mula-7b-a1b").run_config(**{
            "model.n_layers": args.layers, "train.global_batch": args.batch, "data.seq_len": SEQ,
            "train.steps": steps_total, "train.eval_batches": 1, "train.keep_checkpoints": 1,
            "train.async_checkpoint": False, **parse_overrides(args.set)})
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

        phases_rss = {}
        t0 = time.perf_counter()
        path = trainer.save()  # the first save pins this rank's host buffers (train/staging.py)
        save_first_s = time.perf_counter() - t0
        phases_rss["first save"] = _host_peak_gib()
        nbytes = _size(path)
        t0 = time.perf_counter()
        found = trainer._latest_valid()
        validate_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer._load(found)
        sync()
        load_s = time.perf_counter() - t0
        phases_rss["load"] = _host_peak_gib()
        load_s_by_threads, default_read = {}, checkpoint_reader.READ_THREADS
        for threads in args.threads:
            checkpoint_reader.READ_THREADS = threads
            t0 = time.perf_counter()
            trainer._load(found)
            sync()
            load_s_by_threads[threads] = time.perf_counter() - t0
        checkpoint_reader.READ_THREADS = default_read
        shutil.rmtree(path)  # room for the next one

        t0 = time.perf_counter()  # the copy alone, into the buffers the first save pinned
        trainer._staging.stage(ckpt.training_tensors(trainer.model, trainer.optimizer, trainer.mesh), snapshot=True)
        stage_s = time.perf_counter() - t0
        save_s_by_threads = {}
        for threads in args.threads:
            ckpt.WRITE_THREADS = threads
            step_s()  # a new step, so a new step directory
            t0 = time.perf_counter()
            path = trainer.save()
            save_s_by_threads[threads] = time.perf_counter() - t0
            shutil.rmtree(path)
        ckpt.WRITE_THREADS = default_threads
        phases_rss["saves"] = _host_peak_gib()

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
        phases_rss["async save"] = _host_peak_gib()
        assert published is not None and ckpt.validate(published)["step"] == saved_step

    base = statistics.median(baseline)
    summary = {"bench": "checkpoint_io_summary", "device": device_slug(device), "torch": torch.__version__,
               "layers": args.layers, "params": params, "checkpoint_bytes": nbytes, "dir": "tmpfs" if
               args.dir == "/dev/shm" else "disk", "write_threads": default_threads,
               "save_first_s": save_first_s, "save_s_by_threads": save_s_by_threads,
               "save_gb_per_s": nbytes / save_s_by_threads.get(default_threads, save_first_s) / 1e9,
               "stage_s": stage_s, "stage_gb_per_s": nbytes / stage_s / 1e9, "pinned_gib": trainer._staging.nbytes / 2**30,
               "validate_s": validate_s, "load_s": load_s, "load_gb_per_s": nbytes / load_s / 1e9,
               "read_threads": checkpoint_reader.READ_THREADS, "load_s_by_threads": load_s_by_threads,
               "async_blocked_s": blocked_s, "async_wait_at_publish_s": wait_s, "async_total_s": async_total_s,
               "step_s_median": base, "step_s_during_async_median": statistics.median(during),
               "step_s_during_async": during, "device_peak_gib_during_async": device_peak,
               "host_peak_rss_gib_after": phases_rss}
    out = Path(args.out) / f"checkpoint-io-{device_slug(device)}.jsonl"
    publish(out, phase_records(summary), summary, args.store, key="phase")
    print(f"| {args.layers} layers, {params / 1e9:.2f}B params, {nbytes / 1e9:.1f} GB | seconds |\n|---|---|")
    rows = {"first save (pins the host buffers)": save_first_s, "stage (device to pinned host)": stage_s,
            **{f"save, {n} writer threads": t for n, t in save_s_by_threads.items()},
            "validate (sha256 of every file)": validate_s, "load": load_s,
            **{f"load, {n} reader threads": t for n, t in load_s_by_threads.items()},
            "async save: step blocked": blocked_s,
            "async save: wait at publish": wait_s, "async save: total": async_total_s,
            "step (median)": base, "step during the async save (median)": statistics.median(during)}
    for name, seconds in rows.items():
        print(f"| {name} | {seconds:.2f} |")
    print(f"device peak during the async save {device_peak:.1f} GiB; host peak RSS (GiB) after each phase "
          + ", ".join(f"{k} {v:.1f}" for k, v in phases_rss.items()))


def phase_records(summary: dict) -> list[dict]:
    """The summary's timings as records, one a phase (the store's table rows)."""
    base = {"bench": "checkpoint_io", "device": summary.get("device"), "layers": summary.get("layers"),
            "checkpoint_bytes": summary.get("checkpoint_bytes")}
    records = [dict(base, phase=name, seconds=summary[key]) for name, key in PHASES.items() if key in summary]
    records += [dict(base, phase=f"save, {n} writer threads", seconds=seconds)
                for n, seconds in summary.get("save_s_by_threads", {}).items()]
    records += [dict(base, phase=f"load, {n} reader threads", seconds=seconds)
                for n, seconds in summary.get("load_s_by_threads", {}).items()]
    return records


if __name__ == "__main__":
    main()
