"""The strong-scaling figures and report section: measured points beside the performance model.

    from stages.scaling_figure import draw_scaling, draw_breakdown, scaling_report_markdown
    draw_scaling(measured, predicted, Path("results/figures/scaling.png"), "Strong scaling")
    draw_breakdown(measured, predicted, Path("results/figures/scaling_breakdown.png"), "Step time")
    text = scaling_report_markdown(measured, predicted, holdout)

Inputs are plain dicts: ``measured`` the points `optimus scaling` writes (preset, device,
devices, ep, optimizer, step_s, compute_s, a2a_s, grad_sync_s, optimizer_s, idle_s,
efficiency), ``predicted`` the rows of workflow/perfmodel/ (``predict_sweep`` /
``predict_points``: the same fields plus ``machine``), ``holdout`` the rows of
``perfmodel.holdout_error`` (measured_s, predicted_s, rel_error; workflow/scaling_study.py adds
``sweep``, ``run_id`` and ``fit_devices``, the device counts the model was calibrated on). The
stages read them from the results store; nothing here computes a model.

``read_scaling(store)`` reads the three lists back from the results store: run ``perfmodel``
(written by `optimus perfmodel`, workflow/scaling_study.py: tables ``measured``, ``predicted``,
``holdout``, the strings of row i in its attrs ``strings.<table>[i]``), or, without that run, the
measured points of every completed `optimus scaling` run (kind ``scaling``) and no model.

A series is one sweep: measured points of one (preset, device, optimizer) or predicted rows of
one (preset, machine, optimizer); rows carrying a ``run_id`` (a scaling run, or a sweep name of
the perfmodel run) only join rows of the same id. A measured row with ``role`` "held-out" was not
used to calibrate the model drawn beside it: the figure draws it as an open marker with the
model's step-time error beside it, and the report names the design (what was fitted, what held
out) with the error of each held-out point. The paper's headline (about
90 % strong-scaling efficiency of Mula-220B-A10B from 384 to 12288 tiles, its abstract) is drawn
as a reference mark. ``scaling_figure`` / ``breakdown_figure`` return bare Figures (the figures
stage saves them); ``draw_*`` save PNGs with the Agg canvas (no pyplot), atomically.
"""
from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional, Sequence

from matplotlib.figure import Figure

from optimus_core.atomic import atomic_open

# The paper's reported strong scaling (arXiv 2604.00785, abstract): ~90 % from 384 to 12288 tiles.
PAPER = {"preset": "mula-220b-a10b", "base_tiles": 384, "tiles": 12288, "efficiency": 0.90}
PHASES = ("compute_s", "a2a_s", "grad_sync_s", "optimizer_s", "idle_s")
PHASE_LABELS = {"compute_s": "compute", "a2a_s": "expert all-to-all", "grad_sync_s": "gradient sync",
                "optimizer_s": "optimizer", "idle_s": "idle (host, pipeline bubble)"}
PHASE_COLOURS = {"compute_s": "C0", "a2a_s": "C1", "grad_sync_s": "C2", "optimizer_s": "C4", "idle_s": "0.6"}
HOLDOUT_TARGET = 0.15  # issue 8: held-out prediction error at most 15 %


PERFMODEL_RUN = "perfmodel"


