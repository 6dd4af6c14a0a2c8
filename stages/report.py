"""Stage ``report``: results/report.md, written from the results store alone.

    from stages.report import ReportConfig, ReportInputs, ReportOutputs, run_report

    run_report(ReportConfig(),
               ReportInputs(store=Path("results/store.zarr"), figures_dir=Path("results/figures")),
               ReportOutputs(report=Path("results/report.md")))

The report holds a summary table of the runs, an evaluation table (every run's final held-out
loss per source and downstream accuracy, followed by ``eval_table.png``), the scale-up section
(the MoE runs, smallest first, as ``scaleup.png`` draws them: parameters, tokens seen, final
held-out loss, wall time; stages/scaleup.py), the strong-scaling section (stages/scaling_figure.scaling_report_markdown on the scaling study read from the store,
followed by ``scaling.png`` and ``scaling_breakdown.png``), the other figures (relative links),
and per training run its
held-out losses (first and last evaluation during training, and the final ``heldout`` table
when the evaluate stage wrote one) and its resolved config. Its date is the latest ``updated``
of the runs shown, never the time of writing, so the same store always gives the same bytes.
Runs are chosen as for the figures: ``config.runs``, or else every completed run.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Optional
from urllib.parse import quote

import numpy as np
import pandas as pd

from optimus_core.validation import Validated
from optimus_core.atomic import atomic_open
from optimus_core.store import ResultsStore, StoreKeyError, open_store
from stages.figures import DASH, FIGURES, SCALING_FIGURES, evaluation_table, select_runs
from stages.scaleup import format_count, scaleup_runs
from stages.scaling_figure import read_scaling, scaling_report_markdown

EVAL_TABLE = "eval_table.png"  # embedded under the evaluation table, not among the other figures
SCALEUP = "scaleup.png"  # embedded under the scale-up table


@dataclass(frozen=True)
class ReportConfig(Validated):
    _section: ClassVar[str] = "report"

    runs: Optional[tuple[str, ...]] = None  # None: every completed run
    title: str = "Optimus results"
    final_loss_rows: int = 10  # "final train loss" is the mean over this many last rows
    skip_damaged: bool = False  # read the store's healthy runs, naming the damaged ones left out

    def check(self) -> None:
        self._require(self.final_loss_rows >= 1, "final_loss_rows", "must be >= 1")


@dataclass(frozen=True)
class ReportInputs:
    store: Path
    figures_dir: Path


@dataclass(frozen=True)
class ReportOutputs:
    report: Path


@dataclass
class ReportResult:
    report: Path
    runs: list[str]


def run_report(config: ReportConfig, inputs: ReportInputs, outputs: ReportOutputs) -> ReportResult:
    store = open_store(inputs.store, mode="r", skip_damaged=config.skip_damaged)
    figures = Path(inputs.figures_dir)
    if not figures.is_dir():  # a figure of it may be missing (a note says so), the directory may not
        raise FileNotFoundError(f"figures directory {figures} {'is a file' if figures.exists() else 'does not exist'}: "
                                f"draw the figures there first (`optimus figures --store {inputs.store} --out "
                                f"{figures}`), or name the directory they are in")
    run_ids = select_runs(store, config.runs)
    attrs = {r: store.attrs(r) for r in run_ids}
    lines = [f"# {config.title}", "", _provenance(store, inputs.store, run_ids, attrs), ""]
    if run_ids:
        lines += ["## Summary", "", *_summary(store, run_ids, attrs, config.final_loss_rows), "",
                  f"Final train loss: mean of the last {config.final_loss_rows} logged steps. "
                  f"Steps: the last logged step.", ""]
        lines += _evaluation(store, run_ids, inputs.figures_dir, outputs.report.parent)
        lines += _scaleup(store, run_ids, attrs, inputs.figures_dir, outputs.report.parent)
    lines += _paper_runs(store)
    lines += _scaling(store, inputs.figures_dir, outputs.report.parent)
    lines += _memory(store)
    lines += _figures(inputs.figures_dir, outputs.report.parent)
    for run_id in run_ids:
        lines += _run_section(store, run_id, attrs[run_id])
    outputs.report.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(outputs.report, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    return ReportResult(report=outputs.report, runs=run_ids)


def _provenance(store: ResultsStore, store_path: Path, run_ids: list[str], attrs: dict) -> str:
    revs = list(dict.fromkeys(str(a["git_rev"]) for a in attrs.values() if a.get("git_rev")))
    updated = max((a["updated"] for a in attrs.values()), default=None)
    line = (f"Written from the results store `{store_path}` alone: {len(run_ids)} run(s), "
            f"git revision {', '.join(f'`{r}`' for r in revs) or 'unrecorded'}")
    if updated:
        when = datetime.fromisoformat(updated).strftime("%Y-%m-%d %H:%M UTC")
        line += f", last updated {when}"
    others = store.runs()
    others = others[~others["run_id"].isin(run_ids)]
    if len(others):
        line += ". Not shown: " + ", ".join(f"`{r}` ({s})" for r, s in zip(others["run_id"], others["status"]))
    return line + "."


def _summary(store: ResultsStore, run_ids: list[str], attrs: dict, last_n: int) -> list[str]:
    rows = [["run", "preset", "params", "active params", "steps", "tokens",
             "final train loss", "median tokens/s", "wall time"]]
    for run_id in run_ids:
        a = attrs[run_id]
        train = _table(store, run_id, "train")
        rows.append([
            f"`{run_id}`", a.get("preset") or DASH, _count(a.get("n_params")), _count(a.get("n_active_params")),
            _int(_last(train, "step")), _int(_last(train, "tokens")),
            _num(train["loss"].dropna().tail(last_n).mean() if "loss" in train else None, ".4f"),
            _num(train["tokens_per_s"].median() if "tokens_per_s" in train else None, ",.0f"),
            _duration(a.get("wall_time_s")),
        ])
    return _markdown_table(rows, align="llrrrrrrr")


def _evaluation(store: ResultsStore, run_ids: list[str], figures_dir: Path, report_dir: Path) -> list[str]:
    """Every run's final evaluation side by side (the numbers of eval_table.png), then the figure."""
    headers, rows = evaluation_table(store, run_ids)
    if not headers:
        return []
    table = [["run", *headers], *([f"`{r}`", *cells] for r, cells in zip(run_ids, rows))]
    return ["## Evaluation", "", *_markdown_table(table, align="l" + "r" * len(headers)), "",
            "Held-out loss (nats) of the last `heldout` row and accuracy +- its standard error of the last "
            "`downstream` row of each run (`optimus evaluate`).", "", *_figure(figures_dir, report_dir, EVAL_TABLE)]


