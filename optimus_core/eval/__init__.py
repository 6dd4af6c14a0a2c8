"""Downstream evaluation through lm-evaluation-harness (extra ``eval``: ``pip install -e '.[eval]'``).

    from optimus_core.eval import OptimusLM, build_continuation_tasks, run_lm_eval
    lm = OptimusLM.from_run("results/runs/x")                        # an lm_eval.api.model.LM
    names = build_continuation_tasks("results/data/tokens", "/tmp/tasks")   # local YAML + JSONL
    names.append(build_docstring_task("results/data/tokens", "/tmp/tasks"))  # held-out code's docstrings
    scores = run_lm_eval(lm, names, task_dirs=["/tmp/tasks"])        # {task: {"acc": ..., ...}}

Modules: ``lm`` (the model adapter), ``tasks`` (offline continuation tasks built from the
held-out split, the runner, task-file checks), ``docstring`` (the offline docstring task).
lm_eval is imported only when these are used.
"""
from __future__ import annotations

import os

# Compute nodes and CI have no internet: datasets / hub lookups must not wait on the network
# unless the caller configured them otherwise. Set here, before lm_eval imports `datasets`
# (which reads these once, at import).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

__all__ = ["OptimusLM", "build_continuation_tasks", "build_docstring_task", "run_lm_eval", "TaskFileError"]


def __getattr__(name):  # lazy: `import optimus_core.eval` must not need lm_eval installed
    if name == "OptimusLM":
        from .lm import OptimusLM
        return OptimusLM
    if name in ("build_continuation_tasks", "run_lm_eval", "TaskFileError"):
        from . import tasks
        return getattr(tasks, name)
    if name == "build_docstring_task":
        from .docstring import build_docstring_task
        return build_docstring_task
    raise AttributeError(name)
