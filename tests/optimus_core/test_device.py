"""Device and collective-backend selection, tested without the hardware."""
import pytest

from optimus_core.device import collective_backend, device_slug, peak_flops_for, resolve_device_type


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

    from optimus_core.device import DeviceUnavailableError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceUnavailableError) as e:  # the environment's, not the config's: a RuntimeError
        resolve_device_type("cuda", field="train.device")
    assert str(e.value).startswith("train.device = cuda but no CUDA device is visible (torch.cuda.is_available() "
                                   "is False")
    assert "CUDA_VISIBLE_DEVICES=''" in str(e.value) and str(e.value).endswith("or set train.device to auto or cpu")
    assert isinstance(e.value, RuntimeError)
    assert resolve_device_type("cpu") == "cpu"
    with pytest.raises(ValueError, match="^--device = 'tpu': must be one of"):
        resolve_device_type("tpu", field="--device")


def test_peaks():
    assert peak_flops_for("NVIDIA H200") == 989e12
    assert peak_flops_for("Intel(R) Data Center GPU Max 1550") == pytest.approx(419.5e12)
    assert peak_flops_for("some cpu") is None


def test_results_name_the_machine_by_a_slug_of_its_device_name(monkeypatch):
    import torch

    import optimus_core.device as device

    assert device_slug("cpu") == "cpu" and device_slug(torch.device("meta")) == "meta"
    monkeypatch.setattr(device, "resolve_device_type", lambda requested="auto": "cuda")
    monkeypatch.setattr(device, "device_name", lambda kind, index=0: f"NVIDIA H200 ({kind}:{index})")
    assert device_slug("auto") == "nvidia-h200-cuda-0"
    assert device_slug("cuda:1") == "nvidia-h200-cuda-1"


def test_each_rank_binds_its_own_device_or_says_why_not():
    from optimus_core.device import DeviceBindingError, binding_index

    tiles = [f"Intel(R) Data Center GPU Max 1550 tile {i}" for i in range(12)]
    # FLAT, no mask: the node's 12 tiles shared out by local rank
    assert [binding_index("xpu", r, 12, tiles) for r in (0, 7, 11)] == [0, 7, 11]
    # a flat mask (or the launcher) gave the rank its one tile
    assert binding_index("xpu", 7, 12, tiles[7:8], env={"ZE_AFFINITY_MASK": "7"}) == 0
    assert binding_index("cuda", 1, None, ["H200 0", "H200 1"]) == 1  # local world unknown: the rank's own
    env = {"ZE_AFFINITY_MASK": "3.1", "ZE_FLAT_DEVICE_HIERARCHY": "FLAT"}
    with pytest.raises(DeviceBindingError) as e:  # a composite mask under FLAT: nothing visible
        binding_index("xpu", 7, 12, [], rank=31, env=env, host="x4102c5s3b0n0")
    for part in ("host x4102c5s3b0n0", "rank 31 (local rank 7 of 12)", "sees no xpu device",
                 "ZE_AFFINITY_MASK=3.1", "ZE_FLAT_DEVICE_HIERARCHY=FLAT", "devices seen: none"):
        assert part in str(e.value), part
    with pytest.raises(DeviceBindingError, match="12 ranks on this node share 2 visible xpu devices.*1: tile b"):
        binding_index("xpu", 1, 12, ["tile a", "tile b"])
    with pytest.raises(DeviceBindingError, match="local rank 2 has no device of its own .2 visible.*no mask set"):
        binding_index("cuda", 2, None, ["H200 0", "H200 1"])
    assert binding_index("cuda", 0, 1, ["H200"]) == 0  # one rank, one device
    with pytest.raises(DeviceBindingError, match="4 ranks on this node share 1 visible cuda devices"):
        binding_index("cuda", 3, 4, ["H200"])  # no per-rank mask: all four would share it


def test_a_rank_that_cannot_see_its_device_stops_before_any_collective(monkeypatch):
    import torch

    from optimus_core.device import DeviceBindingError
    from optimus_core.parallel import mesh

    launch = mesh.read_launch_env({"PMI_RANK": "13", "PMI_SIZE": "24", "PALS_LOCAL_RANKID": "1",
                                   "PALS_LOCAL_SIZE": "12", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (launch.local_rank, launch.local_world) == (1, 12)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceBindingError, match="rank 13 .local rank 1 of 12.: it sees no cuda device"):
        mesh.bind_device("cuda", launch, env={})
    monkeypatch.setattr(mesh, "resolve_device_type", lambda requested="auto": "cuda")
    monkeypatch.setattr(mesh, "visible_devices", lambda kind: ["H200 0"] * 2)
    with pytest.raises(DeviceBindingError, match="12 ranks on this node share 2"):
        mesh.bind_device("auto", launch, env={})
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(mesh, "visible_devices", lambda kind: ["H200"] * 12)
    assert mesh.bind_device("auto", launch, env={}) == torch.device("cuda", 1) == bound[0]


def test_intel_extension_is_imported_only_when_a_run_asks(tmp_path, monkeypatch):
    import sys

    from optimus_core.config import ConfigError
    from optimus_core.device import import_vendor_extensions

    # a stand-in extension that says when it is imported
    (tmp_path / "intel_extension_for_pytorch.py").write_text("import os\nos.environ['IPEX_IMPORTED'] = '1'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("IPEX_IMPORTED", raising=False)
    monkeypatch.delitem(sys.modules, "intel_extension_for_pytorch", raising=False)
    for backend in ("xccl", "none"):  # many ranks or one: installed, but not asked for
        import_vendor_extensions("xpu", backend)
    assert "IPEX_IMPORTED" not in __import__("os").environ
    import_vendor_extensions("xpu", "xccl", intel_extension=True)
    assert __import__("os").environ.get("IPEX_IMPORTED") == "1"
    monkeypatch.delitem(sys.modules, "intel_extension_for_pytorch")
    (tmp_path / "intel_extension_for_pytorch.py").unlink()
    import importlib
    importlib.invalidate_caches()
    with pytest.raises(ConfigError, match="execution.intel_extension"):
        import_vendor_extensions("xpu", "none", intel_extension=True)
