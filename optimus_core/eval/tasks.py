"""Offline lm-eval tasks from the held-out split, task-file checks, and the lm-eval runner.

    names = build_continuation_tasks("results/data/tokens", "/tmp/tasks", n_items=200)
    # -> ["optimus_cont_code", "optimus_cont_docs", "optimus_cont_prose"]: one multiple-choice
    #    task per corpus source, written as /tmp/tasks/<name>.yaml over /tmp/tasks/<name>.jsonl
    scores = run_lm_eval(OptimusLM.from_run(run), names, task_dirs=["/tmp/tasks"])
    scores["optimus_cont_code"]  # {"acc": .., "acc_stderr": .., "acc_norm": .., "n": 200}

The continuation task: a held-out passage (``context_tokens`` tokens) and ``n_choices``
candidate continuations (``cont_tokens`` tokens each): the true one and the continuations of
other passages of the same source. Chance is 1 / n_choices; a model that learned the source's
language prefers the continuation that fits. Items come from the val split, which training
never sees, and are deterministic in (data, seed). Any other lm-eval task (ARC, HellaSwag, ...)
runs by name where its data is available (``HF_DATASETS_OFFLINE`` is respected, not forced off).
"""
from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Iterable, Optional, Sequence

import yaml

from optimus_core.config import ConfigError

TASK_PREFIX = "optimus_cont_"
# The paper's downstream tasks (lm-eval, zero-shot), in the order of the authors' figure, and the
# metric their table and figure read of each (GitHub IntelLabs/Optimus-LM evals/gather_eval_results.py
# and generate_plots.py, read 2026-12-06): acc_norm for ARC, HellaSwag, PIQA and OpenBookQA; acc for
# BoolQ and WinoGrande (which define no acc_norm), SciQ (which does, but the authors read acc) and
# MMLU (lm-eval's group score: the mean over its 57 subjects weighted by their questions).
PAPER_TASKS = {"arc_easy": "acc_norm", "arc_challenge": "acc_norm", "hellaswag": "acc_norm", "piqa": "acc_norm",
               "boolq": "acc", "sciq": "acc", "winogrande": "acc", "openbookqa": "acc_norm", "mmlu": "acc"}


def task_metric(task: str) -> str:
    """The metric a figure or table reads of ``task``: the paper's (PAPER_TASKS), else ``acc``."""
    return PAPER_TASKS.get(task, "acc")


class TaskFileError(ValueError):
    """A task YAML file does not parse or is not a task definition; the message names the file."""


class UnknownTaskError(ConfigError):
    """A task name that no task directory and not lm-eval's registry defines; the message says
    which names are known (or how to list them) and the nearest known names."""


# ----------------------------------------------------------------------------- task data

def continuation_items(data_dir, source: str, *, n_items: int, context_tokens: int, cont_tokens: int,
                       n_choices: int, seed: int) -> list[dict]:
    """``[{"context", "choices", "label"}]`` from the val split of ``source`` (may be fewer)."""
    from tokenizers import Tokenizer

    from optimus_core.data import heldout_batches, load_manifest

    data_dir = Path(data_dir)
    eos = load_manifest(data_dir).eos_id
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    span = context_tokens + cont_tokens
    passages = []
    for batch in heldout_batches(data_dir, source, span - 1, batch_size=64):
        for row in batch.tolist():
            # The true continuation must continue the same document: no EOS where it begins.
            if eos not in row[context_tokens - 1:]:
                passages.append((tok.decode(row[:context_tokens]), tok.decode(row[context_tokens:])))
        if len(passages) >= n_items:
            break
    passages = passages[:n_items]
    if len(passages) < n_choices:
        return []
    rng = random.Random(f"{seed}:{source}")
    items = []
    for i, (context, true) in enumerate(passages):
        others = [passages[(i + j) % len(passages)][1] for j in range(1, len(passages))]
        others = [o for o in dict.fromkeys(others) if o != true][: n_choices - 1]
        if len(others) < n_choices - 1:
            continue
        label = rng.randrange(n_choices)
        choices = others[:label] + [true] + others[label:]
        items.append({"context": context, "choices": choices, "label": label})
    return items


