"""Stage ``figures``: every figure, drawn from the results store alone.

    from stages.figures import FiguresConfig, FiguresInputs, FiguresOutputs, run_figures

    result = run_figures(FiguresConfig(), FiguresInputs(store=Path("results/store.zarr")),
                         FiguresOutputs(out_dir=Path("results/figures")))
    result.paths    # every name of FIGURES (or of config.only), in FIGURES' order
    result.skipped  # {"expert_load.png": "no MoE run in the store"}: drawn as a note instead

Every name in FIGURES (``FiguresConfig(only=("scaling.png",))``: those named) is always written,
so a Snakemake rule can declare it: a figure whose data is absent is drawn as a centred note and
listed in ``skipped`` with the reason. ``FIGURE_READS`` says which stages' data each figure reads,
so the workflow builds one figure after those stages only (workflow/rules/report.smk).
Runs are ``config.runs`` or else every completed training run (one with a ``train`` table), in
creation order; a run keeps its colour across figures. The strong-scaling figures are drawn
from the scaling study's runs instead (stages/scaling_figure.read_scaling: run ``perfmodel``, or
the `optimus scaling` runs); ``scaleup.png`` draws the MoE runs among them (stages/scaleup.py).
PNGs are drawn with the Agg canvas (no pyplot, no global backend) and written atomically.
The output directory is the figures' own (optimus_core.outputs): absent, empty, or holding figures
and the marker of an earlier call; a directory of anything else is refused before anything is drawn.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Optional, Union

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from optimus_core.validation import Validated
from optimus_core.atomic import atomic_open
from optimus_core.outputs import check_output, mark_output_in_place
from optimus_core.store import ResultsStore, StoreKeyError, open_store
from stages.downstream_figure import downstream_figure
from stages.scaleup import scaleup_figure, scaleup_runs
from stages.scaling_figure import breakdown_figure, centred, note_figure, read_scaling, scaling_figure

# File name -> caption; the report embeds them in this order.
FIGURES = {
    "loss.png": "Training loss (thin: per step, thick: EMA) and held-out loss (markers) vs tokens",
    "scaleup.png": "Scale-up: training loss (thin: per step, thick: EMA) and held-out loss during training vs "
                   "tokens (log scale) of the MoE models, smallest first (Mula-7B-A1B, the reference, and the scale-up "
                   "models Mula-20B-A2B, -100B-A7B, -220B-A10B), labelled with total / active parameters",
    "heldout.png": "Held-out loss per corpus source during training (stars: the evaluate stage, per checkpoint)",
    "throughput.png": "Training throughput (tokens/s) per step",
    "expert_load.png": "Fraction of tokens routed to each expert at the last logged step, and load imbalance",
    "eval_table.png": "Final evaluation per run: held-out loss per source (nats) and downstream accuracy +- stderr",
    "downstream.png": "Downstream accuracy against training tokens, per task (the paper's metric of each) and their "
                      "average, every evaluated checkpoint, beside the reference models' published numbers (open)",
    "scaling.png": "Strong-scaling efficiency vs devices: measured sweeps (markers; open: held out from the "
                   "model's calibration, with the model's error), the calibrated performance model (lines), the "
                   "paper's Mula-220B-A10B sweep predicted on Aurora, and the paper's ~90% at 12288 tiles (star)",
    "scaling_breakdown.png": "Where a step's time goes per device count: measured (M) and modelled (P, hatched) "
                             "compute, expert all-to-all, gradient sync, optimizer and idle",
    "ablation.png": "The paper's ablation: training tokens/s of our kernels over the per-expert loop, of the "
                    "EP-aware optimizer over the paper's baseline (dp_sharded), and their product, per layout "
                    "of the registry's ablation runs (the authors' A/B) and of the 2-GPU benchmark "
                    "(bench/distributed.py); dashed: the paper's 1.71x",
}
SCALING_FIGURES = ("scaling.png", "scaling_breakdown.png")  # drawn from the scaling study, not training runs
BENCH_FIGURES = ("ablation.png",)  # drawn from the ablation runs and the ingested GPU benchmarks (bench-* runs)
# The paper's ablation (arXiv 2604.00785, as ../shared/DESIGN.md cites it): kernels and EP-aware
# optimizer together, "up to 1.71x faster training".
PAPER_ABLATION_SPEEDUP = 1.71
ABLATION_ARMS = ("kernels", "optimizer", "both")  # each arm's speedup, and their product
# What each figure reads from the store, so that a workflow can build one figure after only the
# stages it needs: "training" (the training runs' train / eval tables), "evaluation" (the evaluate
# stage's heldout / downstream tables), "scaling" (the scaling study: perfmodel, `optimus scaling`),
# "bench" (the GPU benchmark results ingested into the store), "scaleup" (the training runs of the
# MoE models only: the scale-up runs and their reference, stages/scaleup.py), "reference" (the
# reference models' published scores, stages/reference.py).
FIGURE_READS = {
    "loss.png": ("training",),
    "scaleup.png": ("scaleup",),
    "heldout.png": ("training", "evaluation"),
    "throughput.png": ("training",),
    "expert_load.png": ("training",),
    "eval_table.png": ("training", "evaluation"),
    "downstream.png": ("training", "evaluation", "reference", "downstream"),
    "scaling.png": ("scaling",),
    "scaling_breakdown.png": ("scaling",),
    "ablation.png": ("bench", "ablation"),
}
DASH = "–"  # a value the store does not have


@dataclass(frozen=True)
class FiguresConfig(Validated):
    _section: ClassVar[str] = "figures"

    runs: Optional[tuple[str, ...]] = None  # None: every completed run
    only: Optional[tuple[str, ...]] = None  # names of FIGURES to draw; None: all of them
    smoothing: float = 0.9  # EMA weight of the past for the smoothed training loss; 0 = none
    log_x: bool = False  # tokens on a log axis
    dpi: int = 120
    skip_damaged: bool = False  # read the store's healthy runs, naming the damaged ones left out

    def check(self) -> None:
        self._require(0 <= self.smoothing < 1, "smoothing", "must be in [0, 1)")
        self._require(self.dpi >= 10, "dpi", "must be >= 10")
        if self.only is not None:
            self._require(len(self.only) > 0 and all(name in FIGURES for name in self.only), "only",
                          f"must name figures among {', '.join(FIGURES)}")


@dataclass(frozen=True)
class FiguresInputs:
    store: Path


@dataclass(frozen=True)
class FiguresOutputs:
    out_dir: Path


@dataclass
class FiguresResult:
    paths: list[Path]
    skipped: dict[str, str] = field(default_factory=dict)  # file name -> why it is only a note


def run_figures(config: FiguresConfig, inputs: FiguresInputs, outputs: FiguresOutputs) -> FiguresResult:
    data = _Data(open_store(inputs.store, mode="r", skip_damaged=config.skip_damaged), config)
    out, store = Path(outputs.out_dir), Path(inputs.store)
    if out.resolve() == store.resolve() or store.resolve() in out.resolve().parents:
        raise FileExistsError(f"figures output {out} is {'the' if out.resolve() == store.resolve() else 'inside the'} "
                              f"results store {store}: the figures would be written into the store; choose an --out "
                              f"outside it")
    # The directory is the figures' own: figures are drawn into it one at a time (a workflow draws
    # each after its stages), so it holds any of FIGURES and the marker, and nothing of the user's.
    check_output(out, "figures", [store], recognise=lambda p: all(e.name in FIGURES for e in p.iterdir()))
    out.mkdir(parents=True, exist_ok=True)
    mark_output_in_place(out, "figures", {"store": store.resolve()})
    draw: dict[str, Callable[[_Data], Union[Figure, str]]] = {
        "loss.png": _loss, "scaleup.png": _scaleup, "heldout.png": _heldout,
        "throughput.png": _throughput, "expert_load.png": _expert_load, "eval_table.png": _eval_table,
        "downstream.png": lambda d: downstream_figure(d.store, d.runs, d.colour),
        "scaling.png": _scaling, "scaling_breakdown.png": _scaling_breakdown, "ablation.png": _ablation,
    }
    result = FiguresResult(paths=[])
    for name in FIGURES:
        if config.only is not None and name not in config.only:
            continue
        needs_training = name not in SCALING_FIGURES + BENCH_FIGURES
        fig = draw[name](data) if data.runs or not needs_training else "no completed run in the store"
        if isinstance(fig, str):
            result.skipped[name] = fig
            fig = note_figure(fig)
        path = out / name
        with atomic_open(path, "wb") as f:
            fig.savefig(f, format="png", dpi=config.dpi)  # a bare Figure saves PNGs with Agg
        result.paths.append(path)
    return result


def select_runs(store: ResultsStore, runs: Optional[tuple[str, ...]]) -> list[str]:
    """``runs`` as given (each must exist), or else every completed training run (one with a
    ``train`` table; not a scaling sweep, a benchmark or the performance model) in creation order."""
    if runs is None:
        table = store.runs()
        done = table.loc[table["status"] == "completed", "run_id"].tolist()
        return [r for r in done if "train" in store.tables(r)]
    for run_id in runs:
        store.attrs(run_id)  # raises StoreKeyError listing the known runs
    return list(runs)


class _Data:
    """The selected runs, their colours, and their tables read once each."""

    def __init__(self, store: ResultsStore, config: FiguresConfig):
        self.store, self.config = store, config
        self.runs = select_runs(store, config.runs)
        self.colour = {run_id: f"C{i % 10}" for i, run_id in enumerate(self.runs)}
        self._tables: dict[tuple[str, str], Optional[pd.DataFrame]] = {}
        self._scaling: Optional[tuple[list[dict], list[dict], list[dict]]] = None

    def scaling(self) -> tuple[list[dict], list[dict], list[dict]]:
        """(measured, predicted, holdout) of the scaling study, read once."""
        if self._scaling is None:
            self._scaling = read_scaling(self.store)
        return self._scaling

    def table(self, run_id: str, table: str, *needs: str) -> Optional[pd.DataFrame]:
        """The table, or None when it is absent or lacks a finite value in any column ``needs``."""
        if (run_id, table) not in self._tables:
            try:
                self._tables[run_id, table] = self.store.metrics(run_id, table)
            except StoreKeyError:
                self._tables[run_id, table] = None
        frame = self._tables[run_id, table]
        if frame is None or any(c not in frame or not np.isfinite(frame[c]).any() for c in needs):
            return None
        return frame


def _loss(data: _Data) -> Union[Figure, str]:
    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    drawn = False
    for run_id in data.runs:
        colour = data.colour[run_id]
        train = data.table(run_id, "train", "tokens", "loss")
        if train is not None:
            ema = train["loss"].ewm(alpha=1 - data.config.smoothing, ignore_na=True).mean()
            ax.plot(train["tokens"], train["loss"], color=colour, alpha=0.25, lw=0.8)
            ax.plot(train["tokens"], ema, color=colour, lw=1.8, label=run_id)
            drawn = True
        evals = data.table(run_id, "eval", "tokens", "loss")
        if evals is not None:
            ax.plot(evals["tokens"], evals["loss"], "o", color=colour, mec="black", ms=5,
                    label=f"{run_id} (held-out)")
            drawn = True
    if not drawn:
        return "no run has 'tokens' and 'loss' in its train or eval table"
    ax.set(xlabel="tokens", ylabel="loss", title="Pretraining loss")
    if data.config.log_x:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _scaleup(data: _Data) -> Union[Figure, str]:
    runs = scaleup_runs(data.store, data.runs)
    return scaleup_figure(data.store, runs, data.colour, data.config.smoothing)


def _heldout(data: _Data) -> Union[Figure, str]:
    panels = []
    for run_id in data.runs:
        evals = data.table(run_id, "eval", "tokens")
        sources = sorted(c[5:] for c in evals.columns if c.startswith("loss.")) if evals is not None else []
        if sources:
            panels.append((run_id, evals, sources))
    if not panels:
        return "no run has per-source held-out losses (eval table, loss.<source> columns)"
    all_sources = sorted({s for _, _, sources in panels for s in sources})
    colour = {s: f"C{i % 10}" for i, s in enumerate(all_sources)}
    ncols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5 * ncols, 3.8 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharey=True, squeeze=False).ravel()
    for ax, (run_id, evals, sources) in zip(axes, panels):
        final = data.table(run_id, "heldout", "tokens")
        for source in sources:
            ax.plot(evals["tokens"], evals[f"loss.{source}"], "o-", ms=3, color=colour[source], label=source)
            if final is not None and f"loss.{source}" in final:
                # one star per evaluated checkpoint (`optimus evaluate --all-checkpoints`), dashed between
                ax.plot(final["tokens"], final[f"loss.{source}"], "*--", ms=11, lw=0.8, color=colour[source],
                        mec="black")
        ax.set(title=run_id, xlabel="tokens", ylabel="held-out loss")
        if data.config.log_x:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    return fig


def _throughput(data: _Data) -> Union[Figure, str]:
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    drawn = False
    for run_id in data.runs:
        train = data.table(run_id, "train", "tokens_per_s")
        if train is not None:
            median = np.nanmedian(train["tokens_per_s"])
            ax.plot(train["step"], train["tokens_per_s"], color=data.colour[run_id], lw=1,
                    label=f"{run_id} (median {median:,.0f})")
            drawn = True
    if not drawn:
        return "no run has 'tokens_per_s' in its train table"
    ax.set(xlabel="step", ylabel="tokens / s", title="Training throughput")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _expert_load(data: _Data) -> Union[Figure, str]:
    moe = [r for r in data.runs if data.table(r, "train") is not None
           and "expert_load" in data.store.columns(r, "train")]
    if not moe:
        return "no MoE run in the store"
    fig = Figure(figsize=(12, 3.6 * len(moe)), layout="constrained")
    axes = fig.subplots(len(moe), 2, squeeze=False, width_ratios=(3, 2))
    for (heat_ax, line_ax), run_id in zip(axes, moe):
        load = data.store.array(run_id, "train", "expert_load")
        logged = np.flatnonzero(np.isfinite(load).any(axis=tuple(range(1, load.ndim))))
        train = data.table(run_id, "train")
        if len(logged):
            last = np.atleast_2d(load[logged[-1]])  # (layers, experts)
            image = heat_ax.imshow(last, aspect="auto", cmap="viridis", interpolation="nearest")
            fig.colorbar(image, ax=heat_ax, label="fraction of tokens")
            heat_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            heat_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            heat_ax.set(xlabel="expert", ylabel="layer",
                        title=f"{run_id}: expert load at step {train['step'].iloc[logged[-1]]} "
                              f"(uniform = {1 / last.shape[-1]:.3g})")
        else:
            centred(heat_ax, f"{run_id}: expert_load never logged")
        if data.table(run_id, "train", "moe_imbalance") is not None:
            line_ax.plot(train["step"], train["moe_imbalance"], color=data.colour[run_id])
            line_ax.axhline(1.0, color="grey", ls="--", lw=0.8)
            line_ax.set(xlabel="step", ylabel="max / mean tokens per expert", title="load imbalance")
            line_ax.grid(alpha=0.3)
        else:
            centred(line_ax, f"{run_id}: no moe_imbalance logged")
    return fig


def evaluation_table(store: ResultsStore, run_ids: list[str]) -> tuple[list[str], list[list[str]]]:
    """(column headers, one row of cells per run): the last ``heldout`` row's loss overall and per
    source, and the last ``downstream`` row's ``acc`` +- ``acc_stderr`` per task; DASH where a
    run lacks a value. No columns when no run has either table (the figure and the report share it)."""
    values: dict[str, dict[str, float]] = {}
    for run_id in run_ids:
        row: dict[str, float] = {}
        for table, wanted in (("heldout", ("loss",)), ("downstream", ("acc", "acc_stderr"))):
            try:
                frame = store.metrics(run_id, table)
            except StoreKeyError:
                continue
            if len(frame):
                last = frame.iloc[-1]
                row.update({c: float(last[c]) for c in frame.columns
                            if c.split(".", 1)[0] in wanted and np.isfinite(last[c])})
        values[run_id] = row
    keys = {k for row in values.values() for k in row}
    losses = (["loss"] if "loss" in keys else []) + sorted(k for k in keys if k.startswith("loss."))
    tasks = sorted(k[4:] for k in keys if k.startswith("acc."))
    if not losses and not tasks:
        return [], []
    headers = [("loss (all)" if k == "loss" else f"loss {k[5:]}") for k in losses]
    headers += [f"{t.removeprefix('optimus_')} acc" for t in tasks]

    def num(x: Optional[float], spec: str) -> str:
        return DASH if x is None or not math.isfinite(x) else format(x, spec)

    rows = []
    for run_id in run_ids:
        row = values[run_id]
        cells = [num(row.get(k), ".4f") for k in losses]
        for t in tasks:
            acc, err = row.get(f"acc.{t}"), row.get(f"acc_stderr.{t}")
            cells.append(num(acc, ".3f") + ("" if acc is None or err is None else f" ± {num(err, '.3f')}"))
        rows.append(cells)
    return headers, rows


def _eval_table(data: _Data) -> Union[Figure, str]:
    headers, rows = evaluation_table(data.store, data.runs)
    if not headers:
        return "no run has a heldout or downstream table (run `optimus evaluate`)"
    fig = Figure(figsize=(min(2.2 + 1.25 * len(headers), 30), 1.2 + 0.35 * (len(rows) + 1)))
    ax = fig.add_subplot()
    ax.axis("off")
    table = ax.table(cellText=rows, rowLabels=data.runs, colLabels=[h.replace(" ", "\n", 1) for h in headers],
                     loc="center", cellLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.scale(1, 1.6)
    for (r, _), cell in table.get_celld().items():
        if r == 0:
            cell.set_height(cell.get_height() * 1.6)  # two-line headers
    fig.suptitle("Final evaluation (held-out loss in nats; accuracy ± stderr)", fontsize=10)
    fig.tight_layout()
    return fig


def _scaling(data: _Data) -> Union[Figure, str]:
    measured, predicted, _ = data.scaling()
    if not measured and not predicted:
        return "no scaling points in the store (run `optimus scaling` and `optimus perfmodel`)"
    return scaling_figure(measured, predicted, "Strong scaling: measured and modelled")


def _scaling_breakdown(data: _Data) -> Union[Figure, str]:
    measured, predicted, _ = data.scaling()
    if not measured and not predicted:
        return "no scaling points in the store (run `optimus scaling` and `optimus perfmodel`)"
    return breakdown_figure(measured, predicted, "Where a step's time goes (share of the step; M measured, P model)")


def ablation_speedups(store: ResultsStore) -> dict[str, dict[str, float]]:
    """{group: {"kernels": x, "optimizer": y, "both": x * y}}: tokens/s of our kernels over the
    per-expert loop and of the EP-aware optimizer over the paper's baseline (dp_sharded), each
    with the other choice as the paper runs it, and their product. Groups: each layout of the
    registry's ablation runs in the store (``<scale>-ablation-<layout>-<arm>``, arms ``loop``,
    ``fast`` and ``dp_sharded``: workflow/experiments.py; the median tokens/s of each run's steps
    after the first), and each EP degree of every ingested 2-GPU ablation benchmark
    (``bench-distributed-ablation-<device>``; at EP 1 the two optimizers are one layout: the
    kernel arm only). An arm whose runs are missing is left out, and so is the product."""
    out: dict[str, dict[str, float]] = {}
    runs = [str(r) for r in store.runs()["run_id"]]
    rates: dict[str, dict[str, float]] = {}  # "<layout> (<scale>)" -> arm -> tokens/s, in the store's order
    for run_id in runs:
        scale, _, rest = run_id.partition("-ablation-")
        layout, _, arm = rest.rpartition("-")
        if scale in ("laptop", "paper") and layout and arm in ("loop", "fast", "dp_sharded") \
                and "train" in store.tables(run_id):
            steps = store.metrics(run_id, "train")["tokens_per_s"].to_numpy()
            rate = float(np.nanmedian(steps[1:] if len(steps) > 1 else steps))
            rates.setdefault(f"{layout.upper()} ({scale})", {})[arm] = rate
    for group, rate in rates.items():
        if arms := _arms(rate.get("fast"), rate.get("loop"), rate.get("dp_sharded")):
            out[group] = arms
    for run_id in runs:
        if not run_id.startswith("bench-distributed-ablation-"):
            continue
        device, tables = run_id[len("bench-distributed-ablation-"):], set(store.tables(run_id))
        for ep in (1, 2, 4, 8):
            rate = {(b, o): float(store.metrics(run_id, name)["tokens_per_s"].iloc[-1])
                    for b in ("loop", "triton") for o in ("dp_sharded", "ep_aware")
                    if (name := f"ablation-ep{ep}-{b}-{o}") in tables}
            group = _arms(rate.get(("triton", "ep_aware")), rate.get(("loop", "ep_aware")),
                          rate.get(("triton", "dp_sharded")))
            if ep == 1:  # one layout for both optimizers
                group = {arm: v for arm, v in group.items() if arm == "kernels"}
            if group:
                out[f"{device} EP={ep}"] = group
    return out


def _arms(fast: float | None, loop: float | None, baseline: float | None) -> dict[str, float]:
    """The arms' speedups from tokens/s (None: not measured): the paper runs' execution (our
    kernels, the EP-aware optimizer: ``fast``) over the per-expert loop (``loop``) and over the
    paper's baseline optimizer (``baseline``), and with both their product."""
    out = {}
    if fast and loop:
        out["kernels"] = fast / loop
    if fast and baseline:
        out["optimizer"] = fast / baseline
    if len(out) == 2:
        out["both"] = out["kernels"] * out["optimizer"]
    return out


