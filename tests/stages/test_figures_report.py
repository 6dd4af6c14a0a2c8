"""Figures and report stages: drawn from a synthetic results store alone."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from optimus_core.config import ConfigError
from optimus_core.outputs import MARKER
from optimus_core.store import StoreKeyError, open_store
from stages.figures import (BENCH_FIGURES, FIGURES, SCALING_FIGURES, FiguresConfig, FiguresInputs, FiguresOutputs, FiguresResult,
                            run_figures, select_runs)
from stages.report import ReportConfig, ReportInputs, ReportOutputs, run_report

SOURCES = ("code", "web")
EVAL_STEPS = (10, 20, 30, 40)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _eval_loss(source: str, i: int) -> float:
    return 9.0 - 0.75 * i + (0.123456 if source == "web" else 0.654321)


def _write_run(store, run_id: str, moe: bool, evals: bool = True, status: str = "completed",
               params: tuple[int, int] = (0, 0)) -> None:
    total, active = params if params[0] else (7_000_000_000 if moe else 1_200_000_000, 1_300_000_000)
    attrs = {"experiment": "laptop", "preset": f"{run_id}-preset", "git_rev": "abc1234",
             "n_params": total, "n_active_params": active,
             "wall_time_s": 3723.0, "hardware": "cpu", "config": {"model": {"n_layers": 2}, "moe": moe}}
    rng = np.random.default_rng(len(run_id))
    with store.run_writer(run_id, attrs, flush_every=16) as w:
        for step in range(1, 41):
            row = {"step": step, "tokens": 1024 * step, "loss": 10.0 / step ** 0.3 + 0.05 * rng.random(),
                   "lr": 1e-3, "tokens_per_s": 5000.0 + step}
            if moe:
                load = rng.dirichlet(np.ones(4), size=2).astype(np.float32)
                row.update(expert_load=load, moe_imbalance=float(load.max(-1).mean() * 4))
            w.log("train", row, dims={"expert_load": ("layer", "expert")})
        for i, step in enumerate(EVAL_STEPS if evals else ()):
            row = {"step": step, "tokens": 1024 * step, "loss": 8.0 - i, "ppl": float(np.exp(8.0 - i))}
            for s in SOURCES:
                row |= {f"loss.{s}": _eval_loss(s, i), f"ppl.{s}": float(np.exp(_eval_loss(s, i)))}
            w.log("eval", row)
        if evals:
            w.log("heldout", {"step": 40, "tokens": 40960, "loss": 4.5, "ppl": 90.0, "bpb": 1.25,
                              **{f"bpb.{s}": 1.0 + len(s) / 100 for s in SOURCES}})
            if moe:  # downstream scores: the MoE run only, so the dense run's cells are dashes
                w.log("downstream", {"step": 40, "tokens": 40960, "acc.optimus_docstring": 0.3125,
                                     "acc_stderr.optimus_docstring": 0.0625, "acc_norm.optimus_docstring": 0.5})
        w.close(status)


# The scaling study as `optimus perfmodel` stores it (workflow/scaling_study.py): numbers in the
# tables, the strings of row i in attrs strings.<table>[i].
STUDY = {
    "measured": [({"devices": 1, "ep": 1, "step_s": 1.0, "compute_s": 0.9, "optimizer_s": 0.1},
                  {"preset": "p", "device": "cpu", "optimizer": "local", "run_id": "EP=n", "role": "fitted"}),
                 ({"devices": 2, "ep": 2, "step_s": 0.625, "compute_s": 0.45, "a2a_s": 0.1, "optimizer_s": 0.075},
                  {"preset": "p", "device": "cpu", "optimizer": "ep_aware", "run_id": "EP=n", "role": "held-out"})],
    "predicted": [({"devices": n, "ep": 32, "step_s": t, "compute_s": t - 1.5, "grad_sync_s": 1.5},
                   {"preset": "mula-220b-a10b", "machine": "aurora", "optimizer": "ep_aware"})
                  for n, t in ((384, 33.5), (12288, 2.5))],
    "holdout": [({"devices": 2, "ep": 2, "measured_s": 0.625, "predicted_s": 0.6, "rel_error": -0.04},
                 {"preset": "p", "device": "cpu", "optimizer": "ep_aware", "sweep": "p cpu EP=n", "fit_devices": "1"})],
}


def _write_study(store) -> None:
    with store.run_writer("perfmodel", {"kind": "perfmodel", "strings": {
            t: [label for _, label in rows] for t, rows in STUDY.items()}}) as w:
        for table, rows in STUDY.items():
            for i, (numbers, _) in enumerate(rows):
                w.log(table, {"step": i, **numbers})


# An ablation benchmark as bench/common.py ingests it: one table per point, one row of numbers.
ABLATION_TOKENS_PER_S = {"ablation-ep1-loop-dp_sharded": 40.0, "ablation-ep1-triton-dp_sharded": 66.0,
                         "ablation-ep1-loop-ep_aware": 41.0, "ablation-ep1-triton-ep_aware": 70.0,
                         "ablation-ep2-loop-ep_aware": 50.0, "ablation-ep2-triton-dp_sharded": 64.0,
                         "ablation-ep2-triton-ep_aware": 80.0,
                         "ablation-ep4-triton-ep_aware": 90.0}  # EP=4 without either baseline: no group


def _write_ablation(store) -> None:
    with store.run_writer("bench-distributed-ablation-gpu-x", {"bench": "distributed_summary"}) as w:
        for table, rate in ABLATION_TOKENS_PER_S.items():
            w.log(table, {"step": 0, "tokens_per_s": rate, "devices": 2})


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    """Two completed runs (dense, MoE), a failed one, the scaling study and an ablation
    benchmark; tests only read it."""
    path = tmp_path_factory.mktemp("store") / "results" / "store.zarr"
    store = open_store(path)
    _write_run(store, "dense", moe=False)
    _write_run(store, "moe", moe=True)
    _write_run(store, "broken", moe=False, status="failed")
    _write_study(store)
    _write_ablation(store)
    return path


def _figures(store: Path, out: Path, **config) -> FiguresResult:
    return run_figures(FiguresConfig(**config), FiguresInputs(store=store), FiguresOutputs(out_dir=out))


def _assert_pngs(paths: list[Path]) -> None:
    assert [p.name for p in paths] == list(FIGURES)
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC
        height, width, _ = matplotlib.image.imread(path).shape  # decodes: a whole, valid PNG
        assert height > 100 and width > 100
    assert not [p for p in paths[0].parent.iterdir() if p.name.startswith(".") and p.name != MARKER]  # no temp files


# ----------------------------------------------------------------------------- figures

def test_figures_draw_every_figure_from_the_store(store_path, tmp_path):
    result = _figures(store_path, tmp_path / "figures")
    _assert_pngs(result.paths)
    assert result.skipped == {}


def test_figures_without_data_are_notes_listed_with_the_reason(tmp_path):
    path = tmp_path / "store.zarr"
    _write_run(open_store(path), "dense", moe=False, evals=False)
    result = _figures(path, tmp_path / "figures")
    _assert_pngs(result.paths)
    assert set(result.skipped) == {"heldout.png", "expert_load.png", "eval_table.png", "scaleup.png",
                                   "downstream.png", *SCALING_FIGURES, *BENCH_FIGURES}
    assert result.skipped["downstream.png"].startswith("no run has a downstream table")
    assert result.skipped["scaleup.png"].startswith("no MoE training run in the store")
    assert result.skipped["scaling.png"].startswith("no scaling points in the store")
    assert result.skipped["ablation.png"].startswith("no ablation in the store")
    assert "no run has a heldout or downstream table" in result.skipped["eval_table.png"]
    assert result.skipped["expert_load.png"] == "no MoE run in the store"
    assert "loss.<source>" in result.skipped["heldout.png"]

    empty = tmp_path / "empty.zarr"
    open_store(empty)
    result = _figures(empty, tmp_path / "empty-figures")
    _assert_pngs(result.paths)
    assert {result.skipped[n] for n in FIGURES if n not in SCALING_FIGURES + BENCH_FIGURES} == {
        "no completed run in the store"}


def test_ablation_speedups_are_over_each_groups_baseline(store_path):
    from stages.figures import ablation_speedups

    got = ablation_speedups(open_store(store_path, mode="r"))
    assert got == {"gpu-x EP=1": {"kernels": 70 / 41},  # one layout for both optimizers at EP 1
                   "gpu-x EP=2": {"kernels": 80 / 50, "optimizer": 80 / 64, "both": 80 / 50 * 80 / 64}}


def test_the_registrys_ablation_runs_give_each_layouts_arms_and_their_product(tmp_path):
    """The runs ``<scale>-ablation-<layout>-<arm>``: the kernel arm fast over loop, the optimizer
    arm fast over dp_sharded (where the layout has it), the median tokens/s after the first step."""
    from stages.figures import ablation_speedups

    store = open_store(tmp_path / "store.zarr")
    for run_id, rate in {"paper-ablation-ep12-loop": 100.0, "paper-ablation-ep12-fast": 150.0,
                         "paper-ablation-ep12-dp_sharded": 120.0, "paper-ablation-dp12-loop": 90.0,
                         "paper-ablation-dp12-fast": 99.0, "laptop-ablation-dp8-ep12-fast": 5.0}.items():
        with store.run_writer(run_id, {"experiment": "paper"}) as w:
            for step, r in enumerate((rate / 10, rate, rate, rate * 1.1), 1):  # the first step: warm-up, left out
                w.log("train", {"step": step, "tokens_per_s": r})
    got = ablation_speedups(open_store(tmp_path / "store.zarr", mode="r"))
    assert got == {"EP12 (paper)": {"kernels": 1.5, "optimizer": 1.25, "both": 1.875},
                   "DP12 (paper)": {"kernels": pytest.approx(1.1)}}  # no loop run for DP8-EP12: no group


def test_eval_table_figure_holds_the_stores_numbers(store_path, tmp_path):
    from stages.figures import evaluation_table
    headers, rows = evaluation_table(open_store(store_path, mode="r"), ["dense", "moe"])
    # heldout rows carry an overall loss only (per-source bpb is not a loss); accuracy +- stderr
    assert headers == ["loss (all)", "docstring acc"]
    assert rows == [["4.5000", "–"], ["4.5000", "0.312 ± 0.062"]]
    path = _figures(store_path, tmp_path / "figures").paths[list(FIGURES).index("eval_table.png")]
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > height > 100  # a wide table, drawn (not a note: nothing was skipped)


def test_figures_choose_runs(store_path, tmp_path):
    # only completed runs by default: the failed dense-only run alone has no MoE data
    result = _figures(store_path, tmp_path / "a", runs=["broken"])
    assert set(result.skipped) == {"expert_load.png", "scaleup.png", "downstream.png"}
    with pytest.raises(StoreKeyError, match="known runs: bench-distributed-ablation-gpu-x, broken, dense, moe, perfmodel"):
        _figures(store_path, tmp_path / "b", runs=["nope"])
    with pytest.raises(ConfigError, match=r"figures.smoothing = 1.0"):
        FiguresConfig(smoothing=1.0)


# ----------------------------------------------------------------------------- report

def _report(store_path: Path, report: Path, figures: Path) -> str:
    run_report(ReportConfig(), ReportInputs(store=store_path, figures_dir=figures), ReportOutputs(report=report))
    return report.read_text()


def test_report_holds_the_numbers_of_the_store_and_links_the_figures(store_path, tmp_path):
    results = tmp_path / "results"
    _figures(store_path, results / "figures")
    text = _report(store_path, results / "report.md", results / "figures")
    store = open_store(store_path, mode="r")

    for name in FIGURES:
        assert f"](figures/{name})" in text
    for run_id in ("dense", "moe"):
        first, last = store.metrics(run_id, "eval").iloc[[0, -1]].to_dict("records")
        for s in SOURCES:
            assert f"| {s} | {first[f'loss.{s}']:.4f} | {first[f'ppl.{s}']:,.2f} " \
                   f"| {last[f'loss.{s}']:.4f} | {last[f'ppl.{s}']:,.2f} |" in text
        train = store.metrics(run_id)
        final_loss = train["loss"].tail(10).mean()
        assert f"| `{run_id}` | {run_id}-preset |" in text
        assert f"| 40 | 40,960 | {final_loss:.4f} | {train['tokens_per_s'].median():,.0f} | 1h 02m 03s |" in text
    assert f"| all | 8.0000 | {np.exp(8.0):,.2f} | 5.0000 | {np.exp(5.0):,.2f} |" in text
    assert "| all | 4.5000 | 90.00 | 1.2500 |" in text and "| web | – | – | 1.0300 |" in text
    assert "| 7B | 1.3B |" in text and "| 1.2B | 1.3B |" in text
    updated = max(store.attrs(r)["updated"] for r in ("dense", "moe"))
    assert "git revision `abc1234`" in text and f"last updated {updated[:10]} {updated[11:16]} UTC" in text
    assert "Not shown: `broken` (failed)" in text and "## `broken`" not in text

    # the evaluation table: every run's final held-out loss and downstream accuracy, then its figure
    evaluation = text.split("## Evaluation\n", 1)[1].split("## Figures", 1)[0]
    assert "| run | loss (all) | docstring acc |" in evaluation
    assert "| `dense` | 4.5000 | – |" in evaluation and "| `moe` | 4.5000 | 0.312 ± 0.062 |" in evaluation
    assert "](figures/eval_table.png)" in evaluation and "eval_table.png" not in text.split("## Figures", 1)[1]

    # the strong-scaling section: the study's numbers, then its two figures; not a run section
    scaling = text.split("## Strong scaling\n", 1)[1].split("## Figures", 1)[0]
    assert f"predicts **{33.5 * 384 / (2.5 * 12288):.0%}** strong-scaling efficiency for mula-220b-a10b" in scaling
    assert "| p | cpu | p cpu EP=n | 2 | 2 | ep_aware | 1 | 0.625 | 0.6 | -4.0% |" in scaling
    assert "| 2 | 0.625 | 0.45 | 0.1 | 0 | 0.075 | 0 | 80% |" in scaling  # NaN phases of the store read as 0
    assert "](figures/scaling.png)" in scaling and "](figures/scaling_breakdown.png)" in scaling
    assert "## `perfmodel`" not in text and "`perfmodel` (completed)" in text  # not a training run
    assert select_runs(store, None) == ["dense", "moe"]

    config = text.split("```json\n", 1)[1].split("```", 1)[0]
    assert json.loads(config) == store.attrs("dense")["config"]
    assert "<details><summary>Resolved config</summary>" in text


def test_report_scaleup_section_lists_the_moe_runs_smallest_first(store_path, tmp_path):
    (tmp_path / "figures").mkdir()  # none drawn in it
    text = _report(store_path, tmp_path / "report.md", tmp_path / "figures")
    scaleup = text.split("## Scale-up\n", 1)[1].split("\n## ", 1)[0]
    # the one MoE run: sizes, tokens, the evaluate stage's held-out loss, the last in-training one, wall time
    assert "| `moe` | moe-preset | 7B | 1.3B | 40,960 | 4.5000 | 5.0000 | 1h 02m 03s |" in scaleup
    assert "`dense`" not in scaleup and "scaleup.png: not drawn" in scaleup  # no figures drawn here

    path = tmp_path / "scaleup.zarr"
    store = open_store(path)
    _write_run(store, "big", moe=True, evals=False, params=(50_000_000, 4_000_000))
    _write_run(store, "small", moe=True, params=(17_000_000, 2_400_000))
    _write_run(store, "dense", moe=False)
    _figures(path, tmp_path / "figs", only=("scaleup.png",))
    text = _report(path, tmp_path / "r.md", tmp_path / "figs")
    scaleup = text.split("## Scale-up\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in scaleup.splitlines() if line.startswith("| `")]
    assert rows == ["| `small` | small-preset | 17M | 2.4M | 40,960 | 4.5000 | 5.0000 | 1h 02m 03s |",
                    "| `big` | big-preset | 50M | 4M | 40,960 | – | – | 1h 02m 03s |"]  # never evaluated
    assert "](figs/scaleup.png)" in scaleup and "scaleup.png" not in text.split("## Figures", 1)[1]


def test_report_is_reproducible_and_links_relative_to_itself(store_path, tmp_path):
    figures = tmp_path / "elsewhere" / "figs"
    _figures(store_path, figures)
    report = tmp_path / "report.md"
    first = _report(store_path, report, figures)
    assert first == _report(store_path, report, figures)  # no clock in the report
    assert "](elsewhere/figs/loss.png)" in first
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["report.md"]  # no temp files
