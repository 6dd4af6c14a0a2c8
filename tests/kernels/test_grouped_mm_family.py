"""The grouped GEMM's kernel families: which the device has (family_on), and the ceiling the
execution plan sets (use_family), which every call then keeps to, whatever its tensors allow."""
import importlib
import os

import pytest
import torch

from optimus_kernels import grouped_mm, grouped_mm_reference

gm = importlib.import_module("optimus_kernels.grouped_mm")  # the module: the package's `grouped_mm` is the function

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def ceiling():
    """Restores the process's ceiling after the test."""
    before = gm._ceiling
    yield
    gm.use_family(before)


def test_the_families_are_ordered_fastest_first_and_a_bad_name_is_refused(ceiling):
    assert list(gm.FAMILIES) == ["warp_specialized", "tma", "descriptor", "pointer"]
    with pytest.raises(ValueError, match="must be one of warp_specialized, tma, descriptor, pointer"):
        gm.use_family("cutlass")
    gm.use_family("tma")
    assert not gm.allows("warp_specialized") and gm.allows("tma") and gm.allows("descriptor") and gm.allows("pointer")
    gm.use_family("descriptor")
    assert not gm.allows("tma") and gm.allows("descriptor") and gm.allows("pointer")


def test_an_intel_gpu_has_the_descriptor_kernels_and_says_why(monkeypatch):
    """An XPU: the descriptor family (device-side tensor descriptors, Triton 3.4+), the reason
    being that the TMA family needs an NVIDIA GPU; without descriptors in its Triton, the pointer
    kernels, saying why."""
    if not hasattr(gm.tl, "make_tensor_descriptor"):
        pytest.skip("this Triton has no device-side tensor descriptors")
    family, why = gm.family_on("xpu")
    assert family == "descriptor" and "NVIDIA" in why and "PVC" in why
    monkeypatch.setattr(gm, "descriptor_device_unsupported", lambda device: "Triton 3.2 has no device-side descriptors")
    assert gm.family_on("xpu") == ("pointer", "the pointer kernels: Triton 3.2 has no device-side descriptors")


def test_the_ceiling_can_be_raised_for_a_block_and_is_restored(ceiling):
    """ceiling_at_least (the self-check's): a lower ceiling is raised to the family inside the
    block and restored after, even when the block raises; a higher one is kept."""
    gm.use_family("pointer")
    with gm.ceiling_at_least("descriptor"):
        assert gm.allows("descriptor") and not gm.allows("tma")
    assert gm._ceiling == "pointer"
    with pytest.raises(RuntimeError, match="inside"), gm.ceiling_at_least("tma"):
        raise RuntimeError("inside")
    assert gm._ceiling == "pointer"
    gm.use_family("warp_specialized")
    with gm.ceiling_at_least("descriptor"):
        assert gm.allows("warp_specialized")
    with pytest.raises(ValueError, match="must be one of"), gm.ceiling_at_least("cutlass"):
        pass


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_the_interpreter_runs_the_tma_kernels_on_the_cpu():
    family, why = gm.family_on("cpu")
    assert family == "tma" and "warp-specialized kernel needs an NVIDIA GPU" in why


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_under_a_pointer_ceiling_no_call_takes_the_tma_kernels(ceiling, monkeypatch):
    """The same shapes run the TMA kernels by default here (the interpreter) and the pointer ones
    under the ceiling, forward, dx and dW alike, with the reference's results."""
    taken = []
    for name in ("launch_grouped_mm_tma", "launch_grouped_mm_dw_tma"):
        real = getattr(gm, name)
        monkeypatch.setattr(gm, name, lambda *a, _real=real, _name=name, **kw: taken.append(_name) or _real(*a, **kw))
    torch.manual_seed(0)
    x = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(3, 16, 24, requires_grad=True)
    offsets = torch.tensor([10, 10, 33], dtype=torch.int32)
    results = {}
    for family in ("tma", "pointer"):
        gm.use_family(family)
        taken.clear()
        y = grouped_mm(x, w, offsets, backend="triton")
        dx, dw = torch.autograd.grad(y.square().sum(), (x, w))
        results[family] = (y, dx, dw, set(taken))
    assert results["tma"][3] == {"launch_grouped_mm_tma", "launch_grouped_mm_dw_tma"} and results["pointer"][3] == set()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = grouped_mm_reference(xr, wr, offsets)
    want = (y_ref, *torch.autograd.grad(y_ref.square().sum(), (xr, wr)))
    for family, (*got, _) in results.items():
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4, msg=family)
