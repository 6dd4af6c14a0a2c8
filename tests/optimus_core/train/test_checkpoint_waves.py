"""Checkpoint writes over data-parallel replicas: in waves, each after the one before (at most 1/W
of the replicas writing at once, as the manifests' windows show), and a part the replicas hold
alike written once, its bytes spread over them (DCP's deduplication)."""
import json

import pytest

from optimus_core import presets
from optimus_core.parallel.launch import spawn_local
from optimus_core.train import checkpoint as ckpt
from optimus_core.train.loop import Trainer
from ranks import fit_on_rank


def _cfg(**extra):
    return presets.get("mula-7b-a1b@laptop").run_config(**{
        "train.steps": 2, "train.eval_batches": 1, "train.device": "cpu", "train.global_batch": 4,
        "data.seq_len": 32, "model.n_layers": 1, "model.moe.n_experts": 4, "model.moe.top_k": 2, **extra})


def _manifests(run_dir):
    [step] = ckpt.list_step_dirs(run_dir)
    return step, [json.loads(p.read_text()) for p in sorted((step / ckpt.MANIFESTS).glob("rank_*.json"))]


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_ranks_write_in_waves_by_replica_one_wave_after_the_other(tmp_path, tokens_dir, async_checkpoint):
    cfg = _cfg(**{"train.checkpoint_write_waves": 2, "train.async_checkpoint": async_checkpoint})
    spawn_local(fit_on_rank, 4, (cfg.to_json(), tokens_dir, tmp_path / "run"), start_method="fork")
    step, manifests = _manifests(tmp_path / "run")
    assert [m["wave"] for m in manifests] == [0, 1, 0, 1] and {m["waves"] for m in manifests} == {2}
    first = [m["write_window"] for m in manifests if m["wave"] == 0]
    second = [m["write_window"] for m in manifests if m["wave"] == 1]
    assert min(s for s, _ in second) >= max(e for _, e in first)  # wave 1 starts once wave 0 is done
    assert ckpt.concurrent_writers(step) <= 2
    assert ckpt.latest_valid(tmp_path / "run").step == 2  # and the checkpoint is whole


def test_replicated_parts_are_written_once_spread_over_the_replicas(tmp_path, tokens_dir):
    # 2 replicas of a 2-rank sharding block (HSDP): each rank writes about a quarter of one copy
    spawn_local(fit_on_rank, 4, (_cfg(**{"parallel.dp_shard": 2}).to_json(), tokens_dir, tmp_path / "hsdp"),
                start_method="fork")
    Trainer(_cfg(), tokens_dir, tmp_path / "one", progress=False).fit()
    sizes = [p.stat().st_size for p in sorted(ckpt.list_step_dirs(tmp_path / "hsdp")[0].glob("*.distcp"))]
    one = sum(p.stat().st_size for p in ckpt.list_step_dirs(tmp_path / "one")[0].glob("*.distcp"))
    assert len(sizes) == 4 and sum(sizes) < 1.02 * one  # one copy (and each rank's RNG rows)
    assert min(sizes) > 0.2 * sum(sizes)  # the second replica writes its share, not nothing


def test_concurrent_writers_counts_overlapping_windows(tmp_path):
    (tmp_path / ckpt.MANIFESTS).mkdir()
    for rank, window in enumerate([(0, 2), (1, 3), (2, 4), (5, 6)]):
        (tmp_path / ckpt.manifest_name(rank)).write_text(json.dumps({"write_window": window}))
    assert ckpt.concurrent_writers(tmp_path) == 2  # (0,2) and (1,3); (2,4) starts as (0,2) ends
