"""bench/kernels.py --ws's rows, on the CPU with a stand-in for the Gluon kernel (which needs a
Hopper GPU): each config is checked before it is timed (a wrong one is recorded as an error,
not timed), the baselines are timed in the same turns, and every row says which turns."""
import pytest
import torch

import optimus_kernels.hopper.grouped_mm_ws as ws
from bench.kernels import TINY, Timer, bench_ws, route
from optimus_kernels import grouped_mm_reference
from optimus_kernels._triton import INTERPRET, triton

pytestmark = pytest.mark.skipif(triton is None or not INTERPRET,
                                reason="the TMA baselines run here in Triton's interpreter (TRITON_INTERPRET=1)")

BROKEN = ws.config_dict(*ws.CONFIGS[1])


def fake_forward(x, w, offsets, y, *, trans_w=False, config=None):
    if config == BROKEN:
        return y.fill_(float("nan"))
    return y.copy_(grouped_mm_reference(x.float(), (w.transpose(1, 2) if trans_w else w).float(), offsets))


@pytest.fixture
def records(monkeypatch):
    device = torch.device("cpu")
    monkeypatch.setattr(ws, "ws_unsupported", lambda *a, **k: None)
    monkeypatch.setattr(ws, "launch_grouped_mm_ws", fake_forward)
    out = []
    topk_idx = route(64, TINY["experts"], TINY["top_k"], "zipf", torch.Generator().manual_seed(0))
    bench_ws(lambda pass_, **fields: out.append({"pass": pass_, **fields}), Timer(device, reps=1, warmup=1),
             device, torch.float32, 64, "zipf", topk_idx, TINY)
    return out


def test_every_pass_has_its_baselines_and_good_configs_timed_in_the_same_turns(records):
    timed = [r for r in records if "ms" in r]
    passes = {(r["op"], r["pass"]) for r in timed}
    assert passes == {(op, p) for op in ("up", "down") for p in ("fwd", "bwd-dx")}
    for op, pass_ in passes:
        rows = [r for r in timed if (r["op"], r["pass"]) == (op, pass_)]
        assert all(r["turns"] == "ws" for r in rows)
        assert {r["backend"] for r in rows} == {"triton-tma", "torch_raw", "triton-ws"}
        assert len([r for r in rows if r["backend"] == "triton-ws"]) == len(ws.CONFIGS) - 1  # all but the broken one


def test_a_wrong_config_is_recorded_not_timed(records):
    errors = [r for r in records if "error" in r]
    assert len(errors) == 4  # one per pass and op
    assert all(r["config"] == BROKEN for r in errors)
    assert any("relative error" in r["error"] for r in errors)


def test_dw_configs_time_every_tma_config_and_torch_in_the_same_turns():
    """--dw-configs: each config of the TMA dW kernel's list and torch._grouped_mm, timed in the
    same turns, for a float32 dw (the input here is float32: one output dtype)."""
    from bench.kernels import bench_dw_configs
    from optimus_kernels.hopper.grouped_mm_tma import _dw_tma_configs

    out = []
    device = torch.device("cpu")
    topk_idx = route(64, TINY["experts"], TINY["top_k"], "zipf", torch.Generator().manual_seed(0))
    bench_dw_configs(lambda pass_, **fields: out.append({"pass": pass_, **fields}), Timer(device, reps=1, warmup=1),
                     device, torch.float32, 64, "zipf", topk_idx, TINY)
    for op in ("up", "down"):
        rows = [r for r in out if r["op"] == op]
        assert all(r["pass"] == "dw" and r["out_dtype"] == "float32" and r["ms"] > 0 for r in rows)
        assert [r["backend"] for r in rows].count("torch_raw") == 1
        configs = [r["config"] for r in rows if r["backend"] == "triton-dw-config"]
        assert len(configs) == len(_dw_tma_configs(device.type, torch.float32)) and all(configs)
