"""`optimus evaluate --nproc 2`: the held-out metrics of a run on its model sharded over two
ranks (FSDP2, the run's EP degree, each rank reading only its rows of the checkpoint) equal
those of the one-process evaluation; with downstream tasks the two ranks share the run's
checkpoints instead, one process each, and the results equal one process's; an evaluation of
every checkpoint cut short goes on from the checkpoints it had evaluated."""
import json

import pytest

from workflow.cli import main

TRAIN = ["--preset", "mula-7b-a1b@laptop", "--steps", "2", "--quiet", "--threads", "1",
         "--set", "train.eval_batches=1", "--set", "model.n_layers=2", "--set", "train.device=cpu"]


def test_sharded_heldout_equals_one_process(tokens_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["pretrain", *TRAIN, "--data", str(tokens_dir), "--out", str(run), "--run-id", "ev",
                 "--nproc", "2", "--set", "parallel.ep=2"]) == 0
    base = ["evaluate", "--run", str(run), "--max-batches", "2", "--device", "cpu"]
    assert main([*base, "--out", str(tmp_path / "one.json")]) == 0
    assert main([*base, "--out", str(tmp_path / "two.json"), "--nproc", "2", "--store", str(tmp_path / "s.zarr")]) == 0
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["ranks"] == 2 and two["step"] == one["step"] == 2
    for key in ("loss", "loss.code", "loss.prose", "bpb"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    from optimus_core.store import open_store

    assert open_store(tmp_path / "s.zarr", mode="r").metrics("ev", "heldout")["loss"].iloc[-1] == pytest.approx(two["loss"])


def test_downstream_tasks_on_two_ranks_share_the_checkpoints_and_resume(tokens_dir, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    run = tmp_path / "run"
    assert main(["pretrain", *TRAIN, "--steps", "3", "--checkpoint-every", "1", "--set", "train.keep_checkpoints=3",
                 "--data", str(tokens_dir), "--out", str(run), "--run-id", "ev1"]) == 0
    base = ["evaluate", "--run", str(run), "--tasks", "heldout", "continuation", "--items", "8", "--max-batches", "1",
            "--device", "cpu"]
    assert main([*base, "--nproc", "2", "--out", str(tmp_path / "x.json")]) == 2  # one checkpoint: one process
    assert "the ranks share a run's checkpoints: add --all-checkpoints" in capsys.readouterr().err
    every = [*base, "--all-checkpoints", "--downstream-all-checkpoints"]
    assert main([*every, "--out", str(tmp_path / "one.json")]) == 0
    assert main([*every, "--out", str(tmp_path / "two.json"), "--nproc", "2", "--store", str(tmp_path / "s.zarr")]) == 0
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert [r["step"] for r in two["downstream_checkpoints"]] == [1, 2, 3]
    for a, b in zip(one["downstream_checkpoints"] + one["checkpoints"], two["downstream_checkpoints"] + two["checkpoints"]):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    from optimus_core.store import open_store

    table = open_store(tmp_path / "s.zarr", mode="r").metrics("ev1", "downstream")
    assert list(table["step"]) == [1, 2, 3]
    # Cut short: one checkpoint's part lost, another's made with other settings. The rerun loads
    # those two and keeps the third; other settings evaluate every checkpoint again.
    parts = tmp_path / "one.json.parts"
    assert sorted(p.name for p in parts.iterdir()) == [f"step_{s:08d}.json" for s in (1, 2, 3)]
    (parts / "step_00000001.json").unlink()
    other = json.loads((parts / "step_00000003.json").read_text())
    other["how"]["n_items"] = 9
    (parts / "step_00000003.json").write_text(json.dumps(other))
    from stages import evaluate

    loads = []
    load = evaluate._Point.load
    monkeypatch.setattr(evaluate._Point, "load", lambda self, *a, **k: loads.append(self.step) or load(self, *a, **k))
    capsys.readouterr()
    assert main([*every, "--out", str(tmp_path / "one.json")]) == 0
    assert loads == [1, 3] and "checkpoint 2 of 3 (step 2) evaluated before, kept" in capsys.readouterr().err
    assert json.loads((tmp_path / "one.json").read_text()) == one
    loads.clear()
    assert main([*every, "--items", "12", "--out", str(tmp_path / "one.json")]) == 0
    assert loads == [1, 2, 3]


def test_the_ranks_a_nodes_memory_holds_share_the_checkpoints(monkeypatch):
    """Two nodes of 4 ranks whose memory holds 2 checkpoint loads each: ranks 0, 1, 4 and 5 take
    every 4th checkpoint, the others none; a node that holds all its ranks' loads uses them all."""
    import os
    from types import SimpleNamespace

    from optimus_core.parallel.mesh import LaunchEnv
    from stages import evaluate

    model = SimpleNamespace(num_params=lambda: 2**30)  # 8 GiB a load
    found = [SimpleNamespace(step=s, cfg=SimpleNamespace(model=model)) for s in range(1, 11)]
    pages = {"SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])

    def shares(node_gib):
        pages["SC_PHYS_PAGES"] = node_gib * 2**30 // 4096
        return [[p.step for p in evaluate._share(found, LaunchEnv(r, 8, r % 4, "pmi", None, None, 4), "r")]
                for r in range(8)]

    assert shares(20) == [[1, 5, 9], [2, 6, 10], [], [], [3, 7], [4, 8], [], []]  # 0.8 x 20 GiB: 2 loads
    assert shares(64) == [[s for s in range(1, 11) if (s - 1) % 8 == r] for r in range(8)]
    assert shares(4) == [[1, 3, 5, 7, 9], [], [], [], [2, 4, 6, 8, 10], [], [], []]  # at least one a node
