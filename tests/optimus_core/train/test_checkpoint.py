"""Checkpoint retention, publication and format, without a model: tiny tensors."""
import json

import pytest
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
    assert (found.meta["format"], found.meta["version"]) == (ckpt.FORMAT, ckpt.VERSION)
    assert found.meta["optimus"].startswith("Optimus ")  # the revision that wrote it
    assert torch.equal(found.load_model_state()["w"], torch.full((3,), 7.0))



@pytest.mark.parametrize("format_, version, wrote", [("dcp", 2, None), ("torch", None, None),
                                                     ("dcp", 4, "Optimus abc123")])
def test_a_checkpoint_of_another_format_is_refused_in_one_line_and_left_where_it_is(tmp_path, format_, version,
                                                                                   wrote):
    """Not skipped as damaged (a resume would start over past it) nor set aside: refused, naming
    its format, its version and what wrote it."""
    save(tmp_path, 3)
    save(tmp_path, 5)
    meta_path = ckpt.checkpoints_dir(tmp_path) / "step_000005" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("optimus")
    meta.update(format=format_, **({"optimus": wrote} if wrote else {}))
    if version is None:
        meta.pop("version")
    else:
        meta["version"] = version
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointFormatError) as refused:
        ckpt.latest_valid(tmp_path)
    line = str(refused.value)
    assert "\n" not in line and f"format {format_!r} version {version or 1}" in line
    assert (wrote or "an earlier Optimus") in line and f"reads format 'dcp' version {ckpt.VERSION} only" in line
    assert steps(tmp_path) == [3, 5]