def read_scaling(store) -> tuple[list[dict], list[dict], list[dict]]:
    """(measured, predicted, holdout) from an open results store (module doc)."""
    from optimus_core.store import StoreKeyError

    runs = store.runs()
    status = dict(zip(runs["run_id"], runs["status"]))
    if status.get(PERFMODEL_RUN) == "completed":
        attrs = store.attrs(PERFMODEL_RUN)
        strings = attrs.get("strings") or {}
        out = []
        for table in ("measured", "predicted", "holdout"):
            labels = strings.get(table) or []
            try:
                frame = store.metrics(PERFMODEL_RUN, table) if labels else None
            except StoreKeyError:
                frame = None
            rows = [] if frame is None else frame.iloc[:len(labels)].to_dict("records")
            out.append([{**{k: v for k, v in row.items() if k != "step" and v == v}, **label}  # v == v: not NaN
                        for row, label in zip(rows, labels)])
        return out[0], out[1], out[2]
    measured = []
    for run_id, st in status.items():
        attrs = store.attrs(run_id)
        if st != "completed" or attrs.get("kind") != "scaling" or "scaling" not in store.tables(run_id):
            continue
        optimizers = attrs.get("optimizers") or {}
        settings, roles = attrs.get("settings") or [], attrs.get("roles") or []  # per row (stages/scaling.py)
        for i, row in enumerate(store.metrics(run_id, "scaling").to_dict("records")):
            n = int(row["devices"])
            setting = settings[i] if i < len(settings) and len(set(settings)) > 1 else ""
            measured.append({**{k: v for k, v in row.items() if k != "step"}, "devices": n,
                             "run_id": f"{run_id} {setting}".strip(),
                             **({"role": roles[i]} if i < len(roles) and roles[i] else {}),
                             "preset": attrs.get("preset", "?"), "device": attrs.get("device", "?"),
                             "optimizer": optimizers.get(str(n), attrs.get("optimizer", ""))})
    return measured, [], []


def _where(row: dict) -> str:
    """The hardware of a row: a measured point's device, a prediction's machine, its pipeline
    stages where it has some (and its what-if or design scenario, e.g. "overlap grad_sync", so
    a scenario never joins the plain sweep)."""
    where = str(row.get("device") or row.get("machine") or "?")
    pp = float(row.get("pp") or 1)
    where += f" PP {int(pp)}" if pp > 1 else ""  # (NaN, a row without stages: not > 1)
    return f"{where}, {row['scenario']}" if row.get("scenario") else where


def series(rows: Iterable[dict]) -> dict[tuple[str, str, str], list[dict]]:
    """Rows grouped into sweeps by (preset, device or machine, optimizer of the multi-rank rows),
    each sorted by device count; rows that carry a ``run_id`` (one `optimus scaling` run each)
    are only grouped with rows of the same run, whose id then ends the label. A one-rank row
    ("local" optimizer) joins every sweep of its run that it is the base of."""
    rows = list(rows)
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)

    def run_key(r: dict) -> tuple[str, str]:
        where = _where(r) + (f" [{r['run_id']}]" if r.get("run_id") else "")
        return r["preset"], where

    multi: dict[tuple[str, str], set] = {run_key(r): set() for r in rows}
    for r in rows:
        if int(r["devices"]) > 1:
            multi[run_key(r)].add(str(r.get("optimizer", "")))
    for r in rows:
        key = run_key(r)
        opts = sorted(multi[key]) or [str(r.get("optimizer", ""))]
        mine = [str(r.get("optimizer", ""))] if int(r["devices"]) > 1 else opts  # base row: every sweep
        for opt in mine:
            groups[(*key, opt)].append(r)
    return {k: sorted(v, key=lambda r: int(r["devices"])) for k, v in groups.items()}


def _efficiencies(rows: Sequence[dict]) -> list[float]:
    """Each row's efficiency against the sweep's smallest device count (recomputed, so a series
    is self-consistent even when its rows came from different runs)."""
    base = rows[0]
    return [base["step_s"] * int(base["devices"]) / (r["step_s"] * int(r["devices"])) for r in rows]


def _label(key: tuple[str, str, str]) -> str:
    preset, where, opt = key
    return f"{preset} on {where}" + (f" ({opt})" if opt and opt != "local" else "")


def note_figure(text: str) -> Figure:
    """A figure that is only ``text`` (its data absent), centred, wrapped within its frame."""
    fig = Figure(figsize=(6, 3))
    centred(fig.add_subplot(), text)
    return fig


def centred(ax, text: str, width: int = 60) -> None:
    """``text`` in the middle of ``ax``, wrapped at ``width`` characters so that it stays inside
    the axes (a long note would run past the figure's edges and be clipped), no ticks."""
    ax.text(0.5, 0.5, textwrap.fill(text, width), ha="center", va="center", transform=ax.transAxes,
            color="dimgrey")
    ax.set_xticks([])
    ax.set_yticks([])


