"""HostStaging: host copies for the checkpoint writer, their buffers kept between saves."""
import pytest
import torch

from optimus_core.train.staging import HostStaging


def _tensors():
    return {"model/w": torch.arange(12.0).reshape(3, 4), "optim/w/step": torch.tensor(3.0), "meta": "kept"}


def test_a_foreground_write_reads_host_tensors_in_place():
    tensors = _tensors()
    staged = HostStaging().stage(tensors, snapshot=False)
    assert all(staged[k] is tensors[k] for k in tensors)


def test_a_snapshot_is_a_copy_that_later_changes_do_not_reach():
    tensors, staging = _tensors(), HostStaging()
    staged = staging.stage(tensors, snapshot=True)
    assert staged["meta"] == "kept" and staging.nbytes == 13 * 4
    assert staged["model/w"].data_ptr() != tensors["model/w"].data_ptr()
    tensors["model/w"].add_(100.0)  # training goes on while the snapshot is written
    assert torch.equal(staged["model/w"], torch.arange(12.0).reshape(3, 4))


def test_the_next_stage_copies_into_the_same_buffers_and_a_new_shape_gets_a_new_one():
    tensors, staging = _tensors(), HostStaging()
    first = staging.stage(tensors, snapshot=True)["model/w"].data_ptr()
    tensors["model/w"].mul_(2.0)
    again = staging.stage(tensors, snapshot=True)
    assert again["model/w"].data_ptr() == first and torch.equal(again["model/w"], tensors["model/w"])
    tensors["model/w"] = torch.ones(5, 4, dtype=torch.bfloat16)
    other = staging.stage(tensors, snapshot=True)["model/w"]
    assert other.dtype == torch.bfloat16 and other.shape == (5, 4) and torch.equal(other, tensors["model/w"])
    staging.release()
    assert staging.nbytes == 0


@pytest.mark.gpu
def test_device_tensors_are_staged_into_pinned_buffers_once_complete():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tensors, staging = {"w": torch.randn(1024, 1024, device="cuda")}, HostStaging()
    for _ in range(2):
        tensors["w"].mul_(3.0)  # queued on the stream the copies follow
        staged = staging.stage(tensors, snapshot=False)["w"]
        assert staged.device.type == "cpu" and staged.is_pinned()
        assert torch.equal(staged, tensors["w"].cpu())  # stage returned after the copy, not before
