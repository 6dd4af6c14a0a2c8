"""The descriptor family: the grouped GEMM's tensor-descriptor kernels (hopper/grouped_mm_tma.py)
as an Intel XPU runs them, with its PVC configs, against the plain-torch reference
(grouped_mm_reference, the loop backend) and the pointer kernels, forward and both gradients.

The interpreter runs the kernels on the CPU in float32 (its descriptors check the same 16-byte
rows and base as 2D block IO needs), so the family is asked for by name: under the ceiling
"descriptor" the tma family is excluded and every call takes the descriptor kernels wherever
descriptor_unsupported allows them. The PVC configs themselves (256 x 256 x 32 tiles and the
smaller ones) run here too, through the launchers' explicit config. Shapes: an empty expert,
group sizes off every tile grid, K and N multiples of 8 (a bf16 row's 16 bytes) but of no tile
size, NaN rows past offsets[-1]. Nothing here ran on an XPU: the bf16 test at the end needs one.

float32 tolerance: rtol = atol = 1e-5, as test_grouped_mm.py argues for its reductions of at
most 64 terms. The PVC case reduces over up to 264 columns (forward, dx) and 301 rows (dW); its
entries are O(1) sums of random-signed terms, whose float32 rounding grows about as sqrt(n) *
6e-8, about 1e-6 here (measured: at most 9e-7 from a float64 reference, any config).
"""

import importlib
import types

import pytest
import torch

import optimus_kernels.hopper.grouped_mm_tma as gm_tma
from optimus_kernels import grouped_mm_reference
from test_grouped_mm import forward_backward, make
from test_grouped_mm_tma import config_failures

gm = importlib.import_module("optimus_kernels.grouped_mm")  # the module: the package's `grouped_mm` is the function

# name: (rows per group, rows past offsets[-1], K, N); the interpreter's tiles are 16 x 16 x 16
CASES = {
    "an empty expert, groups off the tile grid, a tail": ([13, 0, 37, 5], 3, 40, 24),
    "empty first and last experts, one row": ([0, 1, 22, 0], 0, 8, 56),
    "one expert takes all": ([0, 50, 0], 2, 24, 8),
}
# the PVC configs' case: row tiles of 256 (a group of 301 rows spans two), K = 40 off BLOCK_K = 32,
# N = 264 off 128 and 256, and for dx the other way round
PVC_CASE = ([0, 37, 0, 301, 5], 3, 40, 264)


@pytest.fixture
def interpreter(triton_device):
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's float32 tests; on an XPU, test_bf16_descriptor_configs_on_xpu")
    if gm_tma.descriptor_device_unsupported(triton_device) is not None:
        pytest.skip(gm_tma.descriptor_device_unsupported(triton_device))
    return triton_device


@pytest.fixture
def family():
    """ceiling(name): the process's ceiling for the test, restored after."""
    before = gm._ceiling
    yield gm.use_family
    gm.use_family(before)


@pytest.fixture
def launches(monkeypatch):
    """The descriptor kernels' launches of a test, each with descriptor_unsupported's verdict
    on its tensors: ("mm", trans_w, verdict) for the forward / dx, ("dw", verdict) for dW."""
    calls = []

    def spy(x, w, offsets, y, **kw):
        calls.append(("mm", kw.get("trans_w", False), gm_tma.descriptor_unsupported(x, w, y)))
        return gm_tma.launch_grouped_mm_tma(x, w, offsets, y, **kw)

    def spy_dw(x, dy, offsets, dw, **kw):
        calls.append(("dw", gm_tma.descriptor_unsupported(x, dw, dy)))
        return gm_tma.launch_grouped_mm_dw_tma(x, dy, offsets, dw, **kw)

    monkeypatch.setattr(gm, "launch_grouped_mm_tma", spy)
    monkeypatch.setattr(gm, "launch_grouped_mm_dw_tma", spy_dw)
    return calls


