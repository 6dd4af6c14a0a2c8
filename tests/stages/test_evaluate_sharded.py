"""`optimus evaluate --nproc 2`: the held-out metrics of a run on its model sharded over two
ranks (FSDP2, the run's EP degree, each rank reading only its rows of the checkpoint) equal
those of the one-process evaluation; downstream tasks are refused there, naming why."""
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


def test_sharded_evaluation_refuses_downstream_tasks(tokens_dir, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    assert main(["pretrain", *TRAIN, "--data", str(tokens_dir), "--out", str(run), "--run-id", "ev1"]) == 0
    assert main(["evaluate", "--run", str(run), "--tasks", "heldout", "docstring", "--nproc", "2"]) == 2
    assert "a sharded evaluation runs 'heldout' only" in capsys.readouterr().err
    from stages.evaluate import EvaluateConfig, EvaluateInputs, EvaluateOutputs, run_evaluate
    from optimus_core.config import ConfigError

    for name, value in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)  # rank 0 of two, as mpiexec or torchrun would start it
    with pytest.raises(ConfigError, match="a sharded evaluation runs 'heldout' only"):
        run_evaluate(EvaluateConfig(tasks=("heldout", "docstring")), EvaluateInputs(run_dir=run),
                     EvaluateOutputs(eval_json=tmp_path / "x.json"))
