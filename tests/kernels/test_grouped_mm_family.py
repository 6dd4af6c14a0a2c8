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
    assert list(gm.FAMILIES) == ["warp_specialized", "tma", "pointer"]
    with pytest.raises(ValueError, match="must be one of warp_specialized, tma, pointer"):
        gm.use_family("cutlass")
    gm.use_family("tma")
    assert not gm.allows("warp_specialized") and gm.allows("tma") and gm.allows("pointer")


def test_an_intel_gpu_has_the_pointer_kernels_and_says_why():
    family, why = gm.family_on("xpu")
    assert family == "pointer" and "NVIDIA" in why


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
