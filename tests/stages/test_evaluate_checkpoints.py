"""`optimus evaluate --all-checkpoints` and the docstring task, end to end through lm-eval.

A 2-step run (a checkpoint after each step) of the smallest laptop preset, on a code-heavy
corpus whose held-out split holds documented functions; scores are checked against direct
computations with the same checkpoints.
"""
import json

import pytest

pytest.importorskip("lm_eval")

from optimus_core.eval.docstring import docstring_items  # noqa: E402
from optimus_core.eval.lm import OptimusLM  # noqa: E402
from optimus_core.store import open_store  # noqa: E402
from optimus_core.train.evaluate import heldout_metrics  # noqa: E402
from stages.evaluate import EvaluateConfig, _checkpoints  # noqa: E402
from workflow.cli import main  # noqa: E402


class Req:  # the one attribute of lm_eval's Instance the model reads
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def run(tmp_path_factory, code_tokens_dir):
    root = tmp_path_factory.mktemp("ckpts")
    run_dir, store = root / "run", root / "store.zarr"
    assert main(["pretrain", "--preset", "mula-1b@laptop", "--data", str(code_tokens_dir), "--out", str(run_dir),
                 "--steps", "2", "--checkpoint-every", "1", "--quiet", "--run-id", "tiny", "--store", str(store),
                 "--set", "train.eval_batches=1"]) == 0
    return run_dir, store


def test_every_checkpoint_gets_a_heldout_row_and_the_newest_the_docstring_task(run, code_tokens_dir, tmp_path, capsys):
    run_dir, store = run
    out = tmp_path / "eval.json"
    argv = ["evaluate", "--run", str(run_dir), "--all-checkpoints", "--tasks", "heldout", "docstring",
            "--max-batches", "1", "--store", str(store), "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    rows = doc["checkpoints"]
    assert [r["step"] for r in rows] == [1, 2] and doc["step"] == 2
    tokens_per_step = rows[0]["tokens"]
    assert tokens_per_step > 0 and rows[1]["tokens"] == 2 * tokens_per_step

    # each row is the held-out loss of that checkpoint's weights
    points = _checkpoints(run_dir, every=True)
    for point, row in zip(points, rows):
        want = heldout_metrics(point.load(), code_tokens_dir, seq_len=point.cfg.data.seq_len, batch_size=16,
                               max_batches=1)
        assert row["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert row["loss.code"] == pytest.approx(want["loss.code"], rel=1e-6)
    assert rows[0]["loss"] != rows[1]["loss"]  # a step of training changed the weights
    assert doc["loss"] == rows[1]["loss"]  # the top level is the newest checkpoint's

    table = open_store(store, mode="r").metrics("tiny", "heldout")
    assert table["step"].tolist() == [1, 2] and table["tokens"].tolist() == [r["tokens"] for r in rows]
    assert table["loss"].tolist() == pytest.approx([r["loss"] for r in rows])

    # the docstring task ran through lm-eval on the newest checkpoint only; its accuracy is the
    # one recomputed here from the same items with the same model
    down = open_store(store, mode="r").metrics("tiny", "downstream")
    assert down["step"].tolist() == [2]
    score = doc["downstream"]["optimus_docstring"]
    items = docstring_items(code_tokens_dir)
    assert score["n"] == len(items) >= 8
    lm = OptimusLM.for_model(points[-1].load(), points[-1].cfg, code_tokens_dir)
    n = len(items[0]["choices"])
    ll = lm.loglikelihood([Req(it["context"], c) for it in items for c in it["choices"]])
    right = sum(max(range(n), key=lambda j: ll[n * i + j][0]) == it["label"] for i, it in enumerate(items))
    assert score["acc"] == pytest.approx(right / len(items))
    assert down["acc.optimus_docstring"].iloc[0] == pytest.approx(score["acc"])

    # a rerun rewrites the same rows: still one per checkpoint
    assert main(argv) == 0
    assert open_store(store, mode="r").metrics("tiny", "heldout")["step"].tolist() == [1, 2]


def test_downstream_on_every_checkpoint_when_asked(run, tmp_path):
    run_dir, _ = run
    store, out = tmp_path / "store.zarr", tmp_path / "eval.json"
    assert main(["evaluate", "--run", str(run_dir), "--downstream-all-checkpoints", "--tasks", "docstring",
                 "--items", "4", "--store", str(store), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["step"] for r in doc["downstream_checkpoints"]] == [1, 2] and doc["checkpoints"] == []
    assert doc["downstream"]["optimus_docstring"]["n"] == 4  # --items caps the docstring items
    down = open_store(store, mode="r").metrics("tiny", "downstream")
    assert down["step"].tolist() == [1, 2]
    assert down["acc.optimus_docstring"].iloc[-1] == doc["downstream"]["optimus_docstring"]["acc"]


def test_without_all_checkpoints_only_the_newest_is_evaluated(run, tmp_path):
    run_dir, _ = run
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--run", str(run_dir), "--max-batches", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["step"] == 2 and "checkpoints" not in doc and "loss" in doc


def test_all_checkpoints_needs_heldout():
    with pytest.raises(ValueError, match="all_checkpoints = True with tasks = \\['docstring'\\]"):
        EvaluateConfig(tasks=("docstring",), all_checkpoints=True)
    with pytest.raises(ValueError, match="downstream_all_checkpoints = True needs all_checkpoints"):
        EvaluateConfig(downstream_all_checkpoints=True)