def _ablation(data: _Data) -> Union[Figure, str]:
    groups = ablation_speedups(data.store)
    if not groups:
        return ("no ablation in the store (the registry's ablation-* runs, or bench/distributed.py --suites "
                "ablation, then --ingest)")
    fig = Figure(figsize=(max(8, 1.6 * len(groups)), 4.5))
    ax = fig.add_subplot()
    width = 0.8 / len(ABLATION_ARMS)
    for i, arm in enumerate(ABLATION_ARMS):
        xs = [g + (i - (len(ABLATION_ARMS) - 1) / 2) * width for g in range(len(groups))]
        ys = [speedups.get(arm, float("nan")) for speedups in groups.values()]
        bars = ax.bar(xs, ys, width, label={"both": "product"}.get(arm, arm), color=f"C{i}")
        ax.bar_label(bars, labels=[f"{y:.2f}x" if np.isfinite(y) else "" for y in ys], fontsize=7)
    ax.axhline(PAPER_ABLATION_SPEEDUP, ls="--", color="dimgrey",
               label=f"paper: up to {PAPER_ABLATION_SPEEDUP}x (both, on Aurora)")
    ax.set_xticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_ylabel("training tokens/s over the arm's baseline")
    ax.set_ylim(0, 1.4 * max(max(max(v.values()) for v in groups.values()), PAPER_ABLATION_SPEEDUP))
    ax.set_title("Ablation: our kernels over the per-expert loop, the EP-aware optimizer over the paper's "
                 "baseline", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncol=4)
    fig.tight_layout()
    return fig



