"""The Snakemake DAG: a dry run lists it, a real run builds the report, a rerun does nothing."""
import json
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
    jobs = {"corpus": 1, "tokenize": 1, "pretrain": 5, "evaluate": 5, "figure": 10, "report": 1, "reference": 1,
            "paper_plan": 1, "scaling": 1, "ingest_bench": 5, "perfmodel": 1, "total": 33}
    assert job_counts(text) == {**jobs, "all": 1}
    assert not (tmp_path / "results").exists()
    # the scale-up runs are evaluated on held-out loss alone (scaleup_eval), the 4T runs on every
    # task at every kept checkpoint (the paper's evaluation against tokens)
    evaluate = {line.split("--run ", 1)[1].split()[0].rsplit("/", 1)[1]: line.split("--tasks ", 1)[1].split(" --items")[0]
                for line in text.splitlines() if "optimus evaluate --run" in line}
    assert evaluate == {**{f"laptop-pretrain-{m}": "heldout continuation docstring --downstream-all-checkpoints"
                           for m in ("mula-1b", "mula-7b-a1b")},
                        **{f"laptop-pretrain-{m}": "heldout" for m in ("mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b")}}


def job_counts(text: str) -> dict[str, int]:
    """The "Job stats" table of a dry run: rule -> jobs."""
    table = text.split("Job stats:", 1)[1].split("\n\n", 1)[0].splitlines()[3:]
    return {rule: int(count) for rule, count in (line.split() for line in table)}


@pytest.mark.parametrize("figure, jobs", [
    # the scaling study only: no corpus, no tokens, no training
    ("scaling.png", {"scaling": 1, "ingest_bench": 2, "perfmodel": 1, "figure": 1, "total": 5}),
    ("ablation.png", {"ingest_bench": 2, "figure": 1, "total": 3}),  # the GPU results only
    ("loss.png", {"corpus": 1, "tokenize": 1, "pretrain": 5, "figure": 1, "total": 8}),  # no evaluation
    ("eval_table.png", {"corpus": 1, "tokenize": 1, "pretrain": 5, "evaluate": 5, "figure": 1, "total": 13}),
    # the evaluations and the reference model's published scores
    ("downstream.png", {"corpus": 1, "tokenize": 1, "pretrain": 5, "evaluate": 5, "reference": 1, "figure": 1,
                        "total": 14}),
    # the MoE runs only (three scale-up runs and mula-7b-a1b): not mula-1b, no evaluation
    ("scaleup.png", {"corpus": 1, "tokenize": 1, "pretrain": 4, "figure": 1, "total": 7}),
])
def test_a_figure_target_builds_only_what_that_figure_needs(tmp_path, figure, jobs):
    results = tmp_path / "results"
    out = snakemake("-n", str(results / "figures" / figure), results=results)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert job_counts(text) == jobs
    assert not results.exists()
    if figure == "scaleup.png":
        trained = {line.split("--experiment ", 1)[1].split()[0] for line in text.splitlines() if "--experiment" in line}
        assert trained == {"pretrain-mula-7b-a1b", "pretrain-mula-20b-a2b", "pretrain-mula-100b-a7b",
                           "pretrain-mula-220b-a10b"}


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
    # the scale-up section: the MoE runs smallest first, each trained and evaluated on held-out loss
    scaleup = report.split("## Scale-up\n", 1)[1].split("\n## ", 1)[0]
    moe = ["mula-7b-a1b", "mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b"]
    rows = [line for line in scaleup.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [f"laptop-pretrain-{m}" for m in moe]
    assert all(row.split(" | ")[4] == "8,192" and "–" not in row for row in rows)  # 4 steps x 2048 tokens
    for m in moe[1:]:
        assert "downstream" not in json.loads((results / "runs" / f"laptop-pretrain-{m}" / "eval.json").read_text())
    assert "](figures/scaleup.png)" in scaleup
    for name in ("loss", "heldout", "throughput", "expert_load", "scaling", "scaling_breakdown", "scaleup"):
        assert (results / "figures" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the scaling study: the CPU sweep measured here, the H200 sweeps of bench/results/ with their
    # 4-GPU points held out, and the paper's sweep predicted on Aurora, all from the store
    study = json.loads((results / "perfmodel.json").read_text())
    # the CPU sweep is fitted on batch 16 (whole and in micro-batches of 2) and predicts the
    # 2-rank points at batch 8 (whole and in micro-batches of 2), for EP = 1 and EP = n
    # (stages/scaling.py)
    assert sorted(h["sweep"] for h in study["holdout"]) == [
        "mula-7b-a1b nvidia-h200 EP=1", "mula-7b-a1b nvidia-h200 EP=n",
        *(f"mula-7b-a1b@laptop cpu EP={ep} batch {b}" for ep in ("1", "n") for b in ("8", "8 micro 2"))]
    scaling = report.split("## Strong scaling\n", 1)[1].split("\n## ", 1)[0]
    for h in study["holdout"]:
        assert f"| {h['devices']} | {h['ep']} | {h['optimizer']} | {h['fit_devices']} | {h['measured_s']:.4g} | " \
               f"{h['predicted_s']:.4g} | {h['rel_error']:+.1%} |" in scaling
    assert f"predicts **{study['paper']['efficiency'][-1]:.0%}** strong-scaling efficiency" in scaling
    assert "*mula-7b-a1b@laptop on cpu [EP=n batch 16] (ep_aware)*" in scaling
    assert (results / "bench" / "distributed-strong-weak-nvidia-h200.ingested").read_text().startswith(
        "wrote run bench-distributed-strong-weak-nvidia-h200 (7 records)")
    second = snakemake("--cores", "2", results=results, extra_config=smoke)
    assert second.returncode == 0
    assert "Nothing to be done" in second.stdout + second.stderr