def _scaleup(store: ResultsStore, run_ids: list[str], attrs: dict, figures_dir: Path, report_dir: Path) -> list[str]:
    """The MoE runs smallest first (the runs of scaleup.png): size, tokens seen, final held-out
    loss of the evaluate stage and the last one during training, wall time; then the figure."""
    runs = scaleup_runs(store, run_ids)
    if not runs:
        return []
    rows = [["run", "preset", "params", "active params", "tokens", "held-out loss (evaluate)",
             "held-out loss (training)", "wall time"]]
    for run_id in runs:
        a, train = attrs[run_id], _table(store, run_id, "train")
        rows.append([f"`{run_id}`", a.get("preset") or DASH, _count(a.get("n_params")),
                     _count(a.get("n_active_params")), _int(_last(train, "tokens")),
                     _num(_last(_table(store, run_id, "heldout"), "loss"), ".4f"),
                     _num(_last(_table(store, run_id, "eval"), "loss"), ".4f"), _duration(a.get("wall_time_s"))])
    return ["## Scale-up", "", *_markdown_table(rows, align="llrrrrrr"), "",
            "The MoE models by size: the paper's scale-up runs (Mula-20B-A2B, -100B-A7B, -220B-A10B) beside "
            "Mula-7B-A1B. Tokens: the last logged training step's. Held-out loss (nats, every source together): "
            "the last `heldout` row of `optimus evaluate`, and the last evaluation during training. "
            "Wall time: the training run's.", "", *_figure(figures_dir, report_dir, SCALEUP)]


