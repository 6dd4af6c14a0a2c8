"""The results store: round trip, resume, crash safety, concurrent writers, read-only mode."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import zarr

from optimus_core.store import StoreKeyError, open_store

REPO = Path(__file__).resolve().parents[2]


def _python(script: str, **kw) -> subprocess.Popen:
    """Run ``script`` in a fresh interpreter, as a killed trainer would have run."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _snapshot(path: Path) -> dict:
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in path.rglob("*")}


# ----------------------------------------------------------------------------- round trip

def test_round_trip_with_backfill_missing_values_and_nd_column(tmp_path):
    store = open_store(tmp_path / "store.zarr")
    rng = np.random.default_rng(0)
    load = rng.random((12, 2, 4)).astype(np.float32)
    attrs = {"experiment": "moe-laptop", "preset": "mula-7b-a1b-laptop", "n_params": np.int64(7_000),
             "config": {"model": {"n_layers": 2, "moe": {"n_experts": 4}}, "train": {"steps": 12}}}
    with store.run_writer("moe", attrs, flush_every=4) as w:
        for s in range(12):
            row = {"step": s, "tokens": 1000 * (s + 1), "loss": 10.0 / (s + 1), "ok": s % 2 == 0,
                   "expert_load": load[s] if s != 3 else None}
            if s >= 5:
                row["late"] = float(s)  # first seen after rows were flushed and buffered
            if s != 7:
                row["lr"] = 1e-3
            if s != 2:
                row["dropped"] = s  # an int column with one row missing
            w.log("train", row, dims={"expert_load": ("layer", "expert")})

    ro = open_store(tmp_path / "store.zarr", mode="r")
    expected = pd.DataFrame({
        "step": np.arange(12, dtype=np.int64),
        "tokens": 1000 * np.arange(1, 13, dtype=np.int64),
        "loss": 10.0 / np.arange(1, 13),
        "ok": np.arange(12) % 2 == 0,
        "lr": np.where(np.arange(12) == 7, np.nan, 1e-3),
        "dropped": np.where(np.arange(12) == 2, np.nan, np.arange(12.0)),
        "late": np.where(np.arange(12) >= 5, np.arange(12.0), np.nan),
    })
    pd.testing.assert_frame_equal(ro.metrics("moe"), expected)

    expected_load = load.copy()
    expected_load[3] = np.nan
    got = ro.array("moe", "train", "expert_load")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected_load)

    # xarray reads dimension names from the zarr v3 metadata
    table = tmp_path / "store.zarr" / "moe" / "train"
    assert zarr.open_array(table / "expert_load", mode="r").metadata.dimension_names == ("step", "layer", "expert")
    assert zarr.open_array(table / "loss", mode="r").metadata.dimension_names == ("step",)

    got_attrs = ro.attrs("moe")
    assert got_attrs["config"] == attrs["config"]
    assert got_attrs["n_params"] == 7_000 and got_attrs["status"] == "completed"
    assert got_attrs["run_id"] == "moe" and got_attrs["created"] <= got_attrs["updated"]
    assert ro.tables("moe") == ["train"]


def test_runs_lists_every_run_sorted_by_creation_without_nested_attrs(tmp_path):
    store = open_store(tmp_path / "s.zarr")
    assert store.runs().empty and list(store.runs().columns[:4]) == ["run_id", "experiment", "preset", "status"]
    for run_id, status in [("b-first", "completed"), ("a-second", "failed")]:
        w = store.run_writer(run_id, {"preset": "p", "n_params": 10, "config": {"x": 1}})
        w.log("train", {"step": 0, "loss": 1.0})
        w.close(status)
    runs = store.runs()
    assert runs["run_id"].tolist() == ["b-first", "a-second"]
    assert runs["status"].tolist() == ["completed", "failed"]
    assert runs["n_params"].tolist() == [10, 10]
    assert "config" not in runs.columns


def test_writer_status_from_context_manager(tmp_path):
    store = open_store(tmp_path / "s.zarr")
    with pytest.raises(RuntimeError):
        with store.run_writer("boom") as w:
            w.log("train", {"step": 0, "loss": 1.0})
            raise RuntimeError("diverged")
    with pytest.raises(KeyboardInterrupt):
        with store.run_writer("ctrl-c"):
            raise KeyboardInterrupt
    with store.run_writer("fine"):
        pass
    with store.run_writer("walltime") as w:
        w.set_status("interrupted")  # an explicit status wins over the clean exit
    store.run_writer("killed").close()  # a trainer that died without a word: still "running"
    with store.run_writer("killed") as w:  # the evaluate stage adds a table: no claim it finished
        w.log("heldout", {"step": 0, "loss": 2.0})
    status = dict(zip(store.runs()["run_id"], store.runs()["status"]))
    assert status == {"boom": "failed", "ctrl-c": "interrupted", "fine": "completed",
                      "walltime": "interrupted", "killed": "running"}
    assert store.metrics("boom")["loss"].tolist() == [1.0]  # rows logged before the error are kept


