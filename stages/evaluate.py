"""Stage `evaluate`: held-out loss, perplexity and bits per byte of a run's newest checkpoint.

    run_evaluate(EvaluateConfig(), EvaluateInputs(run_dir=Path("results/runs/x")),
                 EvaluateOutputs(eval_json=Path("results/runs/x/eval.json"), store=Path("results/store.zarr")))

Tasks:
    heldout        every held-out sequence of every source (up to ``max_batches`` batches per
                   source): loss, perplexity, bits per byte -> store table ``heldout``
    continuation   offline multiple-choice tasks built from the held-out split, one per source
                   (optimus_core.eval.tasks), run through lm-evaluation-harness
    <any other>    an lm-eval task by name: from ``task_dirs`` (local YAML) or lm-eval's registry
                   where its data is available offline
Downstream scores go to store table ``downstream`` (columns ``<metric>.<task>``) and to
``eval.json`` under ``downstream``. lm-eval is needed only for tasks other than ``heldout``
(``pip install -e '.[eval]'``).

    run_evaluate(EvaluateConfig(tasks=("heldout", "continuation")), ...)
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from optimus_core import load_model
from optimus_core.atomic import atomic_write
from optimus_core.provenance import utc_now
from optimus_core.store import open_store
from optimus_core.train.evaluate import heldout_metrics

BUILTIN_TASKS = ("heldout", "continuation")  # anything else is handed to lm-eval by name


@dataclass
class EvaluateConfig:
    tasks: tuple[str, ...] = ("heldout",)
    batch_size: int = 16
    max_batches: int = 64
    dtype: str = "float32"
    task_dirs: tuple[str, ...] = ()  # extra directories of lm-eval task YAML files
    limit: int | None = None  # lm-eval: at most this many documents per task (None = all)
    n_items: int = 200  # continuation: items per source

    def __post_init__(self):
        self.tasks = tuple(self.tasks)
        self.task_dirs = tuple(str(d) for d in self.task_dirs)
        bad = [t for t in self.tasks if not isinstance(t, str) or not t.strip()]
        if not self.tasks or bad:
            raise ValueError(f"tasks = {list(self.tasks)}: need one or more task names "
                             f"({', '.join(BUILTIN_TASKS)} or an lm-eval task)")
        if self.batch_size < 1 or self.max_batches < 1:
            raise ValueError(f"batch_size = {self.batch_size}, max_batches = {self.max_batches}: both must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit = {self.limit}: must be None (all documents) or >= 1")
        if self.n_items < 4:
            raise ValueError(f"n_items = {self.n_items}: must be >= 4 (one true continuation + 3 distractors)")

    @property
    def downstream(self) -> tuple[str, ...]:
        return tuple(t for t in self.tasks if t != "heldout")


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
    base = {"step": step, "tokens": step * cfg.tokens_per_step}
    metrics: dict = {}
    if "heldout" in config.tasks:
        metrics = heldout_metrics(model, data_dir, seq_len=cfg.data.seq_len, batch_size=config.batch_size,
                                  max_batches=config.max_batches, dtype=config.dtype)
    scores = _downstream(config, model, cfg, data_dir) if config.downstream else {}
    down_row = {f"{metric}.{task}": v for task, m in scores.items() for metric, v in m.items()}
    if outputs.store:
        with open_store(outputs.store).run_writer(run_id) as writer:
            if metrics:
                writer.log("heldout", {**base, **metrics})
            if down_row:
                writer.log("downstream", {**base, **down_row})
            writer.update_attrs(evaluated=utc_now())
    doc = {"run_id": run_id, "data_dir": str(data_dir), **base, **metrics}
    if scores:
        doc["downstream"] = scores
    atomic_write(outputs.eval_json, json.dumps(doc, indent=2))
    return EvaluateResult(run_id, step, {**metrics, **down_row})


def _downstream(config: EvaluateConfig, model, cfg, data_dir: Path) -> dict[str, dict]:
    """lm-eval scores ``{task: {metric: value, "n": docs}}`` of the downstream tasks."""
    try:
        from optimus_core.eval.lm import OptimusLM
        from optimus_core.eval.tasks import build_continuation_tasks, run_lm_eval
    except ImportError as e:
        raise ValueError(f"tasks {list(config.downstream)} need lm-evaluation-harness ({e}); "
                         "install the eval extra: pip install -e '.[eval]'") from None
    lm = OptimusLM.for_model(model, cfg, data_dir, batch_size=config.batch_size)
    # The continuation tasks are rebuilt per evaluation (seconds, deterministic), in a temporary
    # directory: nothing is left behind that could go stale against a re-tokenized corpus.
    with tempfile.TemporaryDirectory(prefix="optimus-tasks-") as tmp:
        names: list[str] = []
        for task in config.downstream:
            if task == "continuation":
                names += build_continuation_tasks(data_dir, tmp, n_items=config.n_items)
            else:
                names.append(task)
        return run_lm_eval(lm, names, task_dirs=[tmp, *config.task_dirs], limit=config.limit)