def _scaling(store: ResultsStore, figures_dir: Path, report_dir: Path) -> list[str]:
    """The strong-scaling section: the model at 12288 tiles beside the paper, held-out errors, the
    measured sweeps (scaling_report_markdown), then its two figures."""
    measured, predicted, holdout = read_scaling(store)
    text = scaling_report_markdown(measured, predicted, holdout)
    return [*text.rstrip("\n").split("\n"), "", *[line for name in SCALING_FIGURES
                                                  for line in _figure(figures_dir, report_dir, name)]]


def _paper_runs(store: ResultsStore) -> list[str]:
    """"The paper's runs": each pretraining run of the paper as the registry defines it and `optimus
    plan --store` recorded it on a site (a ``plan-*`` run of the store): preset and the authors'
    tag, shape, parameters beside the name's sizes, context, batch, tokens, steps, layout,
    node-hours and GiB per tile. Nothing when no plan is in the store."""
    lines = []
    for run_id in store.runs_of_kind("plan"):
        attrs = store.attrs(run_id)
        rows = [["preset", "tag", "layers", "width", "heads", "experts", "total / active", "name", "context",
                 "batch", "tokens", "steps", "tiles (EP, PP)", "recompute", "node-hours", "GiB/tile"]]
        for r in attrs.get("paper_runs", []):
            experts = f"{r['experts']} (top-{r['top_k']})" if r["experts"] else DASH
            rows.append([r["preset"], f"`{r['base']}--{r['tag']}`" if r["tag"] else f"`{r['base']}`",
                         str(r["layers"]), str(r["d_model"]), str(r["heads"]), experts,
                         f"{format_count(r['params'])} / {format_count(r['active_params'])}", r["nominal"] or DASH,
                         str(r["seq_len"]), str(r["batch"]), format_count(r["tokens"]), f"{r['steps']:,}",
                         f"{r['tiles']} ({r['ep']}, {r.get('pp', 1)})", r.get("checkpointing") or DASH,
                         _num(r["node_hours"], ",.0f"), _num(r["gib_per_tile"], ".1f")])
        if len(rows) == 1:
            continue
        lines += ["## The paper's runs", "",
                  f"Every pretraining run of the paper as this pipeline trains it, planned on `{attrs.get('site')}` "
                  f"(`optimus plan --site {attrs.get('site')}`; node-hours from the performance model on machine "
                  f"`{attrs.get('machine')}`, GiB per tile from the memory model). Models are the authors' base models "
                  "rescaled by their tags (GitHub IntelLabs/Optimus-LM), with the paper's recipe: context 2048, 3072 "
                  "sequences a step, the decay over one epoch of the data. \"Name\": the sizes the model's name "
                  "states, beside our exact counts.", "", *_markdown_table(rows, "llrrrlllrrrrrlrr"), ""]
        lines += _designs(attrs)
    return lines


def _designs(attrs: dict) -> list[str]:
    """"Two designs of the same runs": each run that has a design of ours beside the authors'
    layout, both as planned (the plan's performance and memory models)."""
    rows = [["run", "design", "tiles (EP, PP)", "recompute", "est. hours", "node-hours", "GiB/tile"]]
    for r in attrs.get("designs", []):
        rows.append([r["run"], r["design"], f"{r['tiles']} ({r['ep']}, {r['pp']})", r["checkpointing"] or DASH,
                     _num(r["est_hours"], ",.1f"), _num(r["node_hours"], ",.0f"), _num(r["gib_per_tile"], ".1f")])
    if len(rows) == 1:
        return []
    return ["## Two designs of the same runs", "",
            "The authors' layouts (pipeline stages, their recompute levels) and ours (no pipeline, every parameter "
            "sharded in blocks of 384 tiles, the least recomputation that fits), planned alike on "
            f"`{attrs.get('site')}` (`optimus plan --layout authors|zero3-blocks`): hours from the performance model, "
            "GiB per tile from the memory model (the heaviest pipeline stage's). The strong-scaling section gives "
            "the sweep in both.", "", *_markdown_table(rows, "llrlrrr"), ""]