def test_time_based_flush_makes_rows_visible_to_readers(tmp_path):
    store = open_store(tmp_path / "s.zarr")
    w = store.run_writer("live", flush_every=1000, flush_seconds=0.0)
    for s in range(3):
        w.log("train", {"step": s, "loss": float(s)})
    assert open_store(tmp_path / "s.zarr", mode="r").metrics("live")["step"].tolist() == [0, 1, 2]
    assert store.attrs("live")["status"] == "running"
    w.close()


# ----------------------------------------------------------------------------- resume

def test_resumed_run_appends_and_replaces_relogged_steps(tmp_path):
    store = open_store(tmp_path / "s.zarr")
    with store.run_writer("r", {"preset": "p"}, flush_every=3) as w:
        for s in range(10):
            w.log("train", {"step": s, "loss": float(s)})
        w.log("eval", {"step": 9, "loss": 9.5})
    created = store.attrs("r")["created"]

    # the job died after step 9 but its last checkpoint was step 6: steps 6.. are logged again
    with store.run_writer("r", {"status": "running"}, flush_every=3) as w:
        assert store.attrs("r")["status"] == "running"
        for s in range(6, 13):
            w.log("train", {"step": s, "loss": 100.0 + s})
    m = store.metrics("r")
    assert m["step"].tolist() == list(range(13))
    assert m["loss"].tolist() == [float(s) for s in range(6)] + [100.0 + s for s in range(6, 13)]
    assert store.metrics("r", "eval")["loss"].tolist() == [9.5]  # other tables untouched
    assert store.attrs("r")["created"] == created and store.attrs("r")["status"] == "completed"

    # a plain reopen (the evaluate stage) appends after the rows and keeps the status
    with store.run_writer("r") as w:
        w.log("train", {"step": 13, "loss": 1.0})
    assert store.metrics("r")["step"].tolist() == list(range(14))


def test_relogging_a_step_within_one_writer_replaces_it(tmp_path):
    store = open_store(tmp_path / "s.zarr")
    with store.run_writer("r", flush_every=100) as w:
        for s in [0, 1, 2, 3, 2]:  # buffered rows 2 and 3 are replaced
            w.log("train", {"step": s, "loss": float(s)})
        w.flush()
        w.log("train", {"step": 1, "loss": -1.0})  # a committed row is replaced
    m = store.metrics("r")
    assert m["step"].tolist() == [0, 1] and m["loss"].tolist() == [0.0, -1.0]


# ----------------------------------------------------------------------------- crash safety

def test_kill_between_array_write_and_commit_keeps_committed_rows(tmp_path):
    path = tmp_path / "s.zarr"
    proc = _python(f"""
        import os
        from optimus_core import store as S
        w = S.open_store({str(path)!r}).run_writer("crash", flush_every=10**6)
        for s in range(10):
            w.log("train", {{"step": s, "loss": 0.5 * s}})
        w.flush()
        S._Table._commit = lambda self, n_rows: os._exit(17)  # die just before the commit
        for s in range(10, 15):
            w.log("train", {{"step": s, "loss": 0.5 * s, "late": 1.0}})
        w.flush()
    """)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 17, err

    store = open_store(path)
    # the uncommitted rows and column did reach the disk, and are not visible
    assert zarr.open_array(path / "crash" / "train" / "loss", mode="r").shape == (15,)
    m = store.metrics("crash")
    assert list(m.columns) == ["step", "loss"]
    assert m["step"].tolist() == list(range(10)) and m["loss"].tolist() == [0.5 * s for s in range(10)]
    assert store.attrs("crash")["status"] == "running"

    # the next writer drops the orphaned column ("late" comes back as an int now) and appends
    with store.run_writer("crash", {"status": "running"}) as w:
        w.log("train", {"step": 10, "loss": 5.0, "late": 3})
    m = store.metrics("crash")
    assert m["step"].tolist() == list(range(11))
    assert np.isnan(m["late"][:10]).all() and m["late"][10] == 3


