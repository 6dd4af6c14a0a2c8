"""bench/optimizer.py on the CPU: a tiny --numel runs every case (the Triton ones in the
interpreter under TRITON_INTERPRET=1), writes the JSON lines and the store run, and ingests."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_optimizer", ROOT / "bench" / "optimizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scaled_sizes_keep_count_order_and_sum(bench):
    sizes = bench.model_sizes()
    assert len(sizes) == 91 and sum(sizes) == 3_562_604_544  # the 8-layer mula-7b-a1b
    assert bench.scaled(sizes, sum(sizes)) == sizes
    small = bench.scaled(sizes, 100_003)
    assert len(small) == 91 and sum(small) == 100_003 and min(small) >= 1
    big = max(range(91), key=sizes.__getitem__)
    assert max(range(91), key=small.__getitem__) == big  # the largest stays the largest
    assert sum(bench.scaled(sizes, 50)) == 50  # fewer elements than tensors: one tensor each, then no more


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke check; a GPU runs the real benchmark")
def test_smoke_on_cpu_writes_every_case_and_ingests(bench, tmp_path, capsys):
    store = tmp_path / "store.zarr"
    bench.main(["--numel", "4097", "--reps", "1", "--warmup", "1", "--out", str(tmp_path), "--store", str(store)])
    path = tmp_path / "optimizer-cpu.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    records, summary = lines[:-1], lines[-1]
    cases = {r["case"] for r in records}
    torch_cases = {"copy", "norm-torch", "adamw-torch-flat", "adamw-torch-flat/s", "adamw-torch-list/s"}
    triton_cases = {"norm-triton", "adamw-triton", "adamw-triton/s", "adamw-triton+bf16/s"}
    assert cases == (torch_cases | triton_cases if INTERPRET else torch_cases)
    for r in records:
        assert "error" not in r, r
        assert r["numel"] == 4097 and r["ms"] > 0
        assert r["gbps"] == pytest.approx(r["bytes_per_param"] * 4097 / r["ms"] / 1e6)
    assert {r["case"]: r["tensors"] for r in records}["adamw-torch-list/s"] == 91
    assert {r["case"]: r["bytes_per_param"] for r in records}.get("adamw-triton+bf16/s", 30) == 30
    assert summary["bench"] == "optimizer_summary" and summary["numel"] == 4097
    assert (summary["speedup_triton_over_torch_flat"] is not None) == INTERPRET

    from optimus_core.store import open_store

    s = open_store(store, mode="r")
    assert "bench-optimizer-cpu" in set(s.runs()["run_id"])
    flat = s.metrics("bench-optimizer-cpu", "adamw-torch-flat_s")
    assert flat["bytes_per_param"].tolist() == [28]

    other = tmp_path / "other.zarr"
    bench.main(["--ingest", str(path), "--store", str(other)])
    assert f"wrote run bench-optimizer-cpu ({len(records)} records)" in capsys.readouterr().out
    assert set(open_store(other, mode="r").tables("bench-optimizer-cpu")) == set(s.tables("bench-optimizer-cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU only")
def test_refuses_a_paper_size_run_on_the_cpu(bench, tmp_path):
    with pytest.raises(SystemExit, match="found no CUDA or XPU device"):
        bench.main(["--out", str(tmp_path), "--store", ""])