def _memory(store: ResultsStore) -> list[str]:
    """"Memory per tile": each rehearsed paper layout (`optimus rehearse`, a ``rehearsal-*`` run
    of the store): the memory model's GiB per tile beside the allocator's peak on the rehearsing
    device, and the tile's budget. Nothing when no rehearsal is in the store."""
    runs = [r for r in store.runs()["run_id"] if str(r).startswith("rehearsal-")] if len(store.runs()) else []
    lines = []
    for run_id in runs:
        records = store.attrs(run_id).get("records", {})
        rows = [["run", "tiles", "PP (stage)", "act. ckpt", "model GiB", "rehearsal GiB (allocated)", "reserved",
                 "budget", "model error", "checkpoint write GiB", "held before GiB"]]
        found = []
        for table in store.tables(run_id):
            frame = _table(store, run_id, table)
            if len(frame):
                found.append((records.get(table, {}), frame.iloc[-1], table))
        for info, row, table in sorted(found, key=lambda f: (f[0].get("name", f[2]), float(f[1].get("world", 0)))):
            pp = int(float(row.get("pp") or 1)) if not _missing(row.get("pp")) else 1
            stage = f"{pp} ({int(float(row['stage']))})" if pp > 1 and not _missing(row.get("stage")) else str(pp)
            rows.append([info.get("name", table), _int(row.get("world")), stage, info.get("checkpointing", DASH),
                         _num(row.get("model_gib"), ".1f"), _num(row.get("peak_allocated_gib"), ".1f"),
                         _num(row.get("peak_reserved_gib"), ".1f"), _num(row.get("budget_gib"), ".1f"),
                         DASH if _missing(row.get("model_error")) else f"{float(row['model_error']):+.1%}",
                         _num(row.get("save_peak_allocated_gib"), ".1f"), _num(row.get("held_before_gib"), ".2f")])
        if len(rows) == 1:
            continue
        device = run_id.removeprefix("rehearsal-")
        lines += ["## Memory per tile", "",
                  f"One rank of each paper layout rehearsed on one {device} (`optimus rehearse`: torch's fake process "
                  "group stands in for the other ranks; real kernels, sizes and steps): the memory model's bytes per "
                  "tile (optimus_core/memory.py, with the activation checkpointing the plan resolves) beside the "
                  "allocator's peak, the tile's budget (the usable share of a 64 GiB Aurora tile) and the device's "
                  "peak while the rank wrote its part of a checkpoint. \"Held before\": what the device held "
                  "before the rehearsal built anything, subtracted from its peak. GPU records without it count the "
                  "weights of the rehearsals run before them in the same process; records where it is over 0.25 GiB "
                  "(an earlier rehearsal's garbage) may count up to that much too little, where it was freed during "
                  "the rehearsal. A pipelined layout (PP > 1, the authors') rehearses its heaviest stage, all its "
                  "micro-batches in their 1F1B order.", "",
                  *_markdown_table(rows, "lrllrrrrrrr"), ""]
    return lines


def _figures(figures_dir: Path, report_dir: Path) -> list[str]:
    lines = ["## Figures", ""]
    for name in FIGURES:
        if name not in (EVAL_TABLE, SCALEUP) and name not in SCALING_FIGURES:
            lines += _figure(figures_dir, report_dir, name)
    return lines


def _figure(figures_dir: Path, report_dir: Path, name: str) -> list[str]:
    path, caption = figures_dir / name, FIGURES[name]
    if path.exists():
        # percent-encoded: a space or a parenthesis in a directory name would end a Markdown link
        link = quote(Path(os.path.relpath(path, report_dir)).as_posix())
        return [f"![{caption}]({link})", "", f"*{caption}.*", ""]
    return [f"*{name}: not drawn (run `optimus figures`).*", ""]


