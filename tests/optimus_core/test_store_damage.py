"""A damaged store is never read as healthy: a run group, table or column whose metadata is lost
or broken, or a chunk that does not decode, stops the read naming it (exit 1 from the CLI);
asked to, the reader leaves the damaged runs out and says which."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optimus_core.store import StoreDamagedError, open_store

REPO = Path(__file__).resolve().parents[2]


def _store(tmp_path):
    store = open_store(tmp_path / "s.zarr")
    for run_id in ("good", "hurt"):
        with store.run_writer(run_id, {"preset": "p", "experiment": "e"}) as w:
            for step in range(1, 4):
                w.log("train", {"step": step, "loss": 1.0 / step})
    return tmp_path / "s.zarr"


@pytest.mark.parametrize("lose", ["hurt/train/zarr.json", "hurt/zarr.json", "hurt/train/loss/zarr.json"])
def test_lost_metadata_stops_the_read_naming_the_part(tmp_path, lose):
    path = _store(tmp_path)
    (path / lose).unlink()
    store = open_store(path, mode="r")
    with pytest.raises(StoreDamagedError, match=rf"{path / Path(lose).parent}: its zarr.json is missing.*hurt"):
        store.runs()
    assert list(store.damaged()) == [str(Path(lose).parent)]
    with pytest.warns(UserWarning, match="left out damaged run.*hurt"):
        assert open_store(path, mode="r", skip_damaged=True).runs()["run_id"].tolist() == ["good"]
    assert open_store(path, mode="r").metrics("good")["step"].tolist() == [1, 2, 3]  # the others read


def test_metadata_that_is_not_json_and_a_chunk_that_does_not_decode(tmp_path):
    path = _store(tmp_path)
    (path / "hurt" / "train" / "zarr.json").write_text("{not json")
    with pytest.raises(StoreDamagedError, match="not valid JSON"):
        open_store(path, mode="r").runs()
    path = _store(tmp_path / "again")
    [chunk] = [p for p in (path / "hurt" / "train" / "loss").rglob("*") if p.is_file() and p.name != "zarr.json"]
    chunk.write_bytes(b"garbage" * 3)
    store = open_store(path, mode="r")
    assert store.runs()["run_id"].tolist() == ["good", "hurt"]  # the metadata is whole
    with pytest.raises(StoreDamagedError, match=r"loss.*does not decode"):
        store.metrics("hurt")


def test_figures_on_a_damaged_store_exit_1_in_one_line_or_skip_when_asked(tmp_path):
    path = _store(tmp_path)
    (path / "hurt" / "train" / "zarr.json").unlink()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "workflow.cli", "figures", "--store", str(path), "--out", str(tmp_path / "f"),
           "--only", "loss.png"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "hurt/train: its zarr.json is missing" in out.stderr and "--skip-damaged" in out.stderr
    out = subprocess.run(cmd + ["--skip-damaged"], env=env, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "left out damaged run(s) hurt" in out.stderr
