"""Drawing a subset of the figures (FiguresConfig.only, `optimus figures --only`): the per-figure
Snakemake targets rely on it, and on FIGURE_READS naming what each figure reads. The scale-up
figure (stages/scaleup.py) from a synthetic store of MoE and dense runs."""
from __future__ import annotations

from pathlib import Path

import pytest

from optimus_core.config import ConfigError
from optimus_core.outputs import MARKER
from optimus_core.store import open_store
from stages.figures import FIGURE_READS, FIGURES, FiguresConfig, FiguresInputs, FiguresOutputs, run_figures
from stages.scaleup import scaleup_figure, scaleup_runs
from workflow.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("figures-only") / "store.zarr"
    store = open_store(path)
    with store.run_writer("run-a", {"experiment": "laptop", "preset": "p"}) as w:
        for step in range(1, 6):
            w.log("train", {"step": step, "tokens": 64 * step, "loss": 5.0 / step, "tokens_per_s": 100.0})
        w.close("completed")
    return path


def test_only_draws_the_named_figures_in_figures_order(store_path, tmp_path):
    result = run_figures(FiguresConfig(only=("throughput.png", "loss.png")), FiguresInputs(store_path),
                         FiguresOutputs(tmp_path))
    assert result.paths == [tmp_path / "loss.png", tmp_path / "throughput.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "loss.png", "throughput.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in result.paths)
    assert result.skipped == {}  # both have their data: real plots, not notes


def test_only_a_scaling_figure_without_a_study_is_a_note(store_path, tmp_path):
    result = run_figures(FiguresConfig(only=("scaling.png",)), FiguresInputs(store_path), FiguresOutputs(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "scaling.png"]
    assert list(result.skipped) == ["scaling.png"] and "no scaling points" in result.skipped["scaling.png"]


def test_only_rejects_unknown_or_empty_names():
    with pytest.raises(ConfigError, match=r"figures.only = \('scaling.svg',\): must name figures among loss.png"):
        FiguresConfig(only=("scaling.svg",))
    with pytest.raises(ConfigError, match=r"figures.only = \(\)"):
        FiguresConfig(only=())


def test_cli_only_flag(store_path, tmp_path, capsys):
    assert main(["figures", "--store", str(store_path), "--out", str(tmp_path), "--only", "expert_load.png",
                 "--only", "loss.png"]) in (0, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "expert_load.png", "loss.png"]
    out, err = capsys.readouterr()
    assert out.split() == [str(tmp_path / "loss.png")]  # the figures drawn; this store's runs are dense:
    assert f"{tmp_path / 'expert_load.png'}: a note, not a figure: " in err  # a note, named apart


def test_every_figure_says_what_it_reads():
    assert list(FIGURE_READS) == list(FIGURES)
    assert {need for needs in FIGURE_READS.values() for need in needs} == {
        "training", "evaluation", "scaling", "bench", "scaleup", "reference", "ablation", "downstream"}
    assert "downstream" in FIGURE_READS["downstream.png"]  # the paper's lm-eval jobs, where the DAG has them
    assert FIGURE_READS["scaleup.png"] == ("scaleup",)  # the MoE training runs only, no evaluate stage
    assert FIGURE_READS["ablation.png"] == ("bench", "ablation")  # the GPU benchmark and the ablation runs


# (run id, preset, total, active parameters): written largest first, so the figure must sort them
SCALEUP = [("laptop-pretrain-mula-220b-a10b", "mula-220b-a10b@laptop", 46_699_680, 3_845_280),
           ("laptop-pretrain-mula-1b", "mula-1b@laptop", 2_099_328, 2_099_328),  # dense: not drawn
           ("laptop-pretrain-mula-20b-a2b", "mula-20b-a2b@laptop", 17_189_504, 2_443_904),
           ("laptop-pretrain-mula-7b-a1b", "mula-7b-a1b@laptop", 7_637_120, 2_132_096)]


@pytest.fixture(scope="module")
def scaleup_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("scaleup") / "store.zarr"
    store = open_store(path)
    for i, (run_id, preset, total, active) in enumerate(SCALEUP):
        with store.run_writer(run_id, {"preset": preset, "n_params": total, "n_active_params": active}) as w:
            for step in range(1, 9):
                w.log("train", {"step": step, "tokens": 2048 * step, "loss": 8.0 - 0.3 * step - 0.1 * i})
            for step in (0, 4, 8):
                w.log("eval", {"step": step, "tokens": 2048 * step, "loss": 8.5 - 0.25 * step - 0.1 * i})
            w.close("completed")
    return path


def test_scaleup_draws_the_moe_runs_smallest_first_labelled_with_their_sizes(scaleup_store, tmp_path):
    store = open_store(scaleup_store, mode="r")
    runs = scaleup_runs(store, [r for r, *_ in SCALEUP])
    assert runs == ["laptop-pretrain-mula-7b-a1b", "laptop-pretrain-mula-20b-a2b", "laptop-pretrain-mula-220b-a10b"]
    colour = {r: f"C{i}" for i, r in enumerate(runs)}
    train_ax, eval_ax = scaleup_figure(store, runs, colour).axes
    labels = ["mula-7b-a1b@laptop: 7.64M total / 2.13M active", "mula-20b-a2b@laptop: 17.2M total / 2.44M active",
              "mula-220b-a10b@laptop: 46.7M total / 3.85M active"]
    assert [t.get_text() for t in train_ax.get_legend().get_texts()] == labels
    assert [t.get_text() for t in eval_ax.get_legend().get_texts()] == labels
    # per run: the raw loss and its EMA against tokens; the held-out points after the first step
    # (tokens on a log axis), in the run's colour
    assert len(train_ax.lines) == 2 * len(runs) and len(eval_ax.lines) == len(runs)
    assert train_ax.get_xscale() == eval_ax.get_xscale() == "log"
    for line, run_id in zip(eval_ax.lines, runs):
        i = [r for r, *_ in SCALEUP].index(run_id)
        assert list(line.get_xdata()) == [8192, 16384]
        assert list(line.get_ydata()) == pytest.approx([7.5 - 0.1 * i, 6.5 - 0.1 * i])
        assert line.get_color() == colour[run_id]
    raw, ema = train_ax.lines[0].get_ydata(), train_ax.lines[1].get_ydata()
    assert raw[0] == ema[0] and ema[-1] > raw[-1]  # smoothed: it lags a falling loss

    result = run_figures(FiguresConfig(only=("scaleup.png",)), FiguresInputs(scaleup_store), FiguresOutputs(tmp_path))
    assert result.skipped == {} and result.paths[0].read_bytes()[:8] == PNG_MAGIC


def test_scaleup_without_a_moe_run_is_a_note(store_path, tmp_path):
    # store_path's run has no parameter counts: nothing to place on a scale
    result = run_figures(FiguresConfig(only=("scaleup.png",)), FiguresInputs(store_path), FiguresOutputs(tmp_path))
    assert result.skipped == {"scaleup.png": "no MoE training run in the store (the scale-up runs: "
                                             "workflow/experiments.py)"}