def _run_section(store: ResultsStore, run_id: str, attrs: dict) -> list[str]:
    facts = [f"{k}: {attrs[k]}" for k in ("experiment", "preset", "status", "hardware", "host") if attrs.get(k)]
    lines = [f"## `{run_id}`", "", ", ".join(facts) + ".", ""]
    evals = _table(store, run_id, "eval")
    if len(evals):
        first, last = evals.iloc[0], evals.iloc[-1]
        rows = [["source", "first loss", "first ppl", "last loss", "last ppl"]]
        for source, suffix in _sources(evals):
            rows.append([source, _num(first.get("loss" + suffix), ".4f"), _num(first.get("ppl" + suffix), ",.2f"),
                         _num(last.get("loss" + suffix), ".4f"), _num(last.get("ppl" + suffix), ",.2f")])
        lines += ["### Held-out loss during training", "",
                  f"First evaluation {_at(first)}, last {_at(last)}.", "",
                  *_markdown_table(rows, align="lrrrr"), ""]
    heldout = _table(store, run_id, "heldout")
    if len(heldout):
        final = heldout.iloc[-1]
        rows = [["source", "loss", "ppl", "bits per byte"]]
        for source, suffix in _sources(heldout):
            rows.append([source, _num(final.get("loss" + suffix), ".4f"), _num(final.get("ppl" + suffix), ",.2f"),
                         _num(final.get("bpb" + suffix), ".4f")])
        lines += ["### Final held-out evaluation", "", f"Evaluated {_at(final)}.", "",
                  *_markdown_table(rows, align="lrrr"), ""]
    downstream = _table(store, run_id, "downstream")
    if len(downstream):
        final = downstream.iloc[-1]
        tasks = sorted(c.split(".", 1)[1] for c in downstream.columns if c.startswith("acc."))
        rows = [["task", "accuracy", "+-", "normalised accuracy", "items"]]
        for task in tasks:
            rows.append([task, _num(final.get(f"acc.{task}"), ".3f"), _num(final.get(f"acc_stderr.{task}"), ".3f"),
                         _num(final.get(f"acc_norm.{task}"), ".3f"), _int(final.get(f"n.{task}"))])
        lines += ["### Downstream tasks (lm-evaluation-harness)", "", f"Evaluated {_at(final)}.", "",
                  *_markdown_table(rows, align="lrrrr"), ""]
    config = json.dumps(attrs.get("config", {}), indent=2, sort_keys=True)
    lines += ["<details><summary>Resolved config</summary>", "", "```json", config, "```", "", "</details>", ""]
    return lines


def _table(store: ResultsStore, run_id: str, table: str) -> pd.DataFrame:
    try:
        return store.metrics(run_id, table)
    except StoreKeyError:
        return pd.DataFrame()


def _sources(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """(label, column suffix): all sources together first, then each ``<metric>.<source>``."""
    sources = sorted({c.split(".", 1)[1] for c in frame.columns if c.startswith(("loss.", "ppl.", "bpb."))})
    return [("all", "")] + [(s, f".{s}") for s in sources]


def _at(row: pd.Series) -> str:
    return f"at step {_int(row.get('step'))} ({_int(row.get('tokens'))} tokens)"


def _last(frame: pd.DataFrame, column: str) -> Any:
    return frame[column].iloc[-1] if column in frame and len(frame) else None


def _missing(x: Any) -> bool:
    return x is None or (isinstance(x, (float, np.floating)) and math.isnan(x))


def _num(x: Any, spec: str) -> str:
    return DASH if _missing(x) else format(float(x), spec)


def _int(x: Any) -> str:
    return DASH if _missing(x) else f"{int(x):,}"


def _count(x: Any) -> str:
    """Parameter counts as 6.92B / 1.30M / 12.3K."""
    return DASH if _missing(x) else format_count(x)


def _duration(seconds: Any) -> str:
    if _missing(seconds):
        return DASH
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _markdown_table(rows: list[list[str]], align: str) -> list[str]:
    rule = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(map(str, row)) + " |" for row in [rows[0], rule, *rows[1:]]]
