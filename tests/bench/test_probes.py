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


def test_ws_pingpong_probe_turns_the_cooperative_default_down():
    ws = importlib.import_module("kernels.grouped_mm_ws")
    real = ws.default_config

    def fused_backward_refusal(H):  # the launchers' rules follow the config: whole column tiles of H
        return ws.swiglu_backward_unsupported(torch.zeros(8, 64), torch.zeros(2, H, 64), torch.zeros(8, 2 * H),
                                              torch.zeros(8, 2 * H), None)
    assert real(2048)["COOP"] == 1 and "whole 256-column" in fused_backward_refusal(320)
    with probes.applied("7b8l-default~ws-pingpong"):
        assert ws.default_config(2048)["COOP"] == 0 and ws.default_config(2048)["BLOCK_N"] == 128
        assert "whole 128-column" in fused_backward_refusal(320)
    assert ws.default_config is real


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
