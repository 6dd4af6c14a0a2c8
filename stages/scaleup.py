"""The scale-up curves and their report table (the paper's Mula-20B-A2B, -100B-A7B and -220B-A10B
to 100B tokens), from the results store alone.

    from stages.scaleup import scaleup_runs, scaleup_figure
    runs = scaleup_runs(store, run_ids)            # the MoE runs among run_ids, smallest first
    fig = scaleup_figure(store, runs, colour)      # a Figure, or a str saying why there is none

Which runs: every MoE training run among those given (attrs ``n_active_params`` < ``n_params``,
the core's analytic counts, written by the pretrain stage), ordered by total, then active
parameters. In the DAG, at laptop and at paper scale, those are the three scale-up runs and
mula-7b-a1b, their reference (workflow/experiments.scaleup_figure, what the figure's Snakemake
target waits for); a stage never reads the registry, so the store's attributes decide. Each run is
labelled with its preset (its run id where two runs share one) and its total / active counts.

The figure: training loss per step (thin) and its EMA (thick) against tokens, beside the held-out
loss during training (the run's ``eval`` table, column ``loss``: every source together). Tokens
are on a log axis: the reference trains 40x the scale-up runs' tokens at paper scale (4T against
100B) and 7.5x at laptop scale, and a linear axis would squeeze the scale-up curves into its first
few percent; the evaluation before the first step (0 tokens) is therefore not drawn. The report's
"Scale-up" table (stages/report.py) lists the same runs.
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from optimus_core.store import ResultsStore, StoreKeyError


def format_count(x: float) -> str:
    """Parameter counts as 6.92B / 1.30M / 12.3K."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return str(int(x))


def scaleup_runs(store: ResultsStore, run_ids: list[str]) -> list[str]:
    """The MoE runs among ``run_ids`` (fewer active than total parameters), smallest first."""
    sizes = {}
    for run_id in run_ids:
        a = store.attrs(run_id)
        total, active = a.get("n_params"), a.get("n_active_params")
        if total is not None and active is not None and active < total:
            sizes[run_id] = (total, active)
    return sorted(sizes, key=lambda r: (*sizes[r], run_ids.index(r)))


def labels(store: ResultsStore, runs: list[str]) -> dict[str, str]:
    """run id -> "preset: 20.4M total / 2.72M active" (the run id where presets repeat)."""
    attrs = {r: store.attrs(r) for r in runs}
    presets = [a.get("preset") for a in attrs.values()]
    out = {}
    for run_id, a in attrs.items():
        name = a.get("preset") if a.get("preset") and presets.count(a.get("preset")) == 1 else run_id
        out[run_id] = f"{name}: {format_count(a['n_params'])} total / {format_count(a['n_active_params'])} active"
    return out


def _table(store: ResultsStore, run_id: str, table: str, *needs: str) -> Optional[pd.DataFrame]:
    """The table, or None when it is absent or lacks a finite value in any column ``needs``."""
    try:
        frame = store.metrics(run_id, table)
    except StoreKeyError:
        return None
    if any(c not in frame or not np.isfinite(frame[c]).any() for c in needs):
        return None
    return frame


def scaleup_figure(store: ResultsStore, runs: list[str], colour: dict[str, str],
                   smoothing: float = 0.9) -> Union[Figure, str]:
    """Training loss (EMA weight ``smoothing`` of the past) and held-out loss against tokens, one
    colour per run of ``runs`` (scaleup_runs' order); a string saying why when there is nothing."""
    if not runs:
        return "no MoE training run in the store (the scale-up runs: workflow/experiments.py)"
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    train_ax, eval_ax = fig.subplots(1, 2)
    names, drawn = labels(store, runs), set()
    for run_id in runs:
        train = _table(store, run_id, "train", "tokens", "loss")
        if train is not None:
            ema = train["loss"].ewm(alpha=1 - smoothing, ignore_na=True).mean()
            train_ax.plot(train["tokens"], train["loss"], color=colour[run_id], alpha=0.2, lw=0.8)
            train_ax.plot(train["tokens"], ema, color=colour[run_id], lw=1.8, label=names[run_id])
            drawn.add("train")
        evals = _table(store, run_id, "eval", "tokens", "loss")
        if evals is not None and (evals["tokens"] > 0).any():
            evals = evals[evals["tokens"] > 0]  # a log axis
            eval_ax.plot(evals["tokens"], evals["loss"], "o-", ms=4, color=colour[run_id], label=names[run_id])
            drawn.add("eval")
    if not drawn:
        return "no MoE run has 'tokens' and 'loss' in its train or eval table"
    for ax, what, title in ((train_ax, "train", f"training loss (thin: per step, thick: EMA {smoothing:g})"),
                            (eval_ax, "eval", "held-out loss during training")):
        ax.set(xlabel="tokens (log scale)", ylabel="loss", title=title, xscale="log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # decades labelled only: no overlapping labels
        ax.grid(alpha=0.3, which="both")
        if what in drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, f"no {what} table with tokens and loss", ha="center", va="center",
                    transform=ax.transAxes, color="dimgrey")
    fig.suptitle("Scale-up: MoE models by size (total / active parameters, the core's analytic count)")
    return fig
