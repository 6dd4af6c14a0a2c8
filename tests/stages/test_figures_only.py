"""Drawing a subset of the figures (FiguresConfig.only, `optimus figures --only`): the per-figure
Snakemake targets rely on it, and on FIGURE_READS naming what each figure reads."""
from __future__ import annotations

from pathlib import Path

import pytest

from optimus_core.config import ConfigError
from optimus_core.store import open_store
from stages.figures import FIGURE_READS, FIGURES, FiguresConfig, FiguresInputs, FiguresOutputs, run_figures
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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "throughput.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in result.paths)
    assert result.skipped == {}  # both have their data: real plots, not notes


def test_only_a_scaling_figure_without_a_study_is_a_note(store_path, tmp_path):
    result = run_figures(FiguresConfig(only=("scaling.png",)), FiguresInputs(store_path), FiguresOutputs(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["scaling.png"]
    assert list(result.skipped) == ["scaling.png"] and "no scaling points" in result.skipped["scaling.png"]


def test_only_rejects_unknown_or_empty_names():
    with pytest.raises(ConfigError, match=r"figures.only = \('scaling.svg',\): must name figures among loss.png"):
        FiguresConfig(only=("scaling.svg",))
    with pytest.raises(ConfigError, match=r"figures.only = \(\)"):
        FiguresConfig(only=())


def test_cli_only_flag(store_path, tmp_path, capsys):
    assert main(["figures", "--store", str(store_path), "--out", str(tmp_path), "--only", "expert_load.png",
                 "--only", "loss.png"]) in (0, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["expert_load.png", "loss.png"]
    assert capsys.readouterr().out.split() == [str(tmp_path / "loss.png"), str(tmp_path / "expert_load.png")]


def test_every_figure_says_what_it_reads():
    assert list(FIGURE_READS) == list(FIGURES)
    assert {need for needs in FIGURE_READS.values() for need in needs} == {"training", "evaluation", "scaling", "bench"}