def _save(fig: Figure, out_png: Path, dpi: int) -> Path:
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(out_png, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi)
    return out_png


def draw_scaling(measured: list[dict], predicted: list[dict], out_png: Path, title: str = "Strong scaling",
                 dpi: int = 120) -> Path:
    """``scaling_figure`` written to ``out_png`` as a PNG."""
    return _save(scaling_figure(measured, predicted, title), out_png, dpi)


def draw_breakdown(measured: list[dict], predicted: list[dict], out_png: Path, title: str = "Where a step's time goes",
                   dpi: int = 120, share: bool = True) -> Path:
    """``breakdown_figure`` written to ``out_png`` as a PNG."""
    return _save(breakdown_figure(measured, predicted, title, share), out_png, dpi)


def scaling_figure(measured: list[dict], predicted: list[dict], title: str = "Strong scaling") -> Figure:
    """Efficiency vs device count (log2 axes) in two panels: the paper's sweep (its preset: the
    model's sweeps in each design and what-if, its measured points where there are any, the
    paper's ~90 % at 12288 tiles), and the calibration sweeps (every other preset: measured sweeps
    as markers, the model beside each as a line, held-out points open with the model's error
    beside them). A panel with no row is left out; with no row at all, a note says so."""
    if not measured and not predicted:
        return note_figure("no measured or predicted scaling points")

    def of_paper(rows, want):
        return [r for r in rows if (r["preset"] == PAPER["preset"]) == want]

    panels = [(name, of_paper(measured, want), of_paper(predicted, want))
              for name, want in ((f"The paper's sweep: {PAPER['preset']}", True), ("Calibration sweeps", False))]
    panels = [p for p in panels if p[1] or p[2]]
    fig = Figure(figsize=(7.5 * len(panels), 7.5), layout="constrained")
    colour = {}
    for i, key in enumerate(sorted({k[:2] for k in {**series(measured), **series(predicted)}})):
        colour[key] = f"C{i % 10}"
    for ax, (name, panel_measured, panel_predicted) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        _efficiency_panel(ax, panel_measured, panel_predicted, colour, paper=name.startswith("The paper's"))
        ax.set_title(name, fontsize="medium")
        ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=1)
    fig.suptitle(title)
    return fig


def _efficiency_panel(ax, measured: list[dict], predicted: list[dict], colour: dict, paper: bool) -> None:
    """One panel of scaling_figure: the model's sweeps as lines, the measured ones as markers
    (held-out points open, the model's error beside them), the paper's point where ``paper``."""
    for key, rows in series(predicted).items():
        xs = [int(r["devices"]) for r in rows]
        ax.plot(xs, _efficiencies(rows), "-", lw=1.8, color=colour[key[:2]], label=f"model: {_label(key)}")
    model_of = {(r.get("run_id"), r["preset"], int(r["devices"])): r for r in predicted if r.get("run_id")}
    held_labelled = False
    notes_at: dict[int, int] = defaultdict(int)  # error notes already written at a device count: stack them
    for key, rows in series(measured).items():
        xs = [int(r["devices"]) for r in rows]
        effs = _efficiencies(rows)
        held = [r.get("role") == "held-out" for r in rows]
        # Fitted points filled; held-out ones open (the model was calibrated without them), each
        # with the model's step-time error written beside it.
        filled = [i for i, h in enumerate(held) if not h]
        ax.plot(xs, effs, ":" if len(rows) > 1 else "none", color=colour[key[:2]], label=f"measured: {_label(key)}",
                marker="o" if filled else "none", ms=7, mec="black", markevery=filled or None)
        for x, e, r, h in zip(xs, effs, rows, held):
            if not h:
                continue
            ax.plot([x], [e], "o", ms=9, mfc="none", mec=colour[key[:2]], mew=2,
                    label="held out (open): predicted, not fitted" if not held_labelled else None)
            held_labelled = True
            model = model_of.get((r.get("run_id"), r["preset"], x))
            if model is not None:
                ax.annotate(f"{model['step_s'] / r['step_s'] - 1:+.0%}", (x, e), textcoords="offset points",
                            xytext=(8 + 22 * notes_at[x], -3), fontsize=7, color=colour[key[:2]])
                notes_at[x] += 1
    if paper:
        ax.plot([PAPER["tiles"]], [PAPER["efficiency"]], "*", ms=16, color="gold", mec="black", zorder=5,
                label=f"paper: ~{PAPER['efficiency']:.0%} at {PAPER['tiles']} tiles (base {PAPER['base_tiles']})")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="devices (ranks / tiles, log2)", ylabel="strong-scaling efficiency  T(base)·base / (T(n)·n)")
    top = max([1.05] + [e for rows in series(measured).values() for e in _efficiencies(rows)])
    ax.set_ylim(0, min(top * 1.05, 2.0))
    ax.grid(alpha=0.3, which="both")


