"""Scaling figure, breakdown and report section: drawn from plain point dicts, written atomically,
numbers in the text taken from the inputs."""
from __future__ import annotations

import matplotlib.image
import pytest

from stages.scaling_figure import (PAPER, draw_breakdown, draw_scaling, drivers, paper_rows,
                                   scaling_report_markdown, series)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _point(devices, step, preset="mula-7b-a1b@laptop", device="cpu", optimizer="ep_aware", **phases):
    base = {"compute_s": step * 0.7, "a2a_s": step * 0.1, "grad_sync_s": step * 0.1, "optimizer_s": step * 0.05,
            "idle_s": step * 0.05}
    return {"preset": preset, "device": device, "devices": devices, "ep": devices,
            "optimizer": optimizer if devices > 1 else "local", "step_s": step, **{**base, **phases}}


MEASURED = [_point(1, 1.0), _point(2, 0.6), _point(4, 0.4), _point(2, 0.7, optimizer="dp_sharded"),
            _point(4, 0.5, optimizer="dp_sharded")]
PREDICTED = [
    {**_point(n, t, preset="mula-220b-a10b", device=None), "machine": "aurora"}
    for n, t in ((384, 200.0), (768, 101.0), (1536, 52.0), (3072, 27.0), (6144, 15.0), (12288, 9.0))
] + [{**_point(n, t), "machine": "cpu"} for n, t in ((1, 0.95), (2, 0.62), (4, 0.45))]
for row in PREDICTED[:6]:  # gradient sync that does not shrink with tiles: what the drivers should name
    row.update(grad_sync_s=2.0, compute_s=row["step_s"] - 2.0 - row["a2a_s"] - row["optimizer_s"] - row["idle_s"])
WHATIF = [{**r, "scenario": "overlap grad_sync", "grad_sync_s": 0.0, "step_s": r["step_s"] - 2.0}
          for r in PREDICTED[:6]]
HOLDOUT = [{"preset": "mula-7b-a1b@laptop", "device": "cpu", "devices": 4, "ep": 4, "optimizer": "ep_aware",
            "measured_s": 0.4, "predicted_s": 0.45, "rel_error": 0.125, "sweep": "cpu EP=n", "fit_devices": "1 2"}]


def test_series_split_sweeps_and_share_the_one_rank_base():
    s = series(MEASURED)
    assert set(s) == {("mula-7b-a1b@laptop", "cpu", "ep_aware"), ("mula-7b-a1b@laptop", "cpu", "dp_sharded")}
    for rows in s.values():
        assert [r["devices"] for r in rows] == [1, 2, 4] and rows[0]["optimizer"] == "local"
    assert [r["devices"] for r in paper_rows(PREDICTED)] == [384, 768, 1536, 3072, 6144, 12288]


def test_figures_are_pngs_written_atomically(tmp_path):
    out = tmp_path / "figs"
    for draw, name in ((draw_scaling, "scaling.png"), (draw_breakdown, "scaling_breakdown.png")):
        path = draw(MEASURED, PREDICTED + WHATIF, out / name, "t")
        assert path == out / name and path.read_bytes()[:8] == PNG_MAGIC
        assert matplotlib.image.imread(path).shape[0] > 100
        assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    # nothing to draw: a note, still a PNG (the rule can always declare the file)
    assert draw_scaling([], [], out / "empty.png").read_bytes()[:8] == PNG_MAGIC
    assert draw_breakdown([], [], out / "empty2.png").read_bytes()[:8] == PNG_MAGIC


