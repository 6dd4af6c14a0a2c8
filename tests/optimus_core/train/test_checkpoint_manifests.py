"""Per-rank checksum manifests (optimus_core.train.checkpoint): each rank hashes and lists what it
wrote; a reading rank checks only its share of them; the ranks fall back together to the newest
step that every rank found valid; a rank that cannot write its part stops the save everywhere."""
import errno
import json
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist

from optimus_core.parallel.launch import spawn_local
from optimus_core.train import checkpoint as ckpt

WORLD = 4


def _all_max(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _tensors(rank, step):  # each rank its own key: each writes a file of its own
    return {f"model/w{rank}": torch.full((5 + rank,), float(10 * step + rank))}


def _save(run_dir, step, rank, **kw):
    return ckpt.save_checkpoint(run_dir, step, tensors=_tensors(rank, step), state={"step": step}, meta={},
                                rank=rank, distributed=True, all_max=_all_max, keep=5, **kw)


def _worker(run_dir, out_dir):
    from pathlib import Path

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    rank = dist.get_rank()
    report = {}
    _save(run_dir, 1, rank)
    _save(run_dir, 2, rank)
    dist.barrier()
    if rank == 0:  # rank 2's part of step 2 goes bad
        shard = ckpt.checkpoints_dir(run_dir) / "step_000002" / "__2_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-3])
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = ckpt.latest_valid(run_dir, (rank, WORLD), _all_max)
    report["resumed"] = found.step
    report["warnings"] = [str(w.message) for w in caught]

    real = ckpt.write_rank_manifest
    if rank == 1:  # rank 1's disk is full when it writes its manifest of step 3
        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")
        ckpt.write_rank_manifest = full
    try:
        _save(run_dir, 3, rank)
        report["step3"] = "saved"
    except BaseException as e:  # noqa: BLE001
        report["step3"] = f"{type(e).__name__}: {e}"
    finally:
        ckpt.write_rank_manifest = real
    (out_dir / f"{rank}.json").write_text(json.dumps(report))


def _init_and_run(run_dir, out_dir):
    dist.init_process_group("gloo")
    try:
        _worker(run_dir, out_dir)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("manifests")
    spawn_local(_init_and_run, WORLD, (str(root / "run"), str(root)), start_method="fork")
    reports = {r: json.loads((root / f"{r}.json").read_text()) for r in range(WORLD)}
    return root / "run", reports


def test_each_rank_lists_only_what_it_wrote(four_ranks):
    run_dir, _ = four_ranks
    path = ckpt.checkpoints_dir(run_dir) / "step_000001"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["manifests"] == WORLD and sorted(meta["files"]) == [".metadata", "state.pt"]
    for rank in range(WORLD):
        manifest = json.loads((path / ckpt.manifest_name(rank)).read_text())
        assert manifest["files"].keys() == {f"__{rank}_0.distcp"}
        assert (manifest["save_id"], manifest["step"], manifest["rank"]) == (meta["save_id"], 1, rank)
    with pytest.warns(UserWarning, match="__2_0.distcp fails"):  # one reader of everything: step 2 is bad
        assert torch.equal(ckpt.latest_valid(run_dir).load_model_state()["w3"], torch.full((8,), 13.0))


def test_the_ranks_fall_back_together_and_the_bad_rank_says_why(four_ranks):
    _, reports = four_ranks
    assert {r["resumed"] for r in reports.values()} == {1}
    assert reports[2]["warnings"] == [f"skipping checkpoint (rank 2): {reports[2]['warnings'][0].split(': ', 1)[1]}"]
    assert "__2_0.distcp fails its sha256 checksum (listed in manifests/rank_00002.json)" in reports[2]["warnings"][0]
    assert reports[0]["warnings"] == [reports[0]["warnings"][0]] and "another rank found its part invalid" \
        in reports[0]["warnings"][0]
    assert reports[1]["warnings"] == reports[3]["warnings"] == []


def test_a_rank_that_cannot_write_its_part_stops_the_save_everywhere(four_ranks):
    run_dir, reports = four_ranks
    assert reports[1]["step3"].startswith("DiskFullError: writing checkpoint step 3 to ")
    assert "No space left on device" in reports[1]["step3"]
    for rank in (0, 2, 3):
        assert reports[rank]["step3"].startswith("RuntimeError: checkpoint step 3: another rank failed")
    root = ckpt.checkpoints_dir(run_dir)
    assert [p.name for p in ckpt.list_step_dirs(run_dir)] == ["step_000001", "step_000002"]
    assert not list(root.glob(".step_000003*"))  # the temporary directory went too


@pytest.mark.parametrize("rank, world, manifests", [(1, 4, [1]), (0, 3, [0, 3]), (2, 3, [2]), (0, 1, [0, 1, 2, 3])])
def test_a_reader_checks_the_shared_files_and_its_share_of_the_manifests(four_ranks, monkeypatch, rank, world,
                                                                         manifests):
    run_dir, _ = four_ranks
    hashed = []
    real = ckpt._sha256
    monkeypatch.setattr(ckpt, "_sha256", lambda p: hashed.append(p.name) or real(p))
    ckpt.validate(ckpt.checkpoints_dir(run_dir) / "step_000001", (rank, world))
    assert sorted(hashed) == sorted([".metadata", "state.pt"] + [f"__{i}_0.distcp" for i in manifests])


def _one_process_save(run_dir, step):
    return ckpt.save_checkpoint(run_dir, step, tensors=_tensors(0, step), state={"step": step}, meta={}, keep=5)


def test_a_part_from_another_checkpoint_is_refused_by_name(tmp_path):
    """A shard and its manifest copied in from another run's save of the same step: its own
    checksums hold, so the save id is what tells."""
    mine, other = _one_process_save(tmp_path / "mine", 1), _one_process_save(tmp_path / "other", 1)
    for name in ("__0_0.distcp", ckpt.manifest_name(0)):
        shutil.copy(other / name, mine / name)
    with pytest.raises(ValueError, match=r"manifests/rank_00000.json is from another checkpoint \(save '\w+' of "
                                         r"step 1; this one is save '\w+' of step 1\)"):
        ckpt.validate(mine)


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / ckpt.manifest_name(0)).unlink(), r"manifests/rank_00000.json is missing \(meta.json lists 1"),
    (lambda p: (p / ckpt.manifest_name(0)).write_text("{"), r"rank_00000.json is not valid JSON"),
    (lambda p: (p / "state.pt").write_bytes(b"not a pickle"), r"state.pt fails its sha256 checksum \(listed in meta"),
    (lambda p: (p / "__0_0.distcp").unlink(), r"__0_0.distcp is missing \(listed in manifests/rank_00000.json\)"),
])
def test_each_damage_is_named_and_the_previous_step_is_used(tmp_path, damage, message):
    _one_process_save(tmp_path, 1)
    damage(_one_process_save(tmp_path, 2))
    with pytest.warns(UserWarning, match=message):
        assert ckpt.latest_valid(tmp_path).step == 1


def test_setting_aside_moves_the_newer_steps_and_never_deletes_an_earlier_set_aside(tmp_path):
    _one_process_save(tmp_path, 1)
    _one_process_save(tmp_path, 2)
    assert ckpt.set_aside(tmp_path, 1) == [ckpt.checkpoints_dir(tmp_path) / ckpt.INVALID / "step_000002"]
    _one_process_save(tmp_path, 2)  # the same step written again, and found invalid again
    assert ckpt.set_aside(tmp_path, 1) == [ckpt.checkpoints_dir(tmp_path) / ckpt.INVALID / "step_000002.1"]
    assert [p.name for p in ckpt.list_step_dirs(tmp_path)] == ["step_000001"]
    assert sorted(p.name for p in (ckpt.checkpoints_dir(tmp_path) / ckpt.INVALID).iterdir()) == \
        ["step_000002", "step_000002.1"]
