#!/usr/bin/env python3
"""Checkpoint reads alone: DCP's reader against ParallelFileReader by threads (not a test).

    python bench/checkpoint_read.py [--gib 2] [--files 8] [--threads 1 2 8] [--dir /tmp]

Writes one part of ``--gib`` GiB of float32 tensors in ``--files`` files (DCP's writer, as a
rank's part is written), then loads it back into CPU tensors, best of 3 each: with
torch.distributed.checkpoint's FileSystemReader and with optimus_core.train.checkpoint_reader's
ParallelFileReader at each ``--threads``. The files are read from the page cache after the write,
so this times the readers' own work (torch.load of each item and the copy into its target), not
the disk. No GPU needed; bench/checkpoint_io.py times the whole resume on one. Output: a table and
bench/results/checkpoint-read-<host cores>cores.jsonl.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_jsonl  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--dir", default=None, help="where the part is written (default: the system's temp dir)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)

    import torch
    import torch.distributed.checkpoint as dcp

    from optimus_core.train.checkpoint_reader import ParallelFileReader

    warnings.simplefilter("ignore")  # DCP's "single process" notes
    per_tensor = int(args.gib * 2**30 / 4 / (2 * args.files))  # two tensors a file
    tensors = {f"w{i}": torch.randn(per_tensor) for i in range(2 * args.files)}
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    readers = [("dcp FileSystemReader", lambda path: dcp.FileSystemReader(path))]
    readers += [(f"parallel, {n} threads", lambda path, n=n: ParallelFileReader(path, threads=n)) for n in args.threads]
    records = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-read-") as tmp:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, thread_count=args.files), no_dist=True)
        out = {k: torch.empty_like(v) for k, v in tensors.items()}
        print(f"| {nbytes / 2**30:.1f} GiB in {args.files} files, {os.cpu_count()} cores | best of 3 | GB/s |\n|---|---|---|")
        for name, make in readers:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                dcp.load(out, storage_reader=make(tmp), no_dist=True)
                times.append(time.perf_counter() - t0)
            assert all(torch.equal(out[k], tensors[k]) for k in tensors), name
            records.append({"bench": "checkpoint_read", "reader": name, "bytes": nbytes, "files": args.files,
                            "cores": os.cpu_count(), "seconds": min(times), "gb_per_s": nbytes / min(times) / 1e9})
            print(f"| {name} | {min(times):.2f} s | {nbytes / min(times) / 1e9:.2f} |")
    path = Path(args.out) / f"checkpoint-read-{os.cpu_count()}cores.jsonl"
    write_jsonl(path, records)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