def task_yaml(name: str, data_file: Path) -> dict:
    return {
        "task": name, "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test", "output_type": "multiple_choice",
        "doc_to_text": "context", "doc_to_choice": "choices", "doc_to_target": "label",
        # context and choices were cut at a token boundary: join them with nothing in between
        "target_delimiter": "", "num_fewshot": 0,
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }


def build_continuation_tasks(data_dir, out_dir, *, sources: Optional[Sequence[str]] = None, n_items: int = 200,
                             context_tokens: int = 48, cont_tokens: int = 16, n_choices: int = 4,
                             seed: int = 0) -> list[str]:
    """Write one continuation task per source (YAML + JSONL) into ``out_dir``; their names."""
    from optimus_core.atomic import atomic_write
    from optimus_core.data import load_manifest

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    if not (data_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{data_dir}/tokenizer.json: missing; continuation tasks need a tokenize output")
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for source in sources or load_manifest(data_dir).sources:
        items = continuation_items(data_dir, source, n_items=n_items, context_tokens=context_tokens,
                                   cont_tokens=cont_tokens, n_choices=n_choices, seed=seed)
        if not items:
            continue  # a source too small for a task: absent, as in the held-out metrics
        name = f"{TASK_PREFIX}{source}"
        data_file = out_dir / f"{name}.jsonl"
        atomic_write(data_file, "".join(json.dumps(it) + "\n" for it in items))
        atomic_write(out_dir / f"{name}.yaml", yaml.safe_dump(task_yaml(name, data_file), sort_keys=False))
        names.append(name)
    if not names:
        raise ValueError(f"{data_dir}: no source's val split holds {n_choices} passages of "
                         f"{context_tokens + cont_tokens} tokens; use shorter passages")
    return names


# ----------------------------------------------------------------------------- task files

class _AnyTagLoader(yaml.SafeLoader):
    """Safe YAML that tolerates lm-eval's tags (``!function utils.process_docs``)."""


_AnyTagLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def check_task_files(task_dirs: Iterable) -> None:
    """TaskFileError naming the first YAML under ``task_dirs`` that does not parse or define a task.

    lm-eval itself logs and skips such files, which surfaces later as "task not found".
    """
    for d in task_dirs:
        d = Path(d)
        if not d.is_dir():
            raise TaskFileError(f"{d}: task directory does not exist")
        for path in sorted(d.rglob("*.yaml")):
            try:
                doc = yaml.load(path.read_text(), Loader=_AnyTagLoader)
            except yaml.YAMLError as e:
                raise TaskFileError(f"{path}: not valid YAML: {e}") from None
            if not isinstance(doc, dict) or not ({"task", "group", "include", "tag"} & set(doc)):
                raise TaskFileError(f"{path}: not an lm-eval task definition (a mapping with 'task:' or "
                                    "'group:' is expected)")


# ----------------------------------------------------------------------------- runner

def task_manager(tasks: Sequence[str], *, task_dirs: Sequence = (), include_defaults: Optional[bool] = None,
                 shown_dirs: Optional[Sequence] = None, also_known: Sequence[str] = ()):
    """lm-eval's TaskManager for ``tasks``, once every one of them is known: else an
    UnknownTaskError listing the known names (``also_known``: the caller's own, such as the
    stage's built-in tasks; the tasks of ``shown_dirs``, default ``task_dirs``: the directories
    the user gave, not a temporary one; lm-eval's registry by how to list it) and the nearest.

    ``include_defaults`` (lm-eval's bundled task registry, slow to index) defaults to "only when
    a task is not found in ``task_dirs``"."""
    from lm_eval.tasks import TaskManager

    check_task_files(task_dirs)
    dirs = [str(d) for d in task_dirs]
    manager = TaskManager(include_path=dirs or None, include_defaults=bool(include_defaults))
    if include_defaults is None and any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=dirs or None, include_defaults=True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if not unknown:
        return manager
    import difflib

    shown = [str(d) for d in (task_dirs if shown_dirs is None else shown_dirs)]
    in_dirs = sorted(TaskManager(include_path=shown, include_defaults=False).all_tasks) if shown else []
    known = [", ".join(also_known)] if also_known else []
    if shown:
        known.append(f"in {', '.join(shown)}: " + (", ".join(in_dirs[:30]) + (", ..." if len(in_dirs) > 30 else "")
                                                    if in_dirs else "none"))
    if include_defaults is not False:
        ours = len(TaskManager(include_path=dirs, include_defaults=False).all_tasks) if dirs else 0
        known.append(f"lm-eval's {len(manager.all_tasks) - ours:,} registered tasks (`lm_eval ls tasks` lists them)")
    near = [n for t in unknown for n in difflib.get_close_matches(t, [*also_known, *manager.all_tasks], n=3)]
    raise UnknownTaskError(f"tasks = {unknown}: unknown to lm-eval{' and not built in' if also_known else ''}; "
                           f"known: {'; '.join(known) or 'none'}"
                           + (f"; did you mean {', '.join(dict.fromkeys(near))}?" if near else ""))


def fetch_task_data(tasks: Sequence[str], *, task_dirs: Sequence = ()) -> dict[str, int]:
    """Load every one of ``tasks`` as lm-eval does before it evaluates, so that its data lands in
    the Hugging Face datasets cache (HF_DATASETS_CACHE) where a later run reads it offline
    (HF_DATASETS_OFFLINE=1: compute nodes without internet); {task: documents it evaluates},
    a group's (mmlu's) subtasks each by name. Unknown names: UnknownTaskError (task_manager)."""
    manager = task_manager(tasks, task_dirs=task_dirs)
    if hasattr(manager, "load"):  # newer lm-eval: a flat dict of the leaf tasks
        leaves = manager.load(list(tasks))["tasks"]
    else:  # earlier: groups nest their subtasks
        from lm_eval.tasks import get_task_dict

        leaves = {}

        def flatten(node) -> None:
            for name, value in node.items():
                if isinstance(value, dict):
                    flatten(value)
                else:
                    leaves[getattr(name, "group_name", None) or str(name)] = value

        flatten(get_task_dict(list(tasks), manager))
    counts = {}
    for name, task in leaves.items():
        docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
        counts[str(name)] = len(docs) if docs is not None else 0
    return counts


def run_lm_eval(lm, tasks: Sequence[str], *, task_dirs: Sequence = (), limit: Optional[int] = None,
                include_defaults: Optional[bool] = None, manager=None) -> dict[str, dict]:
    """Run lm-eval ``tasks`` zero-shot on ``lm``; ``{task: {"acc", "acc_stderr", "acc_norm", ..., "n"}}``.

    ``manager``: a task_manager() that knows ``tasks`` already (built before the model was
    loaded); else one is built here from ``task_dirs`` and ``include_defaults`` (task_manager).
    """
    import lm_eval

    if manager is None:
        manager = task_manager(tasks, task_dirs=task_dirs, include_defaults=include_defaults)
    # One process, whatever launched it: lm-eval reads LOCAL_RANK as a tensor-parallel launch's and
    # returns results on local rank 0 only, where a launch's ranks each evaluate their own checkpoints
    local_rank = os.environ.pop("LOCAL_RANK", None)
    try:
        res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, num_fewshot=0, limit=limit,
                                      log_samples=False, bootstrap_iters=0)
    finally:
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = local_rank
    scores = {}
    for task, metrics in res["results"].items():
        row = {k.split(",")[0]: float(v) for k, v in metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "sample_len"}
        n = row["n"] = int(res.get("n-samples", {}).get(task, {}).get("effective", 0))
        for metric in ("acc", "acc_norm"):  # bootstrap_iters=0 skips stderrs: the binomial one is exact enough
            if metric in row and f"{metric}_stderr" not in row and n > 1:
                row[f"{metric}_stderr"] = math.sqrt(row[metric] * (1 - row[metric]) / (n - 1))
        scores[task] = row
    return scores