def test_sigkill_mid_flush_leaves_a_consistent_store(tmp_path):
    path = tmp_path / "s.zarr"
    proc = _python(f"""
        import numpy as np
        from optimus_core.store import open_store
        w = open_store({str(path)!r}).run_writer("killed", flush_every=3)
        s = 0
        while True:
            w.log("train", {{"step": s, "loss": 0.5 * s, "load": np.full((2, 3), s, np.float32)}})
            s += 1
            if s % 3 == 0:
                print(s, flush=True)  # rows 0..s-1 are committed
    """)
    committed = 0
    while committed < 30:
        committed = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

    store = open_store(path, mode="r")
    m = store.metrics("killed")
    n = len(m)
    assert n >= committed
    np.testing.assert_array_equal(m["step"], np.arange(n))
    np.testing.assert_array_equal(m["loss"], 0.5 * np.arange(n))
    np.testing.assert_array_equal(store.array("killed", "train", "load")[:, 0, 0], np.arange(n))


def _write_run(path: str, run_id: str, n: int) -> None:
    with open_store(path).run_writer(run_id, {"preset": run_id}, flush_every=7) as w:
        for s in range(n):
            w.log("train", {"step": s, "loss": float(s), run_id: 1.0})


def test_two_processes_write_two_runs_into_one_fresh_store(tmp_path):
    path = str(tmp_path / "s.zarr")  # not created yet: both processes race to create the root
    ctx = multiprocessing.get_context("spawn")  # zarr runs an event-loop thread: no fork
    procs = [ctx.Process(target=_write_run, args=(path, run_id, 120)) for run_id in ("left", "right")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    store = open_store(path, mode="r")
    assert sorted(store.runs()["run_id"]) == ["left", "right"]
    for run_id in ("left", "right"):
        m = store.metrics(run_id)
        assert list(m.columns) == ["step", "loss", run_id]
        np.testing.assert_array_equal(m["loss"], np.arange(120.0))
        assert store.attrs(run_id)["status"] == "completed"


# ----------------------------------------------------------------------------- read-only and errors

def test_read_only_mode_creates_and_changes_nothing(tmp_path):
    missing = tmp_path / "missing.zarr"
    with pytest.raises(FileNotFoundError):
        open_store(missing, mode="r")
    assert not missing.exists()

    path = tmp_path / "s.zarr"
    with open_store(path).run_writer("r") as w:
        w.log("train", {"step": 0, "loss": 1.0, "load": np.ones(2)})
    before = _snapshot(path)
    ro = open_store(path, mode="r")
    ro.runs(), ro.metrics("r"), ro.array("r", "train", "load"), ro.attrs("r"), ro.tables("r")
    with pytest.raises(PermissionError):
        ro.run_writer("new")
    assert _snapshot(path) == before


def test_missing_run_table_or_column_names_what_exists(tmp_path):
    store = open_store(tmp_path / "s.zarr")
    with store.run_writer("known") as w:
        w.log("train", {"step": 0, "loss": 1.0})
    with pytest.raises(KeyError, match=r"'nope'.*known runs: known"):
        store.metrics("nope")
    with pytest.raises(StoreKeyError, match=r"no table 'eval'.*its tables: train"):
        store.metrics("known", "eval")
    with pytest.raises(StoreKeyError, match=r"no column 'x'.*its columns: step, loss"):
        store.array("known", "train", "x")


def test_bad_values_and_paths_are_refused_clearly(tmp_path):
    store = open_store(tmp_path / "s.zarr")
    w = store.run_writer("r")
    with pytest.raises(TypeError, match="put strings in run attrs"):
        w.log("train", {"step": 0, "note": "hello"})
    with pytest.raises(ValueError, match="needs a 'step'"):
        w.log("train", {"loss": 1.0})
    w.log("train", {"step": 0, "tokens": 10})
    with pytest.raises(TypeError, match="column 'tokens' holds ints"):
        w.log("train", {"step": 1, "tokens": 10.5})
    with pytest.raises(ValueError, match="status = 'done'"):
        w.set_status("done")
    w.close()
    assert store.metrics("r")["tokens"].tolist() == [10]  # refused rows left no trace

    not_a_store = tmp_path / "dir"
    not_a_store.mkdir()
    (not_a_store / "file.txt").write_text("x")
    for bad in (not_a_store, not_a_store / "file.txt"):
        with pytest.raises(ValueError, match="not a zarr store"):
            open_store(bad)
