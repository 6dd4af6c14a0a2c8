"""Stage `evaluate`: held-out loss, perplexity and bits per byte of a run's newest checkpoint.

    run_evaluate(EvaluateConfig(), EvaluateInputs(run_dir=Path("results/runs/x")),
                 EvaluateOutputs(eval_json=Path("results/runs/x/eval.json"), store=Path("results/store.zarr")))

Evaluates every held-out sequence of every source (up to ``max_batches`` batches per source),
writes one row to the run's ``heldout`` table in the store and the same numbers to ``eval.json``.
Downstream tasks through lm-evaluation-harness are a later addition (``tasks``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from optimus_core import load_model
from optimus_core.atomic import atomic_write
from optimus_core.provenance import utc_now
from optimus_core.store import open_store
from optimus_core.train.evaluate import heldout_metrics

SUPPORTED_TASKS = ("heldout",)


@dataclass
class EvaluateConfig:
    tasks: tuple[str, ...] = ("heldout",)
    batch_size: int = 16
    max_batches: int = 64
    dtype: str = "float32"

    def __post_init__(self):
        unknown = [t for t in self.tasks if t not in SUPPORTED_TASKS]
        if unknown:
            raise ValueError(f"tasks = {unknown}: unknown; supported: {', '.join(SUPPORTED_TASKS)}")
        if self.batch_size < 1 or self.max_batches < 1:
            raise ValueError(f"batch_size = {self.batch_size}, max_batches = {self.max_batches}: both must be >= 1")


@dataclass
class EvaluateInputs:
    run_dir: Path
    data_dir: Path | None = None  # default: the data the run was trained on (its config)


@dataclass
class EvaluateOutputs:
    eval_json: Path
    store: Path | None = None


@dataclass
class EvaluateResult:
    run_id: str
    step: int
    metrics: dict = field(default_factory=dict)


def run_evaluate(config: EvaluateConfig, inputs: EvaluateInputs, outputs: EvaluateOutputs) -> EvaluateResult:
    run_dir = Path(inputs.run_dir)
    meta_path = run_dir / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no meta.json)")
    run_id = json.loads(meta_path.read_text())["run_id"]
    model, cfg, step = load_model(run_dir, with_step=True)
    data_dir = Path(inputs.data_dir or cfg.data.path)
    metrics = heldout_metrics(model, data_dir, seq_len=cfg.data.seq_len, batch_size=config.batch_size,
                              max_batches=config.max_batches, dtype=config.dtype)
    row = {"step": step, "tokens": step * cfg.tokens_per_step, **metrics}
    if outputs.store:
        with open_store(outputs.store).run_writer(run_id) as writer:
            writer.log("heldout", row)
            writer.update_attrs(evaluated=utc_now())
    atomic_write(outputs.eval_json, json.dumps({"run_id": run_id, "data_dir": str(data_dir), **row}, indent=2))
    return EvaluateResult(run_id, step, metrics)
