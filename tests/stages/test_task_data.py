"""`optimus task-data`: lm-eval's tasks loaded once into the datasets cache, each task's document
count said; an unknown task is one line naming the known ones."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from optimus_core.eval.tasks import build_continuation_tasks, fetch_task_data  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_task_data_loads_each_task_and_counts_its_documents(small_tokens, tmp_path):
    names = build_continuation_tasks(small_tokens, tmp_path / "tasks", n_items=7)
    counts = fetch_task_data(names, task_dirs=[tmp_path / "tasks"])
    assert set(counts) == set(names) and all(n == 7 for n in counts.values())

    env = dict(os.environ, PYTHONPATH=str(REPO), HF_DATASETS_CACHE=str(tmp_path / "hf"))
    cmd = [sys.executable, "-m", "workflow.cli", "task-data", "--tasks", names[0], "--task-dir",
           str(tmp_path / "tasks"), "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc == {"cache": str(tmp_path / "hf"), "documents": {names[0]: 7}}
    assert any((tmp_path / "hf").iterdir())  # the datasets library cached it there

    bad = subprocess.run([*cmd[:4], "--tasks", "arc_esay", "--task-dir", str(tmp_path / "tasks")], env=env,
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "arc_esay" in bad.stderr