def test_report_section_puts_the_model_beside_the_paper_and_names_the_drivers():
    text = scaling_report_markdown(MEASURED, PREDICTED, HOLDOUT)
    eff = 200.0 * 384 / (9.0 * 12288)
    assert f"predicts **{eff:.0%}** strong-scaling efficiency for mula-220b-a10b from 384 to 12288 tiles" in text
    assert f"the paper reports **~{PAPER['efficiency']:.0%}** from 384 to 12288 tiles" in text
    assert "gradient sync: 2 s at 384 and 2 s at 12288 devices (does not shrink)" in text
    assert "no overlap of communication with compute" in text
    assert "max 12%, mean 12% over 1 points" in text and "within the 15% target" in text
    assert "| mula-7b-a1b@laptop | cpu | cpu EP=n | 4 | 4 | ep_aware | 1 2 | 0.4 | 0.45 | +12.5% |" in text
    assert "*mula-7b-a1b@laptop on cpu (dp_sharded)*" in text
    assert "What-if" not in text
    whatif = scaling_report_markdown(MEASURED, PREDICTED + WHATIF, HOLDOUT)
    eff_whatif = 198.0 * 384 / (7.0 * 12288)
    assert (f"- What-if, overlap grad_sync: the same model with every layer's collectives hidden (our step hides "
            f"what the other layers' compute covers) predicts {eff_whatif:.0%} at 12288 tiles.") in whatif
    assert f"predicts **{eff:.0%}**" in whatif  # the headline stays the plain model's
    bad = scaling_report_markdown([], [], [{**HOLDOUT[0], "rel_error": -0.2, "predicted_s": 0.32}])
    assert "outside the 15% target" in bad and "No model prediction of the paper's sweep" in bad
    assert "No measured scaling points" in bad
    # a sweep calibrated on one device saw no communication: said, and the verdict given without it
    blind = {**HOLDOUT[0], "sweep": "cpu2", "devices": 2, "fit_devices": "1", "rel_error": -0.5, "predicted_s": 0.2}
    both = scaling_report_markdown([], [], [HOLDOUT[0], blind])
    assert "max 50%, mean 31% over 2 points, outside the 15% target" in both
    assert "calibrated on one device alone (cpu2) fit no communication" in both
    assert "Without them: max 12%, mean 12% over 1 points, within the 15% target." in both


def test_drivers_of_perfect_scaling_and_of_a_fixed_cost():
    perfect = [{"devices": 1, "step_s": 2.0, "compute_s": 2.0}, {"devices": 2, "step_s": 1.0, "compute_s": 1.0}]
    assert drivers(perfect) == ["The model scales perfectly from 1 to 2 devices."]
    fixed = [{"devices": 1, "step_s": 3.0, "compute_s": 2.0, "grad_sync_s": 1.0},
             {"devices": 2, "step_s": 2.0, "compute_s": 1.0, "grad_sync_s": 1.0}]
    (line,) = drivers(fixed)
    assert line.startswith("gradient sync: 1 s at 1 and 1 s at 2 devices (does not shrink); it accounts for 100%")
    with pytest.raises(KeyError):
        series([{"devices": 1}])  # a row without its preset is a caller's bug, not a silent drop


def test_held_out_points_are_open_with_their_error_and_figures_build_without_saving():
    from stages.scaling_figure import breakdown_figure, scaling_figure

    measured = [{**p, "role": "held-out" if p["devices"] == 4 else "fitted"} for p in MEASURED]
    fig = scaling_figure(measured, PREDICTED)
    paper_ax, ax = fig.axes  # the paper's sweep apart from the calibration sweeps
    assert paper_ax.get_title() == "The paper's sweep: mula-220b-a10b" and ax.get_title() == "Calibration sweeps"
    assert {line.get_label() for line in paper_ax.get_lines() if not line.get_label().startswith("_")} == {
        "model: mula-220b-a10b on aurora (ep_aware)", "paper: ~90% at 12288 tiles (base 384)"}
    opened = [line for line in ax.get_lines() if line.get_markerfacecolor() == "none"]
    assert len(opened) == 2  # the 4-device point of each of the two measured sweeps
    assert sorted(x for line in opened for x in line.get_xdata()) == [4, 4]
    # the measured series draw filled markers only at their fitted points (1 and 2 devices)
    series_lines = [line for line in ax.get_lines() if line.get_label().startswith("measured:")]
    assert len(series_lines) == 2 and all(line.get_markevery() == [0, 1] for line in series_lines)
    assert "held out (open): predicted, not fitted" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert not [line for line in scaling_figure(MEASURED, PREDICTED).axes[1].get_lines()
                if line.get_markerfacecolor() == "none"]
    # the model's error on a held-out point is written beside it (rows of one sweep share a run_id)
    tagged = [{**p, "run_id": "EP=n batch 8"} for p in measured if p["optimizer"] in ("ep_aware", "local")]
    model = [{**_point(n, t), "machine": "cpu", "run_id": "EP=n batch 8"} for n, t in ((1, 0.95), (2, 0.62), (4, 0.45))]
    (ax,) = scaling_figure(tagged, model).axes
    assert [t.get_text() for t in ax.texts] == [f"{0.45 / 0.4 - 1:+.0%}"]
    # one panel per (preset, hardware): the laptop CPU sweep (measured + model) and the Aurora sweep
    assert len([a for a in breakdown_figure(MEASURED, PREDICTED).axes if a.get_visible()]) == 2


