"""The kernels' self-check: each family passes against its reference here, a failing or broken
kernel is caught and named, the verdict is cached per device with one warning, and a model
whose expert kernels fail trains on the loop."""
import os
import warnings

import pytest
import torch

from kernels import selfcheck

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton kernels on CPU need TRITON_INTERPRET=1")


@interpreted
@pytest.mark.parametrize("kernel", sorted(selfcheck.CHECKS))
def test_each_family_passes_its_check_in_the_interpreter(kernel):
    assert selfcheck.check(kernel, "cpu") is None


def test_a_wrong_or_broken_kernel_is_named(monkeypatch):
    def wrong(device):
        selfcheck._close("grouped_mm dx (torch.bfloat16)", torch.ones(3), torch.zeros(3) + 0.5, 1e-2)

    def broken(device):
        raise RuntimeError("CompilationError: at 12:4: unsupported op\nmore lines")

    monkeypatch.setitem(selfcheck.CHECKS, "experts", wrong)
    assert selfcheck.check("experts", "cpu").startswith("AssertionError: grouped_mm dx (torch.bfloat16): max error 0.5")
    monkeypatch.setitem(selfcheck.CHECKS, "experts", broken)
    assert selfcheck.check("experts", "cpu") == "RuntimeError: CompilationError: at 12:4: unsupported op"
    with pytest.raises(ValueError, match="kernel = 'gemm': unknown; known: experts, adamw, cross_entropy"):
        selfcheck.check("gemm", "cpu")


def test_an_accelerator_is_checked_once_and_a_failure_warns_once(monkeypatch):
    calls = []
    monkeypatch.setattr(selfcheck, "INTERPRET", False)
    monkeypatch.setattr(selfcheck, "launchable_on", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Intel(R) Data Center GPU Max 1550")
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    monkeypatch.setattr(selfcheck, "check", lambda kernel, device: calls.append(kernel) or (
        "RuntimeError: no XPU codegen" if kernel == "experts" else None))
    with pytest.warns(RuntimeWarning, match=r"the Triton experts kernels failed their self-check on "
                                            r"cuda:Intel\(R\) Data Center GPU Max 1550 \(RuntimeError: no XPU codegen\)"):
        assert not selfcheck.validated("experts", "cuda:0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert not selfcheck.validated("experts", "cuda:1")
        assert selfcheck.validated("adamw", "cuda")
    assert calls == ["experts", "adamw"]


def test_a_model_whose_expert_kernels_fail_trains_on_the_loop(monkeypatch):
    from optimus_core import presets
    from optimus_core.model.experts import Experts
    from optimus_core.train import build

    cfg = presets.get("mula-7b-a1b@laptop").run_config(**{"model.moe.experts_backend": "triton",
                                                          "train.device": "cpu", "model.n_layers": 1})
    monkeypatch.setattr(selfcheck, "validated", lambda kernel, device: False)
    model = build.build_model(cfg)
    backends = {m.backend for m in model.modules() if isinstance(m, Experts)}
    assert backends == {"loop"} and cfg.model.moe.experts_backend == "triton"
