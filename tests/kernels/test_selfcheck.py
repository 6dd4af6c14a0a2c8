"""The kernels' self-check: each family passes against its reference here, a failing or broken
kernel is caught and named, the verdict is cached per device with one warning, and a run whose
expert kernels fail is planned on the next choice (optimus_core.execution)."""
import importlib
import os
import warnings

import pytest
import torch

import optimus_kernels.hopper.grouped_mm_ws as ws
from optimus_kernels import grouped_mm_reference, selfcheck

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton kernels on CPU need TRITON_INTERPRET=1")


@interpreted
@pytest.mark.parametrize("kernel", sorted(selfcheck.CHECKS))
def test_each_family_passes_its_check_in_the_interpreter(kernel):
    assert selfcheck.check(kernel, "cpu") is None


@interpreted
def test_the_experts_check_takes_the_forward_and_dx_kernels_a_run_takes_on_hopper(monkeypatch):
    """Its shapes pass the warp-specialized kernel's shape rules (ws_unsupported less the device,
    which the interpreter is not, for bf16, the self-check's dtype on a GPU), so on Hopper the
    self-check runs the kernels a run's experts run; the kernel itself is stood in for by the
    reference here (Gluon has no interpreter)."""
    gm = importlib.import_module("optimus_kernels.grouped_mm")  # the module: the package's `grouped_mm` is the function
    calls = []

    def stand_in(x, w, offsets, y, *, trans_w=False):
        calls.append(trans_w)
        return y.copy_(grouped_mm_reference(x, w.transpose(1, 2) if trans_w else w, offsets))

    def shape_rules(x, w, y, trans_w=False):
        return ws._shape_unsupported(*(t.bfloat16() for t in (x, w, y)), trans_w)

    monkeypatch.setattr(gm, "ws_unsupported", shape_rules)
    monkeypatch.setattr(gm, "launch_grouped_mm_ws", stand_in)
    assert selfcheck.check("experts", "cpu") is None
    assert sorted(set(calls)) == [False, True]  # the forward and dx both


@interpreted
def test_the_experts_check_runs_both_swiglu_epilogues_a_run_takes_on_hopper(monkeypatch):
    """Its MLP passes the SwiGLU epilogues' shape rules (bf16, the device stood in), so on
    Hopper the self-check runs the fused forward and backward a run's experts run; the fused
    kernels themselves are stood in for by the unfused ones here (Gluon has no interpreter)."""
    from optimus_kernels.swiglu import _launch_swiglu, _launch_swiglu_weighted_bwd

    mlp = importlib.import_module("optimus_kernels.expert_mlp")
    calls = []
    rules = ws.swiglu_unsupported, ws.swiglu_backward_unsupported
    monkeypatch.setattr(ws, "ws_device_unsupported", lambda device: None)
    monkeypatch.setattr(mlp, "swiglu_unsupported", lambda *t: rules[0](*(a.bfloat16() for a in t[:4]), t[4]))
    monkeypatch.setattr(mlp, "swiglu_backward_unsupported", lambda *t: rules[1](*(a.bfloat16() for a in t[:4]), t[4]))

    def forward(x, w, offsets, h, *, swiglu_out, row_weight):
        calls.append("forward")
        h.copy_(grouped_mm_reference(x, w, offsets))
        swiglu_out.copy_(_launch_swiglu(h, row_weight))

    def backward(dy, w, offsets, h, dh, row_weight):
        calls.append("backward")
        dh_, d_row_weight = _launch_swiglu_weighted_bwd(h, row_weight, grouped_mm_reference(dy, w.transpose(1, 2),
                                                                                             offsets))
        dh.copy_(dh_)
        return d_row_weight

    monkeypatch.setattr(mlp, "launch_grouped_mm_ws", forward)
    monkeypatch.setattr(mlp, "launch_grouped_mm_ws_swiglu_backward", backward)
    assert selfcheck.check("experts", "cpu") is None
    assert calls == ["forward", "backward"]