def assert_close(got, want, what, tol=1e-5):
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        torch.testing.assert_close(g, r, rtol=tol, atol=tol, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_the_descriptor_family_matches_the_reference_and_the_pointer_kernels(case, interpreter, family, launches):
    """Through grouped_mm and autograd (the custom ops), as a run calls it: the forward, dx (w
    read as stored, transposed in the kernel) and dW each by the descriptor kernels; the same
    results as the reference and as the pointer kernels; rows past offsets[-1] zero."""
    sizes, tail, K, N = CASES[case]
    x, w, offsets, dy = make(sizes, tail, K, N, interpreter)
    family("descriptor")
    got = forward_backward(x, w, offsets, dy, backend="triton")
    assert sorted(launches, key=str) == sorted([("mm", False, None), ("mm", True, None), ("dw", None)], key=str)
    family("pointer")
    launches.clear()
    pointer = forward_backward(x, w, offsets, dy, backend="triton")
    assert launches == []
    assert_close(got, forward_backward(x, w, offsets, dy, backend="loop"), "descriptor vs reference")
    assert_close(got, pointer, "descriptor vs pointer")
    M = x.shape[0]
    assert not got[0][M - tail:].any() and not got[1][M - tail:].any(), "rows past offsets[-1] must be 0"


@pytest.mark.parametrize("trans_w", [False, True], ids=["forward", "dx"])
def test_every_pvc_forward_config_matches_in_the_interpreter(trans_w, interpreter, monkeypatch):
    """Each XPU config of the forward / dx kernel (grf_mode and warps mean nothing to the
    interpreter; the tiles do): partial row tiles inside a group, a group over two row tiles,
    an empty expert, K and N off every tile; against the reference and the pointer kernel."""
    monkeypatch.setattr(gm_tma, "INTERPRET", False)  # the list an XPU gets
    configs = gm_tma._tma_configs("xpu", torch.bfloat16)
    monkeypatch.undo()
    x, w, offsets, dy = make(*PVC_CASE, interpreter)
    x, w = x.detach(), w.detach()
    a = dy if trans_w else x
    want = grouped_mm_reference(a, w.transpose(1, 2) if trans_w else w, offsets)
    pointer = gm._launch_grouped_mm_dx(dy, w, offsets, tma=False) if trans_w else \
        gm._launch_grouped_mm(x, w, offsets, tma=False)
    assert gm_tma.descriptor_unsupported(a, w, want) is None

    def run(config):
        y = torch.full(tuple(want.shape), float("nan"), device=interpreter)
        gm_tma.launch_grouped_mm_tma(a, w, offsets, y, trans_w=trans_w, dx=trans_w, config=config)
        torch.testing.assert_close(y, pointer, rtol=1e-5, atol=1e-5)
        return ((y - want).abs().max() / want.abs().max()).item()

    failures = config_failures(configs, run, 1e-5)
    assert not failures, "\n".join(failures)
    assert [c.kwargs["BLOCK_M"] for c in configs] == [256, 256, 64]  # the tiles that ran


def test_every_pvc_dw_config_matches_in_the_interpreter(interpreter, monkeypatch):
    """Each XPU config of the dW kernel: whole (unsplit) stores of 256-wide tiles past K and N,
    row blocks of 32 ending inside the next group, an empty expert's dw written as zeros (dw
    starts as NaN); with and without the sum of squares."""
    monkeypatch.setattr(gm_tma, "INTERPRET", False)
    configs = gm_tma._dw_tma_configs("xpu", torch.bfloat16)
    monkeypatch.undo()
    x, _, offsets, dy = make(*PVC_CASE, interpreter)
    x = x.detach()
    G, K, N = len(offsets), x.shape[1], dy.shape[1]
    w0 = torch.zeros(G, K, N, requires_grad=True)
    want = torch.autograd.grad(grouped_mm_reference(x, w0, offsets), w0, dy)[0]  # the reference's dw
    pointer = gm._launch_grouped_mm_dw(x, dy, offsets, tma=False)
    assert gm_tma.descriptor_unsupported(x, want, dy) is None

    def run(config):
        dw = torch.full((G, K, N), float("nan"), device=interpreter)
        squares = torch.zeros(gm_tma._num_programs(interpreter), device=interpreter)
        gm_tma.launch_grouped_mm_dw_tma(x, dy, offsets, dw, config=config, squares=squares)
        torch.testing.assert_close(dw, pointer, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(squares.sum().double(), dw.double().square().sum(), rtol=1e-5, atol=0)
        assert not dw[0].any() and not dw[2].any(), "the empty experts' dw"
        return ((dw - want).abs().max() / want.abs().max()).item()

    failures = config_failures(configs, run, 1e-5)
    assert not failures, "\n".join(failures)


def test_rows_no_descriptor_can_address_say_why_and_take_the_pointer_kernels(interpreter, family, launches):
    """24- and 40-byte float32 rows (K = 6, N = 10): descriptor_unsupported says which tensor and
    why, and the calls take the pointer kernels, with the reference's results."""
    x, w, offsets, dy = make([5, 0, 9], 2, 6, 10, interpreter)
    family("descriptor")
    why = gm_tma.descriptor_unsupported(x, w, x.new_empty(len(x), 10))
    assert why is not None and "16-byte aligned rows" in why and "x" in why
    assert_close(forward_backward(x, w, offsets, dy, backend="triton"),
                 forward_backward(x, w, offsets, dy, backend="loop"), "fallback")
    assert launches == []


def test_the_descriptor_family_states_the_xpus_rules(monkeypatch):
    """On an XPU (its device check stood in for; no interpreter): 16-bit inputs, rows of a
    multiple of 8 bf16 elements (16 bytes), w contiguous, K > 0; each refusal says why. Other
    devices are refused by name; the persistent grid is one program per Xe core."""
    monkeypatch.setattr(gm_tma, "INTERPRET", False)
    assert "Intel XPU, got cuda" in gm_tma.descriptor_device_unsupported(torch.device("cuda"))
    assert "Intel XPU, got cpu" in gm_tma.descriptor_device_unsupported(torch.device("cpu"))
    if gm_tma.descriptor_device_unsupported(torch.device("xpu")) is not None:
        pytest.skip("this Triton has no device-side tensor descriptors")
    monkeypatch.setattr(gm_tma, "descriptor_device_unsupported", lambda device: None)

    def why(M, K, N, dtype=torch.bfloat16, w_t=False):
        x = torch.zeros(M, K, dtype=dtype)
        w = torch.zeros(3, N, K, dtype=dtype).transpose(1, 2) if w_t else torch.zeros(3, K, N, dtype=dtype)
        return gm_tma.descriptor_unsupported(x, w, torch.zeros(M, N, dtype=dtype))

    assert why(37, 40, 264) is None and why(5, 8, 8, torch.float16) is None
    assert "16-bit inputs" in why(37, 40, 264, torch.float32)
    assert "x needs 16-byte aligned rows" in why(37, 12, 264)  # 24-byte rows
    assert "w needs 16-byte aligned rows" in why(37, 40, 20)  # 40-byte rows
    assert "contiguous" in why(37, 40, 264, w_t=True)
    assert "K = 0" in why(37, 0, 264)
    monkeypatch.setattr(torch.xpu, "get_device_properties",
                        lambda device: types.SimpleNamespace(gpu_subslice_count=64))
    assert gm_tma._num_programs.__wrapped__(torch.device("xpu")) == 64


@pytest.mark.gpu
@pytest.mark.parametrize("trans_w", [False, True], ids=["forward", "dx"])
def test_bf16_descriptor_configs_on_xpu(trans_w, gpu_device, rel_err):
    """On an Intel XPU: each PVC config compiles (grf_mode and all) and matches a float32
    reference of the same bf16 inputs; forward and dx."""
    if gpu_device.type != "xpu":
        pytest.skip("needs an Intel XPU")
    x, w, offsets, dy = make([0, 300, 1, 0, 517, 64, 129, 0], 7, 200, 392, gpu_device, torch.bfloat16)
    x, w = x.detach(), w.detach()
    a = dy if trans_w else x
    want = grouped_mm_reference(a.float(), (w.transpose(1, 2) if trans_w else w).float(), offsets)
    assert gm_tma.descriptor_unsupported(a, w, want.to(x.dtype)) is None

    def run(config):
        y = torch.full(tuple(want.shape), float("nan"), device=gpu_device, dtype=x.dtype)
        gm_tma.launch_grouped_mm_tma(a, w, offsets, y, trans_w=trans_w, dx=trans_w, config=config)
        return rel_err(y, want)

    failures = config_failures(gm_tma._tma_configs("xpu", x.dtype), run, 5e-3)
    assert not failures, "\n".join(failures)
