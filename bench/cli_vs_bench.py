#!/usr/bin/env python3
"""`optimus pretrain` with no performance flags against bench/train_step.py's variants (not a test).

    python bench/cli_vs_bench.py [--batches 2 8] [--steps 30] [--variants 7b8l-default 7b8l-triton+compile]

What a user gets from the command line, with nothing but the model and the batch set, beside
the benchmark's step of the same shapes (mula-7b-a1b, 8 of its 16 layers, sequence 4096):
issue 24's claim is that the two agree within 5 %, i.e. the defaults are the fast path.

The command trains on synthetic tokens (uniform ids, written here in the `optimus tokenize`
format: the step does not depend on what the ids are) for ``--steps`` steps, in a subprocess,
and reports its own tokens/s (the median step of the run, summary.json). The benchmark's
variants run in the same call (bench/train_step.py: median back-to-back step).

Output: a table, bench/results/cli-vs-bench-<device>.jsonl (one line per batch: the CLI's
tokens/s, each variant's, the ratio) and the execution plan the CLI printed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import device_slug, write_jsonl  # noqa: E402

SEQ = 4096
VOCAB = 50280  # mula-7b-a1b's (the tokenizer's) vocabulary


def write_synthetic_tokens(data_dir: Path, train_tokens: int, val_tokens: int, seed: int = 0) -> Path:
    """A data directory in the `optimus tokenize` format holding uniform random ids (one
    document per sequence), a train and a val file of one source."""
    from optimus_core.data.shards import (IndexRow, Manifest, TokenFile, sha256_file, token_dtype, write_index,
                                          write_manifest)

    rng = np.random.default_rng(seed)
    dtype = token_dtype(VOCAB)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "tokenizer.json").write_text("{}")  # not read by training; listed for the format
    files = []
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        rel = Path(split) / "synthetic"
        (data_dir / rel).mkdir(parents=True, exist_ok=True)
        tokens = rng.integers(0, VOCAB - 1, n).astype(dtype)
        doc = SEQ + 1
        tokens[doc - 1::doc] = VOCAB - 1  # EOS ends each document
        tokens.tofile(data_dir / rel / "part.npy")
        write_index(data_dir / rel / "part.csv.gz",
                    [IndexRow(s, min(s + doc, n), "synthetic", str(i)) for i, s in enumerate(range(0, n, doc))])
        files.append(TokenFile(split, "synthetic", str(rel / "part.npy"), str(rel / "part.csv.gz"), n,
                               -(-n // doc), 4 * n, sha256_file(data_dir / rel / "part.npy"),
                               sha256_file(data_dir / rel / "part.csv.gz"), "synthetic", ""))
    write_manifest(data_dir, Manifest(vocab_size=VOCAB, eos_id=VOCAB - 1, pad_id=VOCAB - 1, dtype=str(dtype),
                                      tokenizer_sha256=sha256_file(data_dir / "tokenizer.json"), val_fraction=0.1,
                                      files=tuple(files)))
    return data_dir


def run_cli(data_dir: Path, run_dir: Path, batch: int, steps: int) -> dict:
    """`optimus pretrain` with the model and batch only; its summary.json and printed plan."""
    cmd = [sys.executable, "-m", "workflow.cli", "pretrain", "--preset", "mula-7b-a1b", "--data", str(data_dir),
           "--out", str(run_dir), "--steps", str(steps), "--quiet",
           "--set", "model.n_layers=8", "--set", f"train.global_batch={batch}", "--set", f"data.seq_len={SEQ}",
           "--set", "train.eval_batches=1", "--set", "schedule.warmup_steps=5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"optimus pretrain failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    meta = json.loads((run_dir / "meta.json").read_text())
    return {"tokens_per_s": summary["tokens_per_s"], "plan": meta.get("execution_plan"),
            "stdout": proc.stdout[-2000:]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[2, 8], help="sequences per step")
    p.add_argument("--steps", type=int, default=30, help="CLI steps (the median step is its tokens/s)")
    p.add_argument("--variants", nargs="+", default=["7b8l-triton+compile"],
                   help="bench/train_step.py variants (default: its best one, measured on 2026-12-01)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)

    import torch

    from bench import train_step

    if not torch.cuda.is_available():
        sys.exit("bench/cli_vs_bench.py compares GPU steps and found no CUDA device")
    device = torch.device("cuda")
    rows = []
    # The run's final checkpoint (weights and AdamW state, ~43 GB at these shapes) goes to memory
    # where the host has a tmpfs, and each run directory is removed once read.
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        most = max(args.batches)
        data = write_synthetic_tokens(Path(tmp) / "data", (args.steps + 2) * most * (SEQ + 1), 4 * most * (SEQ + 1))
        # Every command first, then the benchmark in this process: its compiled variants keep
        # device memory that a command started beside them would run out of.
        clis = {}
        for batch in args.batches:
            clis[batch] = run_cli(data, Path(tmp) / f"run-{batch}", batch, args.steps)
            shutil.rmtree(Path(tmp) / f"run-{batch}")
            print(clis[batch]["stdout"], flush=True)
        for batch, cli in clis.items():
            bench_args = train_step.parse_args(["--batch", str(batch), "--steps", "10", "--warmup", "3"])
            variants = {}
            for name in args.variants:
                record = train_step.run_variant(name, bench_args, device)
                variants[name] = train_step._tokens_per_s(record)
            best = max(variants.values())
            rows.append({"bench": "cli_vs_bench", "batch": batch, "seq_len": SEQ, "cli_tokens_per_s": cli["tokens_per_s"],
                         "variants_tokens_per_s": variants, "cli_over_best": cli["tokens_per_s"] / best,
                         "plan": cli["plan"], "torch": torch.__version__})
            write_jsonl(Path(args.out) / f"cli-vs-bench-{device_slug(device)}.jsonl", rows)  # as each finishes
    print(f"\n| tokens per step | optimus pretrain (no flags) | " + " | ".join(args.variants) + " | CLI / best |")
    print("|---|---|" + "---|" * len(args.variants) + "---|")
    for r in rows:
        print(f"| {r['batch']} x {SEQ} | {r['cli_tokens_per_s']:,.0f} | "
              + " | ".join(f"{r['variants_tokens_per_s'][v]:,.0f}" for v in args.variants)
              + f" | {r['cli_over_best']:.3f} |")
    out = Path(args.out) / f"cli-vs-bench-{device_slug(device)}.jsonl"
    write_jsonl(out, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
