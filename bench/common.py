"""What the benchmarks share: device names, atomic JSON-lines files, and writing to the store.

GPU machines may lack zarr: a benchmark there writes its JSON lines (bench/results/), and
``ingest(path, store, ...)`` puts them into the results store afterwards, on any machine:

    python bench/train_step.py --ingest bench/results/train-step-nvidia-h200.jsonl
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from optimus_core.device import device_slug  # noqa: F401  (the benchmarks' results are named by it)


def write_jsonl(path: str | Path, lines: list[dict]) -> None:
    """Atomically: a temp file beside it, fsync, rename (a crash never leaves half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_jsonl(path: str | Path) -> list[dict]:
    lines = []
    for i, text in enumerate(Path(path).read_text().splitlines(), 1):
        if text.strip():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
    return lines


def _table_name(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", value)


def write_store(store_path: str, run_id: str, records: list[dict], summary: dict, key: str) -> bool:
    """One table per record (named by ``record[key]``), one row of its numeric fields (at step
    ``record["pass"]``, 0 without: a repeated measurement's passes are rows of one table); the
    summary's fields and each record's other fields in the run's attrs. False where the store
    cannot be imported."""
    try:
        from optimus_core.store import open_store
    except ImportError:
        return False
    with open_store(store_path).run_writer(run_id, attrs={**summary, "experiment": summary.get("bench", "bench")}) as w:
        kept = [r for r in records if "error" not in r]
        for r in kept:
            row = {k: v for k, v in r.items() if _is_number(v)}
            w.log(_table_name(str(r[key])), {**row, "step": int(r.get("pass", 0))})
        # The store's tables hold numbers only: each record's other fields (preset, optimizer,
        # dtype, overrides, ...) go to the run's attrs, by table name; failed records too.
        w.update_attrs(records={_table_name(str(r[key])): {k: v for k, v in r.items() if not _is_number(v)}
                                for r in records})
    return True


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_id_for(path: str | Path) -> str:
    """The store run of a results file: bench/results/train-step-nvidia-h200.jsonl ->
    bench-train-step-nvidia-h200 (the benchmark writes and ``ingest`` reads the same name)."""
    return f"bench-{Path(path).stem}"


def publish(path: str | Path, records: list[dict], summary: dict, store_path: str, key: str,
            extra: list[dict] = ()) -> None:
    """A benchmark's end: print the summary, write records + ``extra`` lines + summary to
    ``path``, and the run (``run_id_for(path)``) to the store where one is given and imports."""
    print(json.dumps(summary, indent=1))
    write_jsonl(path, [*records, *extra, summary])
    print(f"wrote {path}")
    if store_path and write_store(store_path, run_id_for(path), records, summary, key=key):
        print(f"wrote run {run_id_for(path)} to {store_path}")


def ingest(path: str | Path, store_path: str, key: str, fallback: str | None = None) -> str:
    """Write a benchmark's JSON lines (records + a final ``*_summary`` line) to the store. A
    record without ``key`` is named by its ``fallback`` field (files written before the key)."""
    lines = read_jsonl(path)
    summaries = [line for line in lines if str(line.get("bench", "")).endswith("summary")]
    if not summaries:
        raise ValueError(f"{path}: no summary line (a benchmark's last line ends with 'summary')")
    summary = summaries[-1]
    records = [line if key in line else {**line, key: line[fallback]}
               for line in lines if key in line or (fallback and fallback in line)]
    run_id = run_id_for(path)
    if not write_store(store_path, run_id, records, summary, key):
        raise ImportError("the results store needs zarr: pip install -e .")
    return f"wrote run {run_id} ({len(records)} records) to {store_path}"


SYNTHETIC_SEQ = 4096  # the synthetic documents' length: one training sequence each
SYNTHETIC_VOCAB = 50280  # mula-7b-a1b's (the tokenizer's) vocabulary


def write_synthetic_tokens(data_dir: Path, train_tokens: int, val_tokens: int, seed: int = 0) -> Path:
    """A data directory in the `optimus tokenize` format holding uniform random ids (one
    document per sequence), a train and a val file of one source."""
    from optimus_core.data.shards import (IndexRow, Manifest, TokenFile, sha256_file, token_dtype, write_index,
                                          write_manifest)

    import numpy as np

    rng = np.random.default_rng(seed)
    dtype = token_dtype(SYNTHETIC_VOCAB)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "tokenizer.json").write_text("{}")  # not read by training; listed for the format
    files = []
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        rel = Path(split) / "synthetic"
        (data_dir / rel).mkdir(parents=True, exist_ok=True)
        tokens = rng.integers(0, SYNTHETIC_VOCAB - 1, n).astype(dtype)
        doc = SYNTHETIC_SEQ + 1
        tokens[doc - 1::doc] = SYNTHETIC_VOCAB - 1  # EOS ends each document
        tokens.tofile(data_dir / rel / "part.npy")
        write_index(data_dir / rel / "part.csv.gz",
                    [IndexRow(s, min(s + doc, n), "synthetic", str(i)) for i, s in enumerate(range(0, n, doc))])
        files.append(TokenFile(split, "synthetic", str(rel / "part.npy"), str(rel / "part.csv.gz"), n,
                               -(-n // doc), 4 * n, sha256_file(data_dir / rel / "part.npy"),
                               sha256_file(data_dir / rel / "part.csv.gz"), "synthetic", ""))
    write_manifest(data_dir, Manifest(vocab_size=SYNTHETIC_VOCAB, eos_id=SYNTHETIC_VOCAB - 1,
                                      pad_id=SYNTHETIC_VOCAB - 1, dtype=str(dtype),
                                      tokenizer_sha256=sha256_file(data_dir / "tokenizer.json"), val_fraction=0.1,
                                      files=tuple(files)))
    return data_dir
