"""``downstream.png``: downstream accuracy against training tokens, one panel per task and their
average, the runs beside the reference models' published numbers: the paper's figure.

    fig = downstream_figure(store, run_ids)      # a matplotlib Figure, or a str saying why not

The authors evaluate every model-only checkpoint of their runs on nine lm-eval tasks and draw a
3 x 3 grid of accuracy against tokens, Mula-7B-A1B beside AllenAI's OLMoE-1B-7B-0924 checkpoints
(GitHub IntelLabs/Optimus-LM ``evals/generate_plots.py``), and the average of the nine apart.
Here one grid holds the tasks in the paper's order (then any other task, by name) and the
average as the last panel; each task shows the metric the authors read of it
(optimus_core.eval.tasks.PAPER_TASKS: acc_norm or acc; ``acc`` for any other task). The runs'
points are the evaluate stage's ``downstream`` rows (one per checkpoint); the reference models
are the store's ``reference-*`` runs (stages/reference.py), drawn as open markers with their
source in the legend. At laptop scale the offline tasks stand in for lm-eval's, drawn alike.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from optimus_core.eval.tasks import PAPER_TASKS, task_metric
from optimus_core.store import ResultsStore, StoreKeyError

REFERENCE_KIND = "reference"  # the ``kind`` attr of a reference model's run (stages/reference.py)
AVERAGE = "average"


def reference_runs(store: ResultsStore) -> list[str]:
    """The store's reference models (runs whose ``kind`` attr is "reference"), in creation order."""
    return store.runs_of_kind(REFERENCE_KIND)


def _downstream(store: ResultsStore, run_id: str) -> Optional[pd.DataFrame]:
    try:
        frame = store.metrics(run_id, "downstream")
    except StoreKeyError:
        return None
    return frame if len(frame) and "tokens" in frame else None


def _tasks(frames: list[pd.DataFrame]) -> list[str]:
    """The tasks any frame scores with its metric: the paper's in their order, then the rest by name."""
    found = {c.split(".", 1)[1] for f in frames for c in f.columns
             if "." in c and c.split(".", 1)[0] == task_metric(c.split(".", 1)[1])}
    found = {t for t in found if not t.startswith("mmlu_")}  # MMLU's subjects: the group score stands for them
    return [t for t in PAPER_TASKS if t in found] + sorted(found - set(PAPER_TASKS))


def _scores(frame: pd.DataFrame, tasks: list[str]) -> pd.DataFrame:
    """tokens, one column per task (its metric), and the average where every task has a score."""
    out = pd.DataFrame({"tokens": frame["tokens"].astype(float)})
    for task in tasks:
        column = f"{task_metric(task)}.{task}"
        out[task] = frame[column].astype(float) if column in frame else np.nan
    out[AVERAGE] = out[tasks].mean(axis=1, skipna=False)
    return out.sort_values("tokens")


def downstream_figure(store: ResultsStore, run_ids: list[str], colour: Optional[dict] = None) -> Union[Figure, str]:
    runs = {r: f for r in run_ids if (f := _downstream(store, r)) is not None}
    refs = {r: f for r in reference_runs(store) if (f := _downstream(store, r)) is not None}
    if not runs:
        return "no run has a downstream table (run `optimus evaluate` with downstream tasks)"
    tasks = _tasks(list(runs.values()))
    if not tasks:
        return "no downstream task scored with its metric (acc_norm or acc) in the store"
    panels = tasks + [AVERAGE]
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.2 * cols, 2.9 * rows + 0.8))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    scale, unit = (1e9, "B") if max(f["tokens"].max() for f in runs.values()) >= 1e9 else (1e6, "M")
    handles = {}
    for i, (run_id, frame) in enumerate(runs.items()):
        points = _scores(frame, tasks)
        for ax, panel in zip(axes, panels):
            (line,) = ax.plot(points["tokens"] / scale, points[panel], marker="o", ms=3,
                              color=(colour or {}).get(run_id, f"C{i % 10}"))
            handles.setdefault(run_id, line)
    for j, (run_id, frame) in enumerate(refs.items()):
        points = _scores(frame, tasks)
        source = store.attrs(run_id).get("model", run_id)
        for ax, panel in zip(axes, panels):
            if points[panel].notna().any():
                (line,) = ax.plot(points["tokens"] / scale, points[panel], ls="--", marker="s", mfc="none",
                                  color="dimgrey" if j == 0 else f"C{(len(runs) + j) % 10}")
                handles.setdefault(f"{source} (published)", line)
    for ax, panel in zip(axes, panels):
        metric = "mean of the tasks" if panel == AVERAGE else task_metric(panel)
        ax.set_title(f"{panel.removeprefix('optimus_')} ({metric})", fontsize=9)
        ax.set_xlabel(f"tokens ({unit})", fontsize=8)
        ax.set_ylabel("accuracy", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.axis("off")
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 4), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
