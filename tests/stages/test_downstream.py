"""The paper's evaluation figure: downstream accuracy against tokens per task and their average,
the runs beside reference models' published numbers (stages/reference.py), and the report's
table of the paper's runs (workflow/plan.py record_plan)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
import yaml

from optimus_core.config import ConfigError
from optimus_core.eval.tasks import PAPER_TASKS
from optimus_core.store import open_store
from stages.downstream_figure import AVERAGE, _scores, _tasks, downstream_figure, reference_runs
from stages.reference import ReferenceConfig, ReferenceInputs, ReferenceOutputs, read_reference, run_reference

REFERENCE = Path(__file__).parents[2] / "workflow" / "reference" / "olmoe-1b-7b-0924.yaml"


def _paper_run(store, run_id: str, scale: float) -> None:
    """A run evaluated at three checkpoints on the nine tasks (their metrics and the others'),
    MMLU with a subject, as the evaluate stage stores lm-eval's results."""
    with store.run_writer(run_id, {"preset": "mula-7b-a1b"}) as w:
        for i, step in enumerate((1000, 2000, 3000)):
            row = {"step": step, "tokens": step * 6_291_456}
            for j, (task, metric) in enumerate(PAPER_TASKS.items()):
                row[f"{metric}.{task}"] = scale * (0.3 + 0.05 * i + 0.01 * j)
                row[f"{'acc' if metric == 'acc_norm' else 'acc_norm'}.{task}"] = 0.01  # the metric not drawn
            row["acc.mmlu_anatomy"] = 0.9
            w.log("downstream", row)


def _ingest(store_path: Path, file: Path = REFERENCE):
    return run_reference(ReferenceConfig(), ReferenceInputs(file=file), ReferenceOutputs(store=store_path))


def test_the_reference_file_becomes_a_store_run_and_a_rerun_replaces_it(tmp_path):
    path = tmp_path / "store.zarr"
    result = _ingest(path)
    assert (result.run_id, result.points) == ("reference-olmoe-1b-7b-0924", 1)
    _ingest(path)  # idempotent: the same rows, not twice
    store = open_store(path, mode="r")
    attrs = store.attrs(result.run_id)
    assert attrs["kind"] == "reference" and attrs["model"] == "OLMoE-1B-7B-0924" and "2409.02060" in attrs["source"]
    assert "OLMES" in attrs["protocol"]
    rows = store.metrics(result.run_id, "downstream")
    assert len(rows) == 1 and rows["tokens"][0] == 5.133e12
    assert rows["acc_norm.hellaswag"][0] == 0.8 and rows["acc.mmlu"][0] == 0.541
    assert reference_runs(store) == [result.run_id]


@pytest.mark.parametrize("change, message", [
    ({"source": ""}, "source must be a non-empty string"),
    ({"points": []}, "points must be a list of one or more"),
    ({"points": [{"acc.piqa": 0.5}]}, r"points\[0\]: tokens = None: must be a number > 0"),
    ({"points": [{"tokens": 1e12, "acc_norm.piqa": 1.5}]}, "acc_norm.piqa = 1.5: must be an accuracy in"),
    ({"points": [{"tokens": 1e12, "acc.piqa": 0.5}]}, "acc.piqa: the paper reads acc_norm of piqa"),
    ({"points": [{"tokens": 1e12, "f1.squad": 0.5}]}, "column 'f1.squad' is not <acc|acc_norm>.<task>"),
])
def test_a_bad_reference_file_is_one_clear_error(tmp_path, change, message):
    doc = {**yaml.safe_load(REFERENCE.read_text()), **change}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=message):
        read_reference(bad)
    assert not (tmp_path / "store.zarr").exists()


def test_tasks_are_the_papers_in_order_with_their_metric_and_the_average(tmp_path):
    store = open_store(tmp_path / "store.zarr")
    _paper_run(store, "run", 1.0)
    frame = store.metrics("run", "downstream")
    tasks = _tasks([frame])
    assert tasks == list(PAPER_TASKS)  # MMLU's subject is not a panel of its own; the other metric is not read
    points = _scores(frame, tasks)
    assert points["arc_easy"].tolist() == pytest.approx([0.3, 0.35, 0.4])  # acc_norm, not acc
    assert points[AVERAGE].tolist() == pytest.approx([0.3 + 0.01 * 4, 0.35 + 0.04, 0.4 + 0.04])  # mean of the nine


def test_the_figure_draws_runs_and_references_and_says_when_it_cannot(tmp_path):
    path = tmp_path / "store.zarr"
    store = open_store(path)
    assert "no run has a downstream table" in downstream_figure(store, ["nothing"])
    _paper_run(store, "mula", 1.0)
    _paper_run(store, "other", 0.9)
    _ingest(path)
    fig = downstream_figure(open_store(path, mode="r"), ["mula", "other"])
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes][:2] == ["arc_easy (acc_norm)", "arc_challenge (acc_norm)"]
    assert axes[-1].get_title() == "average (mean of the tasks)" and len(axes) == 10
    assert len(axes[0].lines) == 3  # two runs and the reference
    sciq = next(ax for ax in axes if ax.get_title().startswith("sciq"))
    assert len(sciq.lines) == 2  # the reference publishes no SciQ score
    out = tmp_path / "downstream.png"
    fig.savefig(out, format="png")
    assert matplotlib.image.imread(out).shape[0] > 100


def test_laptop_tasks_stand_in_in_the_same_layout(tmp_path):
    store = open_store(tmp_path / "store.zarr")
    with store.run_writer("laptop", {}) as w:
        for step in (40, 80):
            w.log("downstream", {"step": step, "tokens": step * 2048, "acc.optimus_cont_code": 0.4,
                                 "acc_norm.optimus_cont_code": 0.5, "acc.optimus_docstring": 0.3})
    fig = downstream_figure(store, ["laptop"])
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["cont_code (acc)", "docstring (acc)", "average (mean of the tasks)"]


def test_the_report_tables_the_papers_runs(tmp_path):
    from workflow.experiments import dag
    from workflow.plan import nominal_size, plan_table, record_plan
    from workflow.sites import load_site

    import dataclasses
    site = dataclasses.replace(load_site("aurora"), account="TestProj")
    experiments = [e for e in dag("paper") if e.kind == "pretrain"]
    _, plans = plan_table(experiments, site)
    path = tmp_path / "store.zarr"
    assert record_plan(path, site, experiments, plans) == "plan-aurora"
    rows = open_store(path, mode="r").attrs("plan-aurora")["paper_runs"]
    by = {r["preset"]: r for r in rows}
    assert by["mula-220b-a10b"]["tag"] == "SA1.5-SH1.5-SE3.75-SI1.5-L64" and by["mula-220b-a10b"]["ep"] == 12
    assert by["mula-20b-a2b"]["params"] == 20_076_824_576 and by["mula-20b-a2b"]["nominal"] == "20B / 2B"
    assert by["mula-1b"]["nominal"] == "1B / 1B" and by["mula-7b-a1b"]["steps"] == 635_783
    assert all(r["seq_len"] == 2048 and r["batch"] == 3072 and r["gib_per_tile"] < r["budget_gib"] for r in rows)
    assert nominal_size("mula-100b-a7b@laptop") == "100B / 7B"

    from stages.report import _paper_runs
    text = "\n".join(_paper_runs(open_store(path, mode="r")))
    assert "## The paper's runs" in text
    assert "| mula-220b-a10b | `olmoe-1b-7b--SA1.5-SH1.5-SE3.75-SI1.5-L64` | 64 | 3072 | 24 | 240 (top-8) |" in text
