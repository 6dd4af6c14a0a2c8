"""Stage ``reference``: a reference model's published downstream scores into the results store.

    run_reference(ReferenceConfig(), ReferenceInputs(file=Path("workflow/reference/olmoe-1b-7b-0924.yaml")),
                  ReferenceOutputs(store=Path("results/store.zarr")))

The paper draws its runs' downstream accuracy beside AllenAI's OLMoE-1B-7B-0924 checkpoints.
Those checkpoints cannot be downloaded and evaluated here, so their published numbers are carried
as data, each file naming its source and the protocol behind the numbers, and put into the store
like any measurement (the house rule: every number in a figure comes from the store). A file::

    model: OLMoE-1B-7B-0924
    source: where the numbers were published (a URL and what in it)
    protocol: how they were measured (framework, shots, formulation)
    points:                                   # one per checkpoint, tokens seen
      - {tokens: 5.13e12, acc_norm.hellaswag: 0.80, acc.mmlu: 0.541, ...}

becomes run ``reference-<file stem>`` (attrs ``kind: reference``, ``model``, ``source``,
``protocol``) with one ``downstream`` row per point, columns as the evaluate stage writes them
(``<metric>.<task>``). Rerunning replaces the run's rows with the file's: idempotent.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from optimus_core.config import ConfigError
from optimus_core.eval.tasks import PAPER_TASKS
from optimus_core.store import open_store

KIND = "reference"
_COLUMN = re.compile(r"^(acc|acc_norm)\.[A-Za-z0-9_]+$")


@dataclass
class ReferenceConfig:
    pass


@dataclass
class ReferenceInputs:
    file: Path


@dataclass
class ReferenceOutputs:
    store: Path


@dataclass
class ReferenceResult:
    run_id: str
    points: int


def read_reference(path: Path) -> dict:
    """The file's mapping, checked: model, source and protocol named, at least one point, each
    with its tokens and scores in [0, 1] under ``<acc|acc_norm>.<task>`` columns. ConfigError
    naming the file and what is wrong."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such reference file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: must be a mapping with model, source, protocol and points")
    for key in ("model", "source", "protocol"):
        if not isinstance(doc.get(key), str) or not doc[key].strip():
            raise ConfigError(f"{path}: {key} must be a non-empty string (a number is only as good as its source)")
    points = doc.get("points")
    if not isinstance(points, list) or not points:
        raise ConfigError(f"{path}: points must be a list of one or more checkpoints")
    for i, point in enumerate(points):
        where = f"{path}: points[{i}]"
        if not isinstance(point, dict):
            raise ConfigError(f"{where}: must be a mapping")
        tokens = point.get("tokens")
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not tokens > 0:
            raise ConfigError(f"{where}: tokens = {tokens!r}: must be a number > 0")
        scores = {k: v for k, v in point.items() if k != "tokens"}
        if not scores:
            raise ConfigError(f"{where}: no scores (columns like acc_norm.hellaswag)")
        for column, value in scores.items():
            if not _COLUMN.match(str(column)):
                raise ConfigError(f"{where}: column {column!r} is not <acc|acc_norm>.<task>")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ConfigError(f"{where}: {column} = {value!r}: must be an accuracy in [0, 1]")
            task = str(column).split(".", 1)[1]
            if task in PAPER_TASKS and str(column).split(".", 1)[0] != PAPER_TASKS[task]:
                raise ConfigError(f"{where}: {column}: the paper reads {PAPER_TASKS[task]} of {task}")
    return doc


def run_reference(config: ReferenceConfig, inputs: ReferenceInputs, outputs: ReferenceOutputs) -> ReferenceResult:
    doc = read_reference(inputs.file)
    run_id = f"{KIND}-{Path(inputs.file).stem}"
    store = open_store(outputs.store)
    attrs = {"kind": KIND, "model": doc["model"], "source": doc["source"], "protocol": doc["protocol"],
             "file": str(inputs.file), "status": "running"}  # (re)started here: completed on leaving
    # rows in step order from step 0: a rerun's first row replaces every row of an earlier ingest
    points = sorted(doc["points"], key=lambda p: p["tokens"])
    with store.run_writer(run_id, attrs) as writer:
        for i, point in enumerate(points):
            row = {"step": i, "tokens": float(point["tokens"])}
            row.update({k: float(v) for k, v in point.items() if k != "tokens"})
            writer.log("downstream", row)
    return ReferenceResult(run_id, len(points))

