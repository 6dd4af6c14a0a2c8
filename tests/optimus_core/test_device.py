"""Device and collective-backend selection, tested without the hardware."""
import pytest

from optimus_core.device import collective_backend, peak_flops_for, resolve_device_type


def test_backend_per_device():
    assert collective_backend("cpu") == "gloo"
    assert collective_backend("cuda") == "nccl"


def test_xpu_prefers_torch_xccl_and_falls_back_to_oneccl_bindings():
    assert collective_backend("xpu", torch_version="2.10.0+xpu", have_xccl=True) == "xccl"
    assert collective_backend("xpu", torch_version="2.5.1", have_xccl=False, have_oneccl_bindings=True) == "ccl"
    with pytest.raises(RuntimeError, match="xccl"):
        collective_backend("xpu", torch_version="2.5.1", have_xccl=False, have_oneccl_bindings=False)


def test_explicit_device_that_is_absent_is_an_error(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no cuda device"):
        resolve_device_type("cuda")
    assert resolve_device_type("cpu") == "cpu"
    with pytest.raises(ValueError, match="must be one of"):
        resolve_device_type("tpu")


def test_peaks():
    assert peak_flops_for("NVIDIA H200") == 989e12
    assert peak_flops_for("Intel(R) Data Center GPU Max 1550") == pytest.approx(419.5e12)
    assert peak_flops_for("some cpu") is None
