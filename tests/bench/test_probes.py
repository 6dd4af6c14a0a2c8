"""bench/probes.py: variant names with a probe, and each probe's patch in effect inside its block
and gone after it."""
import argparse
import dataclasses
import importlib

import pytest
import torch

from bench import probes


def test_split_and_the_argparse_type():
    assert probes.split("7b8l-default") == ("7b8l-default", ())
    assert probes.split("7b8l-default~tma") == ("7b8l-default", ("tma",))
    assert probes.split("7b8l-default~tma~programs-116") == ("7b8l-default", ("tma", "programs-116"))
    for bad in ("7b8l-default~nope", "7b8l-default~programs-0", "7b8l-default~programs-x", "7b8l-default~tma~"):
        with pytest.raises(ValueError, match="unknown probe"):
            probes.split(bad)
    check = probes.variant_type({"7b8l-default": None})
    assert check("7b8l-default~update-after") == "7b8l-default~update-after"
    with pytest.raises(argparse.ArgumentTypeError, match="not a variant"):
        check("7b8l-other~tma")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown probe"):
        check("7b8l-default~fast")


def test_tma_probe_turns_the_warp_specialized_kernel_down():
    gm = importlib.import_module("kernels.grouped_mm")  # the package's attribute is the function
    real = gm.ws_unsupported
    with probes.applied("7b8l-default~tma"):
        assert gm.ws_unsupported(None, None, None, trans_w=True) == "probe: the TMA kernel"
    assert gm.ws_unsupported is real
    tma = importlib.import_module("kernels.grouped_mm_tma")
    with probes.applied("7b8l-default~tma~programs-2"):  # two probes at once
        assert gm.ws_unsupported(None, None, None) == "probe: the TMA kernel"
        assert tma._num_programs(torch.device("cpu")) == 2
    assert gm.ws_unsupported is real and tma._num_programs(torch.device("cpu")) == 3
    with probes.applied("7b8l-default"):  # no probe: nothing patched
        assert gm.ws_unsupported is real


def test_programs_probe_caps_every_launchers_programs():
    tma = importlib.import_module("kernels.grouped_mm_tma")
    cpu = torch.device("cpu")
    assert tma._num_programs(cpu) == 3  # the interpreter's
    with probes.applied("x~programs-2"):
        assert tma._num_programs(cpu) == 2
    with probes.applied("x~programs-100"):  # a cap, never more than one per SM
        assert tma._num_programs(cpu) == 3
    assert tma._num_programs(cpu) == 3


def test_programs_probe_runs_the_kernels_on_fewer_programs(monkeypatch):
    """The dW kernel's per-program squares show how many programs ran: two under programs-2."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels' CPU checks need TRITON_INTERPRET=1")
    from kernels.grouped_mm_tma import launch_grouped_mm_dw_tma

    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(40, 16, generator=gen), torch.randn(40, 32, generator=gen)
    offsets = torch.tensor([10, 25, 40], dtype=torch.int32)
    config = {"BLOCK_R": 16, "BLOCK_K": 16, "BLOCK_N": 16, "SPLIT_N": 1, "num_warps": 1, "num_stages": 1}
    with probes.applied("x~programs-2"):
        squares = torch.zeros(3)
        dw = launch_grouped_mm_dw_tma(x, dy, offsets, torch.empty(3, 16, 32), config=config, squares=squares)
    assert (squares[:2] > 0).all() and squares[2] == 0  # 12 items dealt to two programs
    starts = [0, 10, 25]
    ref = torch.stack([x[a:b].T @ dy[a:b] for a, b in zip(starts, offsets.tolist())])
    torch.testing.assert_close(dw, ref)
    torch.testing.assert_close(squares.sum(), ref.square().sum())


def test_update_after_probe_keeps_the_update_off_the_side_stream():
    execution = importlib.import_module("optimus_core.execution")
    measure = importlib.import_module("optimus_core.train.measure")
    from optimus_core import presets

    cfg = presets.get("mula-7b-a1b@laptop").run_config(**{"model.n_layers": 1})
    real = execution.plan_execution
    on_gpu = dict(budget_bytes=None, probe=False)  # planned for a CUDA device without one
    assert real(cfg, torch.device("cuda"), **on_gpu).update_beside_forward is True
    with probes.applied("x~update-after"):
        for plan_execution in (execution.plan_execution, measure.plan_execution):
            plan = plan_execution(cfg, torch.device("cuda"), **on_gpu)
            assert plan.update_beside_forward is False
            # nothing else changes
            assert plan == dataclasses.replace(real(cfg, torch.device("cuda"), **on_gpu), update_beside_forward=False)
    assert execution.plan_execution is real and measure.plan_execution is real


def test_lm_head_probe_swaps_the_dw_sum():
    lce = importlib.import_module("optimus_core.model.linear_cross_entropy")
    real = lce.accumulate_dw
    with probes.applied("x~lm-head-f32-gemm"):
        assert lce.accumulate_dw is probes.dw_summed_in_the_gemm
    assert lce.accumulate_dw is real


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lm_head_probe_sums_dw_as_the_default_does_on_cuda():
    """Both sums against float64 over three bf16 chunks: the GEMM's float32 sum is at least as
    close (the default rounds each chunk's product to bf16 first)."""
    lce = importlib.import_module("optimus_core.model.linear_cross_entropy")
    gen = torch.Generator(device="cuda").manual_seed(0)
    chunks = [(torch.randn(256, 1000, device="cuda", generator=gen).bfloat16(),
               torch.randn(256, 128, device="cuda", generator=gen).bfloat16()) for _ in range(3)]
    ref = sum(d.double().T @ h.double() for d, h in chunks)
    sums = {}
    for name, accumulate in (("default", lce.accumulate_dw), ("probe", probes.dw_summed_in_the_gemm)):
        dw = None
        for d, h in chunks:
            dw = accumulate(dw, d, h)
        assert dw.dtype == torch.float32
        sums[name] = (dw.double() - ref).abs().max().item()
    assert sums["probe"] <= sums["default"] and sums["probe"] < 1e-3 * ref.abs().max().item()


def test_autograd_norm_probe_keeps_the_float32_copies_the_norm_no_longer_keeps():
    from optimus_core.model.layers import RMSNorm

    norm = RMSNorm(16)
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)

    def kept():
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = norm(x)
        return out, sorted(str(t.dtype) for t in saved if t.shape == x.shape)

    ours, ours_kept = kept()
    with probes.applied("7b8l-default~autograd-norm"):
        plain, plain_kept = kept()
    assert torch.equal(ours, plain)  # the same forward
    assert ours_kept == ["torch.bfloat16"] and len(plain_kept) >= 2 and set(plain_kept) == {"torch.float32"}
    assert kept()[1] == ours_kept  # unpatched after the block