@interpreted
def test_the_experts_check_runs_the_descriptor_kernels_an_xpu_takes(monkeypatch):
    """On an XPU family_on names the descriptor family (stood in for here: the device is the
    CPU); the experts check then runs the GEMMs' forward, dx and dW by the descriptor kernels,
    also where a lower ceiling was set before it (kept after), and its shapes pass the family's
    rules in bf16, the check's dtype on an XPU (the device rule stood in)."""
    import optimus_kernels.hopper.grouped_mm_tma as gm_tma

    gm = importlib.import_module("optimus_kernels.grouped_mm")
    xpu = gm.family_on("xpu")
    if xpu[0] != "descriptor":
        pytest.skip(xpu[1])
    monkeypatch.setattr(gm, "family_on", lambda device: xpu)
    calls = []

    def xpu_rules(x, w, y):
        with monkeypatch.context() as m:
            m.setattr(gm_tma, "INTERPRET", False)
            m.setattr(gm_tma, "descriptor_device_unsupported", lambda device: None)
            return gm_tma.descriptor_unsupported(*(t.bfloat16() for t in (x, w, y)))

    def spy(x, w, offsets, y, **kw):
        calls.append(("mm", kw.get("trans_w", False), xpu_rules(x, w, y)))
        return gm_tma.launch_grouped_mm_tma(x, w, offsets, y, **kw)

    def spy_dw(x, dy, offsets, dw, **kw):
        calls.append(("dw", None, xpu_rules(x, dw, dy)))
        return gm_tma.launch_grouped_mm_dw_tma(x, dy, offsets, dw, **kw)

    monkeypatch.setattr(gm, "launch_grouped_mm_tma", spy)
    monkeypatch.setattr(gm, "launch_grouped_mm_dw_tma", spy_dw)
    before = gm._ceiling
    gm.use_family("pointer")
    try:
        assert selfcheck.check("experts", "cpu") is None
        assert gm._ceiling == "pointer"
    finally:
        gm.use_family(before)
    assert {call[:2] for call in calls} == {("mm", False), ("mm", True), ("dw", None)}
    assert {call[2] for call in calls} == {None}


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
        assert selfcheck.failure("experts", "cuda") == "RuntimeError: no XPU codegen"  # the reason, cached
        assert selfcheck.failure("adamw", "cuda:0") is None
    assert calls == ["experts", "adamw"]


def test_a_run_whose_expert_kernels_fail_is_planned_on_the_loop(monkeypatch):
    """Under "auto" the plan takes the next choice and says why; the model built from it computes
    its experts that way. Explicit "triton" is an error that names the choice and the failure."""
    import optimus_kernels._triton
    from optimus_core import presets
    from optimus_core.execution import ExecutionError, resolve_choices
    from optimus_core.model.experts import Experts
    from optimus_core.train import build

    cfg = presets.get("mula-7b-a1b@laptop").run_config(**{"train.device": "cpu", "model.n_layers": 1})
    monkeypatch.setattr(optimus_kernels._triton, "launchable_on", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no torch._grouped_mm fast path either
    monkeypatch.setattr(selfcheck, "failure", lambda kernel, device: "RuntimeError: no codegen"
                        if kernel == "experts" else None)
    plan = resolve_choices(cfg, "cuda")
    assert plan.experts == "loop" and "RuntimeError: no codegen" in plan.why["experts"]
    assert plan.adamw == "triton"  # only the failing family falls back
    model = build.build_model(cfg, device="meta", plan=plan)
    assert {m.backend for m in model.modules() if isinstance(m, Experts)} == {"loop"}
    with pytest.raises(ExecutionError, match="execution.experts = 'triton'.*RuntimeError: no codegen"):
        resolve_choices(cfg.replace(execution=cfg.execution.replace(experts="triton")), "cuda")
