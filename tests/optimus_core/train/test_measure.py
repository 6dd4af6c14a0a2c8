"""optimus_core.train.measure: timed steps on one process, their phases, and the timeline the
benchmarks ask for with OPTIMUS_TRACE_DIR (bench/trace_gaps.py reads it)."""
import gzip
import json
import time

import torch

from optimus_core import presets
from optimus_core.parallel import Mesh
from optimus_core.train.measure import PHASES, measure_steps


def _cfg():
    return presets.get("mula-7b-a1b@laptop").run_config(**{
        "model.n_layers": 1, "data.seq_len": 16, "train.global_batch": 2, "train.micro_batch": 1})


def test_phases_and_a_timeline_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMUS_TRACE_DIR", str(tmp_path / "traces"))
    before = time.time()
    point = measure_steps(_cfg(), Mesh.single(torch.device("cpu")), steps=2, warmup=1)
    assert point["step_s"] > 0 and point["tokens_per_step"] == 2 * 16
    # the timed series' wall-clock windows (bench/gpu_telemetry.py reads the GPU over them):
    # after the warm-up, in order, the synced steps' at least as long as their sum
    (s0, s1), (b0, b1) = point["synced_window_unix_s"], point["back_to_back_window_unix_s"]
    assert before < s0 <= s1 <= b0 <= b1 <= time.time()
    assert s1 - s0 >= 2 * point["step_s"] * 0.99
    assert point["compute_s"] > 0 and point["optimizer_s"] > 0 and point["a2a_s"] == 0
    assert all(f"{name}_s" in point for name in PHASES)
    (trace,) = (tmp_path / "traces").iterdir()
    assert trace.name == "trace-1r-ep1-rank0.json.gz"
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = [e for e in events if e.get("name") == "optimus.step"]
    assert len(steps) == 2  # two traced steps, after the timed ones
    assert any(e.get("cat") == "cpu_op" for e in events)


def test_no_timeline_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("OPTIMUS_TRACE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    measure_steps(_cfg(), Mesh.single(torch.device("cpu")), steps=1, warmup=0)
    assert not list(tmp_path.iterdir())
