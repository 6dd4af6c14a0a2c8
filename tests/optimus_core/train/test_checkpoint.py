"""Checkpoint retention and publication, without a model: tiny tensors."""
import torch

from optimus_core.train import checkpoint as ckpt


def save(run_dir, step, **kw):
    return ckpt.save_checkpoint(run_dir, step, tensors={"model/w": torch.full((3,), float(step))}, state={},
                                meta={}, **kw)


def steps(run_dir):
    return [int(p.name.split("_")[1]) for p in ckpt.list_step_dirs(run_dir)]


def test_keeps_the_newest_n_and_every_mth(tmp_path):
    for step in range(1, 13):
        save(tmp_path, step, keep=2, keep_every=5)
    assert steps(tmp_path) == [5, 10, 11, 12]
    assert not (tmp_path / "checkpoints" / "latest").exists()  # no pointer to disagree with the steps
    assert ckpt.latest_valid(tmp_path).step == 12


def test_without_keep_every_only_the_newest_remain(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step, keep=3)
    assert steps(tmp_path) == [3, 4, 5]


def test_temporary_directories_are_never_taken_for_checkpoints(tmp_path):
    save(tmp_path, 1)
    (tmp_path / "checkpoints" / ".step_000002.tmp-abc").mkdir()  # a save killed mid-way
    assert steps(tmp_path) == [1] and ckpt.latest_valid(tmp_path).step == 1


def test_a_checkpoint_reads_back_whole(tmp_path):
    save(tmp_path, 7)
    found = ckpt.latest_valid(tmp_path)
    assert found.format == "dcp" and found.meta["version"] == ckpt.VERSION
    assert torch.equal(found.load_model_state()["w"], torch.full((3,), 7.0))

