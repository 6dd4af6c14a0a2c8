"""The Snakemake DAG: a dry run lists it, a real run builds the report, a rerun does nothing."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = [sys.executable, "-m", "snakemake", "--profile", "workflow/profiles/laptop", "--nolock"]


def snakemake(*args, results: Path, extra_config=()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    cmd = [*SNAKEMAKE, *args, "--config", f"results={results}", *extra_config]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_dry_run_lists_every_stage_and_runs_nothing(tmp_path):
    out = snakemake("-n", results=tmp_path / "results")
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    for rule, count in {"corpus": 1, "tokenize": 1, "pretrain": 2, "evaluate": 2, "figures": 1, "report": 1}.items():
        assert any(line.split() == [rule, str(count)] for line in text.splitlines()), rule
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_whole_pipeline_then_nothing_to_do(tmp_path):
    results = tmp_path / "results"
    smoke = ['pretrain_set=["train.steps=4","train.eval_every=2","train.eval_batches=1"]',
             "eval_max_batches=2", "eval_items=10"]
    first = snakemake("--cores", "2", results=results, extra_config=smoke)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    report = (results / "report.md").read_text()
    for run in ("laptop-pretrain-mula-1b", "laptop-pretrain-mula-7b-a1b"):
        assert run in report
        assert (results / "runs" / run / "eval.json").is_file()
    assert "Downstream tasks (lm-evaluation-harness)" in report
    for name in ("loss", "heldout", "throughput", "expert_load"):
        assert (results / "figures" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    second = snakemake("--cores", "2", results=results, extra_config=smoke)
    assert second.returncode == 0
    assert "Nothing to be done" in second.stdout + second.stderr
