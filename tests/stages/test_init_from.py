"""`--set train.init_from=DIR`: a new run starts from the weights of a Hugging Face export.

A 2-step run is exported; a new run initialised from the export has, at step 0, exactly the
held-out loss the exported model had at the end of its own run (same data, same evaluation).
"""
import json
from pathlib import Path

import pytest

pytest.importorskip("safetensors")

from optimus_core.store import open_store  # noqa: E402
from workflow.cli import main  # noqa: E402

EVAL = ["--quiet", "--set", "train.eval_batches=2"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokens_dir):
    root = tmp_path_factory.mktemp("init_from")
    store, run_dir, hf_dir = root / "store.zarr", root / "src", root / "hf"
    assert main(["pretrain", "--preset", "mula-1b@laptop", "--data", str(tokens_dir), "--out", str(run_dir),
                 "--steps", "2", "--run-id", "src", "--store", str(store), *EVAL]) == 0
    assert main(["export-hf", "--run", str(run_dir), "--out", str(hf_dir)]) == 0
    return root, store, hf_dir


def _pretrain(root, tokens_dir, store, name, preset, init_from):
    return main(["pretrain", "--preset", preset, "--data", str(tokens_dir), "--out", str(root / name),
                 "--steps", "1", "--run-id", name, "--store", str(store), *EVAL,
                 "--set", f"train.init_from={init_from}"])


def test_a_run_initialised_from_an_export_starts_at_its_loss(exported, tokens_dir):
    root, store, hf_dir = exported
    assert _pretrain(root, tokens_dir, store, "dst", "mula-1b@laptop", hf_dir) == 0
    results = open_store(store, mode="r")
    src, dst = results.metrics("src", "eval"), results.metrics("dst", "eval")
    assert src["step"].tolist() == [0, 2] and dst["step"].tolist()[0] == 0
    # step 0 of the new run = the exported (step 2) model, not a fresh initialisation
    assert dst["loss"].iloc[0] == pytest.approx(src["loss"].iloc[-1], rel=1e-6)
    assert dst["loss.code"].iloc[0] == pytest.approx(src["loss.code"].iloc[-1], rel=1e-6)
    assert abs(dst["loss"].iloc[0] - src["loss"].iloc[0]) > 1e-3
    # the resolved path is recorded with the run's config
    meta = json.loads((root / "dst" / "meta.json").read_text())
    assert meta["config"]["train"]["init_from"] == str(hf_dir.resolve())
    # ... and the stack it trained on (on Aurora: the frameworks module's torch, xpu, xccl)
    import torch

    assert meta["software"]["torch"] == torch.__version__ and meta["software"]["device_type"] == "cpu"
    assert meta["software"]["backend"] == "gloo" and Path(meta["software"]["torch_path"]).is_dir()
    assert meta["launch"]["world_size"] == 1
    assert results.attrs("dst")["software"]["torch"] == torch.__version__
    # a resumed run loads its checkpoint over the export: more steps continue from step 1
    assert main(["pretrain", "--preset", "mula-1b@laptop", "--data", str(tokens_dir), "--out", str(root / "dst"),
                 "--steps", "2", "--run-id", "dst", *EVAL, "--set", f"train.init_from={hf_dir}"]) == 0
    summary = json.loads((root / "dst" / "summary.json").read_text())
    assert summary["resumed_from"] == 1 and summary["steps"] == 2


def test_a_mismatched_or_missing_export_is_a_clear_error(exported, tokens_dir, capsys):
    root, store, hf_dir = exported
    assert _pretrain(root, tokens_dir, store, "moe", "mula-7b-a1b@laptop", hf_dir) == 1
    err = capsys.readouterr().err
    assert f"train.init_from = '{hf_dir.resolve()}': its model does not match model (mula-7b-a1b@laptop)" in err
    assert "moe True here, False there" in err
    assert _pretrain(root, tokens_dir, store, "none", "mula-1b@laptop", root / "missing") == 1
    assert "not a Hugging Face model directory (no config.json)" in capsys.readouterr().err