def breakdown_figure(measured: list[dict], predicted: list[dict], title: str = "Where a step's time goes",
                     share: bool = True) -> Figure:
    """Stacked bars of step-time phases per device count, one panel per (preset, hardware): the
    measured bar (M) and the model's (P) side by side where both exist. ``share``: phases as a
    fraction of the step (each bar's step time written above it), else seconds."""
    panels: dict[tuple[str, str], dict[int, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for kind, rows in (("M", measured), ("P", predicted)):
        for key, ser in series(rows).items():
            for r in ser:  # one bar per (panel, devices, kind): the first series wins on a tie
                panels[key[:2]][int(r["devices"])].setdefault(kind, r)
    if not panels:
        return note_figure("no measured or predicted scaling points")
    n = len(panels)
    ncols = min(n, 2)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(7 * ncols, 4.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, ((preset, where), by_devices) in zip(axes, sorted(panels.items())):
        devices = sorted(by_devices)
        width = 0.38
        for i, d in enumerate(devices):
            bars = by_devices[d]
            for kind, offset in (("M", -width / 2), ("P", width / 2)):
                r = bars.get(kind)
                if r is None:
                    continue
                x = i + (offset if len(bars) == 2 else 0)
                total = r["step_s"] if share else 1.0
                bottom = 0.0
                for ph in PHASES:
                    h = max(0.0, float(r.get(ph) or 0.0)) / total
                    ax.bar(x, h, width, bottom=bottom, color=PHASE_COLOURS[ph],
                           hatch="//" if kind == "P" else None, edgecolor="black", lw=0.5,
                           label=PHASE_LABELS[ph] if (i, kind) == (0, "M") or
                           (i == 0 and kind == "P" and "M" not in bars) else None)
                    bottom += h
                ax.text(x, bottom, f"{kind}\n{r['step_s']:.3g}s", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(devices)), [str(d) for d in devices])
        ax.set(xlabel="devices", ylabel="share of step time" if share else "seconds per step",
               title=f"{preset} on {where}  (M measured, P model: hatched)")
        if share:
            ax.set_ylim(0, 1.25)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="x-small", loc="upper right", ncols=3)
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig


# ----------------------------------------------------------------------------- report section

def _pct(x: float) -> str:
    return f"{x:.0%}" if abs(x) >= 0.1 else f"{x:.1%}"


def _phase_table(rows: Sequence[dict], where_col: bool) -> list[str]:
    head = "| " + ("hardware | " if where_col else "") + "devices | step s | " + " | ".join(
        PHASE_LABELS[p] + " s" for p in PHASES) + " | efficiency |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r, eff in zip(rows, _efficiencies(rows)):
        cells = ([_where(r)] if where_col else []) + [str(int(r["devices"])), f"{r['step_s']:.4g}"] + \
                [f"{float(r.get(p) or 0.0):.3g}" for p in PHASES] + [_pct(eff)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def paper_rows(predicted: Sequence[dict], scenario: Optional[str] = None) -> list[dict]:
    """The model's sweep of the paper's preset (the longest if several) in ``scenario`` (None:
    the plain model, no what-if), sorted by tiles."""
    rows = [r for r in predicted if r.get("scenario") == scenario]
    sweeps = [ser for key, ser in series(rows).items() if key[0] == PAPER["preset"]]
    return max(sweeps, key=len) if sweeps else []


def _whatifs(predicted: Sequence[dict]) -> list[tuple[str, list[dict]]]:
    scenarios = sorted({r["scenario"] for r in predicted if r.get("scenario")})
    return [(sc, rows) for sc in scenarios if len(rows := paper_rows(predicted, sc)) > 1]


def _scenario_line(scenario: str, rows: list[dict]) -> str:
    """The report's line for a sweep beside the plain one: a what-if of the step, or the same
    runs in another design (workflow.experiments.DESIGNS)."""
    eff = f"{_pct(_efficiencies(rows)[-1])} at {rows[-1]['devices']} tiles"
    if scenario.startswith("design "):
        first, last = rows[0], rows[-1]
        return (f"- The same runs in our design, {scenario[len('design '):]} (no pipeline, every parameter sharded in "
                f"blocks, activation checkpointing {last.get('checkpointing', '?')}): {float(first['step_s']):.3g} s a "
                f"step at {first['devices']} and {float(last['step_s']):.3g} s at {last['devices']} tiles, {eff}.")
    return (f"- What-if, {scenario}: the same model with every layer's collectives hidden (our step hides what "
            f"the other layers' compute covers) predicts {eff}.")


def drivers(rows: Sequence[dict]) -> list[str]:
    """Sentences, computed from a predicted sweep, on what costs efficiency between its ends."""
    if len(rows) < 2:
        return []
    lo, hi = rows[0], rows[-1]
    ratio = int(hi["devices"]) / int(lo["devices"])
    out = []
    ideal = lo["step_s"] / ratio
    lost = hi["step_s"] - ideal
    if lost <= 0:
        return [f"The model scales perfectly from {lo['devices']} to {hi['devices']} devices."]
    for ph in PHASES:
        extra = float(hi.get(ph) or 0) - float(lo.get(ph) or 0) / ratio
        if extra > 0.05 * lost:
            grows = "does not shrink" if float(hi.get(ph) or 0) >= 0.9 * float(lo.get(ph) or 0) else "shrinks less than the work"
            out.append(f"{PHASE_LABELS[ph]}: {float(lo.get(ph) or 0):.3g} s at {lo['devices']} and "
                       f"{float(hi.get(ph) or 0):.3g} s at {hi['devices']} devices ({grows}); it accounts for "
                       f"{_pct(extra / lost)} of the time lost to ideal scaling and {_pct(float(hi.get(ph) or 0) / hi['step_s'])} "
                       f"of the step at {hi['devices']}.")
    return out


def scaling_report_markdown(measured: list[dict], predicted: list[dict], holdout: list[dict]) -> str:
    """The report's strong-scaling section: the model at 12288 tiles beside the paper's ~90 %,
    what drives the difference, the measured sweeps and the held-out prediction error."""
    lines = ["## Strong scaling", ""]
    paper = paper_rows(predicted)
    if paper:
        eff = _efficiencies(paper)
        last, first = paper[-1], paper[0]
        lines += [
            f"The performance model (workflow/perfmodel/, machine {_where(last)}) predicts "
            f"**{_pct(eff[-1])}** strong-scaling efficiency for {PAPER['preset']} from {first['devices']} to "
            f"{last['devices']} tiles; the paper reports **~{PAPER['efficiency']:.0%}** from {PAPER['base_tiles']} to "
            f"{PAPER['tiles']} tiles.", "",
            *_phase_table(paper, where_col=False), "",
            "What drives the difference (from the predicted phases):", "",
            *[f"- {s}" for s in drivers(paper)],
            *([f"- Of the compute, the layers' all-gathers and reduce-scatters that the compute does not cover: "
               f"{float(first['exposed_sync_s']):.3g} s at {first['devices']} and {float(last['exposed_sync_s']):.3g} s "
               f"at {last['devices']} tiles."] if last.get("exposed_sync_s") is not None else []),
            *[_scenario_line(sc, rows) for sc, rows in _whatifs(predicted)],
            _overlap_note(last),
            "- Aurora's numbers are sourced or marked as assumptions in workflow/machines/aurora.yaml; the "
            "achieved compute fraction, the intra-node (Xe Link) collective bandwidth and the fraction of "
            "Slingshot line rate that collectives reach are assumptions, not measurements.", ""]
    else:
        lines += ["No model prediction of the paper's sweep is in the store.", ""]
    sweeps = series(measured)
    if sweeps:
        lines += ["Measured sweeps (`optimus scaling` here; GPU sweeps from bench/results/), with the "
                  "efficiency against each sweep's smallest device count:", ""]
        for key, rows in sweeps.items():
            lines += [f"*{_label(key)}*", "", *_phase_table(rows, where_col=False), ""]
    else:
        lines += ["No measured scaling points are in the store.", ""]
    if holdout:
        lines += _holdout_lines(holdout) + _design_lines(measured, predicted)
    else:
        lines += ["No held-out error: fewer than two device counts measured.", ""]
    return "\n".join(lines)


def _overlap_note(row: dict) -> str:
    """What the paper sweep assumes about overlap (its rows' ``overlap``: what the run's
    configuration does, workflow/perfmodel/)."""
    if row.get("overlap") == "layers":
        block = f" in blocks of {int(row['dp_shard'])} tiles, replicated over the blocks" if row.get("dp_shard") else ""
        return ("- The model prices what our training step does: every layer's weights sharded" + block + ", "
                "all-gathered in bf16 before its forward and again before its backward, its gradients "
                "reduce-scattered after it, each beside the compute of the other layers; what the compute cannot "
                "cover is exposed (inside the compute bars). The all-to-alls block inside each MoE layer.")
    tail = ("Gradient synchronisation and parameter all-gathers do not shrink with more tiles at a fixed "
            "global batch, so a step that hid them behind compute would scale closer to the paper.")
    if row.get("overlap") == "chunks":
        return ("- The model overlaps what the ZeRO-1 step overlapped (parallel.overlap_grad_sync): the gradient "
                "reduction runs, in chunks, under the last micro-batch's backward; with one sequence per micro-batch "
                "that backward is short, so most of the reduction still shows. The all-to-alls block inside each MoE "
                "layer and the parameter all-gather follows the optimizer. " + tail)
    return ("- The model assumes no overlap of communication with compute (all-to-alls block inside each MoE "
            "layer; the ZeRO-1 optimizer synchronised after the last backward). " + tail)


def _verdict(rows: Sequence[dict]) -> str:
    errs = [abs(float(h["rel_error"])) for h in rows]
    worst = max(errs)
    return (f"max {_pct(worst)}, mean {_pct(sum(errs) / len(errs))} over {len(errs)} points, "
            f"{'within' if worst <= HOLDOUT_TARGET else 'outside'} the {HOLDOUT_TARGET:.0%} target")


def _one_count(h: dict) -> bool:
    """Calibrated on one-device points only: they show no communication to fit."""
    return str(h.get("fit_devices", "")).split() == ["1"]


def _holdout_lines(holdout: Sequence[dict]) -> list[str]:
    lines = [f"Held-out prediction error (the model calibrated on each sweep's smaller device counts and tested "
             f"on its largest, or on a held-out design's fitted points and tested on its held-out ones): "
             f"{_verdict(holdout)}."]
    blind = [h for h in holdout if _one_count(h)]
    if blind and len(blind) < len(holdout):
        lines[-1] += (f" The sweeps calibrated on one device alone ({', '.join(sorted({_sweep(h) for h in blind}))}) "
                      f"fit no communication: their all-to-all and gradient-sync times are the machine file's "
                      f"uncalibrated values. Without them: {_verdict([h for h in holdout if not _one_count(h)])}.")
    elif blind:
        lines[-1] += (" Every sweep was calibrated on one device alone, which shows no communication: the "
                      "all-to-all and gradient-sync times are the machine file's uncalibrated values.")
    for fit_points, rows in _designs(holdout).items():
        held = ", ".join(f"{h['devices']} EP={'n' if h['ep'] == h['devices'] else h['ep']} "
                         f"{h.get('setting', '')}".strip() for h in rows)
        lines += ["", f"*{rows[0]['preset']} on {rows[0].get('device', '')}*, a held-out design chosen before "
                      f"measuring: the model was calibrated on {fit_points} and predicted {held}, which differ from "
                      f"every fitted point in compute per rank and communication volume (batch, micro-batches or EP "
                      f"layout): {_verdict(rows)}."]
    lines += ["", "| preset | hardware | sweep | devices | ep | optimizer | fitted on devices | measured s | "
                  "predicted s | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for h in holdout:
        fit = h.get("fit_devices") or (f"{h['fitted_on']} points" if h.get("fitted_on") else "")
        lines.append(f"| {h['preset']} | {h.get('device', '')} | {_sweep(h)} | {h['devices']} | {h.get('ep', '')} | "
                     f"{h.get('optimizer', '')} | {fit} | {h['measured_s']:.4g} | {h['predicted_s']:.4g} | "
                     f"{float(h['rel_error']):+.1%} |")
    return lines + [""]


def _design_lines(measured: Sequence[dict], predicted: Sequence[dict]) -> list[str]:
    """Every measured point with a ``role`` (a held-out design's, or a sweep's tested on its
    largest device count), per preset and hardware: fitted or held out, the model's step time and
    all-to-all beside the measured ones, and how loaded the machine was (``cpu_wait``: the share
    of its pass a rank waited for a core, stages/scaling.py)."""
    model_of = {(r.get("run_id"), r["preset"], int(r["devices"])): r for r in predicted if r.get("run_id")}
    families: dict[tuple, list[tuple[dict, dict]]] = defaultdict(list)
    seen = set()
    for r in measured:
        model = model_of.get((r.get("run_id"), r["preset"], int(r["devices"])))
        key = (r["preset"], r.get("device", ""), int(r["devices"]), int(r.get("ep", 1)), r.get("setting"), r["step_s"])
        if not r.get("role") or model is None or key in seen:  # a one-rank base sits in several sweeps
            continue
        seen.add(key)
        families[key[:2]].append((r, model))
    lines = []
    for (preset, device), rows in families.items():
        def worst(role):
            errs = [abs(m["step_s"] / r["step_s"] - 1) for r, m in rows if r["role"] == role]
            return _pct(max(errs)) if errs else "none"

        waits = [float(r["cpu_wait"]) for r, _ in rows if r.get("cpu_wait") is not None]
        load = (f" While the kept passes ran, a rank waited for a core for at most {_pct(max(waits))} of its pass "
                f"(0 on an idle machine: the rest is other work on the box)." if waits else "")
        lines += [f"Every measured point of *{preset} on {device}*, fitted or held out (the model's step-time error: "
                  f"fitted points at most {worst('fitted')}, held-out at most {worst('held-out')}).{load}", "",
                  "| point | role | measured s | model s | error | all-to-all s measured / model | "
                  "waited for a core |", "|---|---|---|---|---|---|---|"]
        for r, m in rows:
            ep = "" if int(r["devices"]) == 1 else f" EP={'n' if int(r['ep']) == int(r['devices']) else r['ep']}"
            wait = _pct(float(r["cpu_wait"])) if r.get("cpu_wait") is not None else ""
            point = f"{int(r['devices'])} rank{'s' if int(r['devices']) > 1 else ''}{ep} {r.get('setting', '')}"
            lines.append(f"| {point.strip()} | {r['role']} | {r['step_s']:.4g} | {m['step_s']:.4g} | "
                         f"{m['step_s'] / r['step_s'] - 1:+.1%} | {float(r.get('a2a_s') or 0):.3g} / "
                         f"{float(m.get('a2a_s') or 0):.3g} | {wait} |")
        lines.append("")
    return lines


def _designs(holdout: Sequence[dict]) -> dict[str, list[dict]]:
    """Held-out rows of a role design (workflow/scaling_study.study_design), by what was fitted."""
    out: dict[str, list[dict]] = defaultdict(list)
    for h in holdout:
        if h.get("fit_points"):
            out[str(h["fit_points"])].append(h)
    return out


def _sweep(h: dict) -> str:
    return str(h.get("run_id") or h.get("sweep") or "")