def test_report_names_a_held_out_design_and_the_overlap_the_model_assumes():
    design = [{**HOLDOUT[0], "devices": 2, "ep": e, "setting": s, "sweep": f"cpu EP={r} {s}", "fit_devices": "1 2",
               "fit_points": "1 batch 16, 2 EP=1 batch 16, 2 EP=n batch 16", "rel_error": err}
              for e, r, s, err in ((1, "1", "batch 8", 0.05), (2, "n", "batch 8", -0.1))]
    text = scaling_report_markdown([], [], design)
    assert ("*mula-7b-a1b@laptop on cpu*, a held-out design chosen before measuring: the model was calibrated on "
            "1 batch 16, 2 EP=1 batch 16, 2 EP=n batch 16 and predicted 2 EP=1 batch 8, 2 EP=n batch 8") in text
    assert "max 10%, mean 7.5% over 2 points, within the 15% target" in text
    chunked = [{**r, "overlap": "chunks"} for r in PREDICTED[:6]]
    text = scaling_report_markdown([], chunked, [])
    assert "overlaps what the ZeRO-1 step overlapped (parallel.overlap_grad_sync)" in text
    assert "no overlap of communication with compute" not in text
    sharded = [{**r, "overlap": "layers", "dp_shard": 384} for r in PREDICTED[:6]]
    text = scaling_report_markdown([], sharded, [])
    assert ("prices what our training step does: every layer's weights sharded in blocks of 384 tiles, "
            "replicated over the blocks") in text


def test_report_lists_every_design_point_with_its_error_and_the_load():
    def row(devices, ep, setting, role, step, **extra):
        return {**_point(devices, step), "ep": ep, "setting": setting, "role": role,
                "run_id": f"EP={'n' if ep == devices else ep} {setting}", **extra}

    measured = [row(1, 1, "batch 16", "fitted", 1.0, cpu_wait=0.0), row(2, 2, "batch 16", "fitted", 0.6, cpu_wait=0.04),
                row(1, 1, "batch 8", "fitted", 0.5, cpu_wait=0.01), row(2, 2, "batch 8", "held-out", 0.4, cpu_wait=0.25)]
    measured.insert(1, {**measured[0], "run_id": "EP=1 batch 16"})  # the one-rank base repeats in every EP sweep
    model = [{**m, "machine": "cpu", "step_s": m["step_s"] * f, "a2a_s": 0.01} for m, f in
             zip(measured, (1.1, 1.1, 0.95, 1.0, 1.3))]
    text = scaling_report_markdown(measured, model, HOLDOUT)
    assert ("Every measured point of *mula-7b-a1b@laptop on cpu*, fitted or held out (the model's step-time "
            "error: fitted points at most 10%, held-out at most 30%). While the kept passes ran, a rank waited for a core for at most 25% "
            "of its pass") in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 rank ") or line.startswith("| 2 ranks ")]
    assert rows == ["| 1 rank batch 16 | fitted | 1 | 1.1 | +10.0% | 0.1 / 0.01 | 0.0% |",
                    "| 2 ranks EP=n batch 16 | fitted | 0.6 | 0.57 | -5.0% | 0.06 / 0.01 | 4.0% |",
                    "| 1 rank batch 8 | fitted | 0.5 | 0.5 | +0.0% | 0.05 / 0.01 | 1.0% |",
                    "| 2 ranks EP=n batch 8 | held-out | 0.4 | 0.52 | +30.0% | 0.04 / 0.01 | 25% |"]
    assert "Every measured point" not in scaling_report_markdown(MEASURED, PREDICTED, HOLDOUT)  # no roles: none


def test_a_long_note_stays_inside_its_figure():
    """Nothing lost, class 11: a figure drawn as a note (its data absent) wraps its text within
    the frame instead of running past the figure's edges."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from stages.scaling_figure import note_figure

    fig = note_figure("no ablation in the store (the registry's ablation-* runs, or bench/distributed.py "
                      "--suites ablation, then --ingest) " * 2)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    (text,) = fig.axes[0].texts
    box = text.get_window_extent(canvas.get_renderer())
    assert 0 <= box.x0 < box.x1 <= fig.bbox.width and 0 <= box.y0 < box.y1 <= fig.bbox.height
