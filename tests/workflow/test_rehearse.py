"""`optimus rehearse` on the meta device (what CI can run): every paper run's rank builds its
share of the real model, FSDP2 and all, and its size is the memory model's to the byte; the
records go to a JSON-lines file and into the store."""
import json

import pytest

from optimus_core.memory import GIB
from workflow.cli import main
from workflow.commands import rehearsal_jobs
from workflow.experiments import dag
from workflow.sites import load_site


def test_every_paper_runs_share_is_the_memory_models(tmp_path, capsys):
    out = tmp_path / "rehearsal-meta.jsonl"
    assert main(["rehearse", "--device", "meta", "--jsonl", str(out), "--store", str(tmp_path / "store.zarr")]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [r for r in records if "name" in r]
    assert [r["name"] for r in runs] == [e.name for e in dag("paper")]
    for r in runs:
        assert r["shares_gib"] == pytest.approx(r["model_shares_gib"], rel=1e-12), r["name"]
        assert r["model_gib"] <= r["budget_gib"], r["name"]  # the plan's layouts fit their tiles
    assert records[-1]["bench"] == "rehearsal_summary" and records[-1]["all_within_budget"]
    from optimus_core.store import open_store

    assert "rehearsal-meta" in set(open_store(tmp_path / "store.zarr", mode="r").runs()["run_id"])


def test_a_run_at_another_tile_count_keeps_its_layout():
    site = load_site("aurora", account="x")
    job, = rehearsal_jobs(["pretrain-mula-7b-a1b"], [12288], site)
    assert job.world == 12288 and job.run.train.global_batch == 12288  # a sequence per tile at least
    assert job.run.parallel.dp_shard == 384 and job.budget_gib == pytest.approx(64 * 0.9)
    small, = rehearsal_jobs(["scaling-mula-220b-a10b-768"], [384], site, layout="zero3-blocks")
    assert small.run.parallel.dp_shard == 0 and small.checkpointing == ("none", 1)  # 384 tiles: one block
    assert small.budget_gib * GIB > 0
    # the authors' layout of the same run: 8 stages of 48 tiles each, their recompute level 7
    theirs, = rehearsal_jobs(["scaling-mula-220b-a10b-768"], [384], site)
    assert (theirs.run.parallel.pp, theirs.run.parallel.dp_shard, theirs.checkpointing) == (8, 0, ("level7", 1))


def test_a_checkpointing_can_be_rehearsed_before_the_plan_chooses_it(tmp_path):
    def rehearsed(checkpointing):
        out = tmp_path / f"{checkpointing.replace('/', '-')}.jsonl"
        assert main(["rehearse", "--device", "meta", "--experiment", "pretrain-mula-220b-a10b", "--tiles", "3072",
                     "--checkpointing", checkpointing, "--jsonl", str(out)]) == 0
        return json.loads(out.read_text().splitlines()[0])

    planned, = rehearsal_jobs(["pretrain-mula-220b-a10b"], [3072], load_site("aurora", account="x"))
    assert planned.checkpointing != ("full", 2)
    third, half = rehearsed("full/3"), rehearsed("full/2")
    assert half["checkpointing"] == "full/2" and half["world"] == 3072
    assert third["model_gib"] > half["model_gib"]  # fewer blocks recomputed: more activations held
    for bad in ("full/0", "moe/2", "half", "full/x"):
        assert main(["rehearse", "--device", "meta", "--checkpointing", bad]) == 2


def test_a_layout_the_registry_does_not_run_is_rehearsed_with_its_plans_choices(tmp_path):
    """`--set` changes each run's config before the plan resolves it: the 220B's pipeline ranks
    holding 2 interleaved stages, its weights gathered as that layout's plan chooses (or as
    `--weight-gathers` asks), the rank's shares the memory model's."""
    def rehearsed(*extra):
        out = tmp_path / "r.jsonl"
        assert main(["rehearse", "--device", "meta", "--experiment", "pretrain-mula-220b-a10b", "--micro-batches", "0",
                     "--set", "parallel.pp_chunks=2", "--set", "parallel.pp_schedule=interleaved_1f1b",
                     *extra, "--jsonl", str(out)]) == 0
        return json.loads(out.read_text().splitlines()[0])

    planned = rehearsed()
    assert (planned["pp"], planned["pp_chunks"], planned["weight_gathers"]) == (8, 2, "per_step")
    assert planned["shares_gib"] == pytest.approx(planned["model_shares_gib"], rel=1e-12)
    from optimus_core.rehearsal import fmt

    assert "stage 0 of 8 (x 2 interleaved)" in fmt(planned)
    asked = rehearsed("--weight-gathers", "per_micro_batch")
    assert asked["weight_gathers"] == "per_micro_batch" and asked["model_gib"] < planned["model_gib"]
    assert main(["rehearse", "--device", "meta", "--experiment", "pretrain-mula-220b-a10b",
                 "--set", "parallel.pp_chunks=3"]) == 2  # a bad override: the field named, nothing built
