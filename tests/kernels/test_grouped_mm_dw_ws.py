"""The warp-specialized cooperative dW kernel (kernels/grouped_mm_dw_ws.py).

On a CPU: its rank table in the interpreter, its refusals, and the kernel compiled for sm90 (in a
fresh process, as tests/kernels/test_grouped_mm_ws.py does): within shared memory, no spills, its
wgmmas pipelined. On a Hopper GPU: against the float32 reference on odd shapes (empty groups,
partial K and N tiles, NaN rows past offsets[-1], a group of inf rows that must not leak into its
neighbours), float32 and bf16 dw, the sum of squares, few programs with many items each (the
ring's wrap-around across items) and one per SM.
"""

import pytest
import torch

import kernels.grouped_mm_dw_ws as dw_ws
import kernels.grouped_mm_tma as gm_tma
import kernels.grouped_mm_ws as ws
from test_grouped_mm import make
from test_grouped_mm_ws import sm90_report_in_fresh_process

needs_gluon = pytest.mark.skipif(ws.gluon is None, reason="this Triton has no Gluon Hopper language")


def reference(x, dy, offsets):
    """dw[g] = x[rows of g]^T @ dy[rows of g] in float64, by a loop over the groups."""
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    return torch.stack([x[s:e].double().T @ dy[s:e].double() for s, e in zip(starts, ends)])


def test_rank_table_deals_the_largest_group_first(triton_device):
    offsets = torch.tensor([3, 3, 10, 12, 20, 20], dtype=torch.int32, device=triton_device)  # rows 3 0 7 2 8 0
    table = dw_ws.rank_table(offsets, 18)  # M ends inside group 4: its rows clamp to 6
    assert table.tolist() == [[2, 3, 10], [4, 12, 18], [0, 0, 3], [3, 10, 12], [1, 3, 3], [5, 18, 18]]
    assert dw_ws.rank_table(offsets[:0], 18).shape == (0, 3)


def test_says_why_it_cannot_run():
    x, dy, dw = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16), \
        torch.zeros(2, 64, 32)
    reason = dw_ws.dw_ws_unsupported(x, dy, dw)
    assert "GPU" in reason or "Gluon" in reason
    assert dw_ws._shape_unsupported(x, dy, dw) is None
    assert dw_ws._shape_unsupported(x, dy, dw.to(torch.bfloat16)) is None  # any float dw
    assert "16-bit" in dw_ws._shape_unsupported(x.float(), dy.float(), dw)
    assert "contiguous" in dw_ws._shape_unsupported(x, dy, dw.transpose(1, 2))
    assert "16-byte" in dw_ws._shape_unsupported(x, torch.zeros(8, 33, dtype=torch.bfloat16)[:, :31],
                                                 dw[..., :31].contiguous())


@pytest.fixture(scope="module")
def sm90():
    return sm90_report_in_fresh_process("kernels.grouped_mm_dw_ws")


@needs_gluon
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("config", list(dw_ws.CONFIGS))
def test_compiles_for_hopper_pipelined_within_shared_memory(config, out_dtype, sm90):
    report = sm90[f"{config} {out_dtype}"]
    assert report["warp_specialized"] and report["wgmma"]
    assert report["shared"] <= ws.SHARED_MEMORY_LIMIT
    assert "Used " in report["ptxas"], report["ptxas"]
    assert "C7514" not in report["ptxas"] and "0 bytes spill stores" in report["ptxas"], report["ptxas"]


# --------------------------------------------------------------------------- on a Hopper GPU
@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["float32 dw", "bf16 dw"])
@pytest.mark.parametrize("programs", [3, None], ids=["3 programs", "one per SM"])
@pytest.mark.parametrize("config", list(dw_ws.CONFIGS))
def test_matches_reference_on_hopper(config, out_dtype, programs, gpu_device, monkeypatch):
    """K = 200 and N = 392: partial K and N tiles; groups of 0, 1 and thousands of rows; the
    tail's rows are NaN in x and dy and must add nothing; squares: the sum of dw's squares."""
    sizes = [0, 3000, 1, 0, 5170, 640, 1290, 0, 77] if programs is None else [0, 300, 1, 0, 517, 64, 129, 0]
    x, _, offsets, dy = make(sizes, 7, 200, 392, gpu_device, torch.bfloat16)
    x, dy = x.detach(), dy.detach()
    x[int(offsets[-1]):] = float("nan")
    dy[int(offsets[-1]):] = float("nan")
    dw = torch.full((len(sizes), 200, 392), float("nan"), device=gpu_device, dtype=out_dtype)
    if (reason := dw_ws.dw_ws_unsupported(x, dy, dw)) is not None:
        pytest.skip(reason)
    if programs is not None:
        monkeypatch.setattr(gm_tma, "_num_programs", lambda device: programs)
    squares = torch.zeros(gm_tma._num_programs(x.device), device=gpu_device)
    dw_ws.launch_grouped_mm_dw_ws(x, dy, offsets, dw, squares=squares, config=dw_ws.CONFIGS[config])
    want = reference(x, dy, offsets)
    tol = 1e-4 if out_dtype == torch.float32 else 8e-3  # bf16: one rounding of each entry
    torch.testing.assert_close(dw.double(), want, rtol=tol, atol=tol)
    assert not dw[[0, 3, 7]].any()  # empty groups: zeros
    torch.testing.assert_close(squares.sum().double(), dw.double().square().sum(), rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(dw_ws.CONFIGS))
def test_each_groups_rows_stay_apart_on_hopper(config, gpu_device):
    """Group 1's rows are inf: its dw is non-finite, its neighbours' (whose last row blocks end
    inside group 1 or start inside group 0) stay finite and exact."""
    x, _, offsets, dy = make([90, 210, 110], 1, 192, 256, gpu_device, torch.bfloat16)
    x, dy = x.detach(), dy.detach()
    x[90:300] = float("inf")
    dw = torch.full((3, 192, 256), float("nan"), device=gpu_device)
    if (reason := dw_ws.dw_ws_unsupported(x, dy, dw)) is not None:
        pytest.skip(reason)
    dw_ws.launch_grouped_mm_dw_ws(x, dy, offsets, dw, config=dw_ws.CONFIGS[config])
    assert not torch.isfinite(dw[1]).any()
    torch.testing.assert_close(dw[[0, 2]].double(), reference(x, dy, offsets)[[0, 2]], rtol=1e-4, atol=1e-4)
