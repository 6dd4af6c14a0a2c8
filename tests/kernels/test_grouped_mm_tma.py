"""grouped_mm's two sets of triton kernels against the loop: the TMA kernels
(kernels/optimus_kernels/hopper/grouped_mm_tma.py: tensor descriptors, persistent grid; dx with w transposed in shared
memory; dW with per-group descriptors, groups dealt largest first) and the pointer kernels that
run where TMA cannot (dx reading w^T through transposed strides). Each set runs through the
private launchers' explicit keyword (`tma=True`: the TMA kernels where they can run; `tma=False`:
the pointer kernels); the entry point's own choice, made per call, is checked through grouped_mm.

The interpreter runs tensor descriptors (Triton 3.9), so the TMA kernel itself runs in CI, with
3 persistent programs so that each loops over several tiles. Shapes keep rows 16-byte aligned in
float32 (K, N multiples of 4), as TMA needs, and are off the interpreter's 16 x 16 x 16 blocks;
other shapes must fall back to the pointer kernel. Tolerances as in test_grouped_mm.py.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import optimus_kernels.hopper.grouped_mm_tma as gm_tma
import optimus_kernels.hopper.grouped_mm_ws as gm_ws
from optimus_kernels import grouped_mm, grouped_mm_reference
from optimus_kernels._triton import jit, tl
from optimus_kernels.grouped_mm_tiles import group_of_rank, groups_by_size
from test_grouped_mm import GPU_CASES, forward_backward, make

gm = importlib.import_module("optimus_kernels.grouped_mm")  # the module: the package's `grouped_mm` is the function

# name: (rows per group, rows past offsets[-1], K, N)
CASES = {
    "empty groups and a tail": ([0, 17, 0, 30], 5, 20, 36),
    "one group takes all": ([0, 0, 45, 0, 0], 0, 32, 16),
    "ragged, many tiles per program": ([3, 0, 21, 1, 16, 9, 0, 40], 3, 44, 52),
    "block-aligned": ([16, 32], 0, 32, 32),
    "K and N under one block": ([5, 7], 3, 4, 8),
    "all rows past the end": ([0, 0], 12, 16, 16),
    "no rows": ([0, 0, 0], 0, 8, 8),
}
# the private launchers' keyword: the TMA kernels where they can run, or the pointer kernels
KERNELS = pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
# an opcheck's shape: 16-byte float32 rows (the TMA kernels where they can run) or not (pointer)
ALIGNED = pytest.mark.parametrize("K,N", [(8, 12), (6, 10)], ids=["aligned", "misaligned"])


@pytest.fixture
def tma_calls(monkeypatch):
    """The TMA launches of a test: (kernel, x shape, trans_w) for the forward / dx kernels, kernel
    "ws" (warp-specialized) or "tma"; ("dw", x shape, dw dtype) for the dW kernel."""
    calls = []

    def spy(x, w, offsets, y, **kw):
        calls.append(("tma", tuple(x.shape), kw.get("trans_w", False)))
        return gm_tma.launch_grouped_mm_tma(x, w, offsets, y, **kw)

    def spy_ws(x, w, offsets, y, **kw):
        calls.append(("ws", tuple(x.shape), kw.get("trans_w", False)))
        return gm_ws.launch_grouped_mm_ws(x, w, offsets, y, **kw)

    def spy_dw(x, dy, offsets, dw, **kw):
        calls.append(("dw", tuple(x.shape), dw.dtype))
        return gm_tma.launch_grouped_mm_dw_tma(x, dy, offsets, dw, **kw)

    monkeypatch.setattr(gm, "launch_grouped_mm_tma", spy)
    monkeypatch.setattr(gm, "launch_grouped_mm_ws", spy_ws)
    monkeypatch.setattr(gm, "launch_grouped_mm_dw_tma", spy_dw)
    return calls


def tma_runs(x, w) -> bool:
    return gm_tma.tma_unsupported(x, w, x.new_empty(x.shape[0], w.shape[2])) is None


def launch(x, w, offsets, dy, tma):
    """(y, dx, dw) through the private launchers: the TMA kernels where they can run (tma=True)
    or the pointer kernels (tma=False). A float32 w with half-precision x: cast for the forward
    as the op does, dw in float32."""
    x, w = x.detach(), w.detach()
    return (gm._launch_grouped_mm(x, w.to(x.dtype), offsets, tma=tma),
            gm._launch_grouped_mm_dx(dy, w, offsets, tma=tma),
            gm._launch_grouped_mm_dw(x, dy, offsets, w.dtype != x.dtype, tma=tma))


def expected_tma_calls(x, w, dw_dtype):
    """The TMA launches of a forward, dx and dw where the TMA kernels run: the forward and dx
    only with rows (an empty product launches nothing), each by the warp-specialized kernel
    where it runs (Hopper); the dW kernel always (it zeroes dw)."""
    (M, K), N = x.shape, w.shape[2]
    w = w.detach().to(x.dtype)
    forward = "ws" if gm_ws.ws_unsupported(x, w, x.new_empty(M, N)) is None else "tma"
    dx = "ws" if gm_ws.ws_unsupported(x.new_empty(M, N), w, x.new_empty(M, K), trans_w=True) is None else "tma"
    return ([(forward, (M, K), False), (dx, (M, N), True)] if M else []) + [("dw", (M, K), dw_dtype)]


def check_against_loop(x, w, offsets, dy, what, tma=None):
    """tma None: through grouped_mm and autograd (the entry point's choice), else through the
    launchers with that keyword."""
    got = forward_backward(x, w, offsets, dy, backend="triton") if tma is None else launch(x, w, offsets, dy, tma)
    want = forward_backward(x, w, offsets, dy, backend="loop")
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} {name}: {m}")
    return got


@KERNELS
@pytest.mark.parametrize("case", CASES)
def test_kernels_match_loop(case, tma, triton_device, tma_calls):
    """Forward, dx and dw of each set of kernels; with tma=False no TMA kernel launches at all."""
    sizes, tail, K, N = CASES[case]
    x, w, offsets, dy = make(sizes, tail, K, N, triton_device)
    y, dx, _ = check_against_loop(x, w, offsets, dy, "tma" if tma else "pointer", tma=tma)
    M = x.shape[0]
    assert not y[M - tail:].any() and not dx[M - tail:].any(), "rows past offsets[-1] must be 0"
    want = expected_tma_calls(x, w, x.dtype) if tma and tma_runs(x, w) else []
    assert tma_calls == want


@pytest.mark.parametrize("case", CASES)
def test_entry_point_takes_the_tma_kernels_where_they_run(case, triton_device, tma_calls):
    """grouped_mm's forward, dx and dw (autograd through the custom ops): the TMA kernels
    wherever tma_unsupported allows them, else the pointer kernels, chosen per call."""
    sizes, tail, K, N = CASES[case]
    x, w, offsets, dy = make(sizes, tail, K, N, triton_device)
    check_against_loop(x, w, offsets, dy, "grouped_mm")
    want = expected_tma_calls(x, w, x.dtype) if tma_runs(x, w) else []
    assert sorted(tma_calls, key=str) == sorted(want, key=str)  # autograd orders dx and dw as it likes


def test_forward_and_dx_take_the_warp_specialized_kernel_where_it_runs(triton_device, monkeypatch):
    """Where grouped_mm_ws.ws_unsupported says it runs (Hopper: faked here, the Gluon kernel has no
    interpreter), the entry point's forward and dx take the warp-specialized kernel, before the
    TMA kernel; dW stays with the TMA dW kernel."""
    calls = []

    def fake_ws(x, w, offsets, y, *, trans_w=False):
        calls.append(("ws", tuple(x.shape), trans_w))
        return y.copy_(grouped_mm_reference(x, w.transpose(1, 2) if trans_w else w, offsets))

    monkeypatch.setattr(gm, "ws_unsupported", lambda *args, **kw: None)
    monkeypatch.setattr(gm, "launch_grouped_mm_ws", fake_ws)
    sizes, tail, K, N = CASES["ragged, many tiles per program"]
    x, w, offsets, dy = make(sizes, tail, K, N, triton_device)
    check_against_loop(x, w, offsets, dy, "grouped_mm")
    M = x.shape[0]
    assert sorted(calls) == [("ws", (M, K), False), ("ws", (M, N), True)]


@pytest.mark.parametrize("K,N", [(20, 12), (6, 10)], ids=["aligned", "misaligned"])
def test_pointer_dx_reads_w_transposed_through_strides(K, N, triton_device, monkeypatch):
    """The pointer dx (tma=False, and the fallback of tma=True where TMA cannot run): the
    forward's pointer kernel over w^T as a transposed view, no contiguous copy of it."""
    seen = []
    pointer = gm._launch_grouped_mm

    def spy(x, w, offsets, **kw):
        seen.append((tuple(w.shape), w.is_contiguous(), kw.get("dx", False), kw.get("tma", True)))
        return pointer(x, w, offsets, **kw)

    monkeypatch.setattr(gm, "_launch_grouped_mm", spy)
    x, w, offsets, dy = make([7, 0, 12], 2, K, N, triton_device)
    want = forward_backward(x, w, offsets, dy, backend="loop")[1]
    for tma in (False, True):
        seen.clear()
        dx = gm._launch_grouped_mm_dx(dy, w.detach(), offsets, tma=tma)
        torch.testing.assert_close(dx, want, rtol=1e-5, atol=1e-5)
        pointer_ran = not tma or not tma_runs(x, w)
        assert seen == ([((3, N, K), False, True, False)] if pointer_ran else [])


@KERNELS
def test_non_finite_weights_of_an_empty_group_never_leak(tma, triton_device):
    """A K block running past K reads the next group's weights (w is one (G*K, N) matrix to
    the TMA descriptor): they must be zeroed, or an inf there turns its neighbour's outputs NaN."""
    x, w, offsets, dy = make([9, 21, 0], 1, 20, 12, triton_device)  # K = 20: a partial K block
    with torch.no_grad():
        w[2] = float("inf")
    got = launch(x, w, offsets, dy, tma)
    want = forward_backward(x, w, offsets, dy, backend="loop")
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert torch.isfinite(g[:30] if name != "dw" else g[:2]).all(), name
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_misaligned_rows_fall_back_to_the_pointer_kernel(triton_device, tma_calls):
    x, w, offsets, dy = make([5, 0, 9], 2, 6, 10, triton_device)  # 24- and 40-byte float32 rows
    reason = gm_tma.tma_unsupported(x, w, x.new_empty(len(x), 10))
    assert reason is not None  # 16-byte rows in the interpreter; float32 or no sm90 on a GPU
    check_against_loop(x, w, offsets, dy, "fallback")
    check_against_loop(x, w, offsets, dy, "fallback", tma=True)
    assert tma_calls == []


def test_the_interpreter_runs_tensor_descriptors(triton_device):
    """Guards the tests above from passing through the fallback alone: where the kernels run
    in the interpreter, TMA-legal float32 shapes must take the TMA kernel."""
    import triton.language as tl

    if triton_device.type != "cpu":
        pytest.skip("the interpreter's case; on a GPU, test_bf16_kernels_on_gpu checks it")
    if not hasattr(tl, "make_tensor_descriptor"):
        pytest.skip("this Triton's interpreter has no tensor descriptors (needs Triton 3.4+)")
    x, w, _, _ = make([4, 4], 0, 8, 8, triton_device)
    assert tma_runs(x, w)


@ALIGNED
def test_dx_op_passes_opcheck(K, N, triton_device):
    x, w, offsets, dy = make([3, 0, 9], 2, K, N, triton_device)
    torch.library.opcheck(torch.ops.optimus.grouped_mm_dx, (dy, w.detach(), offsets))


def test_compiled_two_layer_product_with_the_tma_kernels(triton_device):
    """Under torch.compile (AOTAutograd traces the dx op in the backward) as in eager."""
    torch._dynamo.reset()
    x, w1, offsets, _ = make([6, 0, 11], 2, 12, 20, triton_device)
    w2 = make([6, 0, 11], 2, 20, 8, triton_device, seed=1)[1]

    def two_layers(x, w1, w2, backend):
        return grouped_mm(grouped_mm(x, w1, offsets, backend=backend), w2, offsets, backend=backend)

    compiled = torch.compile(two_layers, backend="aot_eager", fullgraph=True)
    out = compiled(x, w1, w2, "triton")
    got = (out, *torch.autograd.grad(out.nan_to_num().sum(), (x, w1, w2)))
    want = two_layers(x, w1, w2, "loop")
    want = (want, *torch.autograd.grad(want.nan_to_num().sum(), (x, w1, w2)))
    for name, g, r in zip(("y", "dx", "dw1", "dw2"), got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- the TMA dW kernel
# name: (rows per group, rows past offsets[-1], K, N); K, N multiples of 4 (16-byte float32 rows)
DW_CASES = {
    "empty groups and a tail": ([0, 17, 0, 30], 5, 20, 36),
    "one group takes all": ([0, 0, 45, 0, 0], 0, 32, 16),
    "ragged, sizes off the row block": ([3, 0, 21, 1, 16, 9, 0, 40], 3, 44, 52),
    "all rows past the end": ([0, 0], 12, 16, 16),
    "one row": ([0, 1], 0, 8, 4),
}
# None: the autotuned (interpreter: split store) config; the others fix each store, row blocks
# taller and shorter than the groups, and K / N tiles that divide neither K nor N
DW_CONFIGS = {
    "autotuned": None,
    "whole store, wide tile": dict(BLOCK_R=8, BLOCK_K=32, BLOCK_N=32, SPLIT_N=1, num_warps=1, num_stages=1),
    "tall row blocks, split store": dict(BLOCK_R=32, BLOCK_K=8, BLOCK_N=16, SPLIT_N=2, num_warps=1, num_stages=1),
}


def dw_reference(x, dy, offsets):
    """dw[g] = x[rows of g]^T @ dy[rows of g] in float64, one slice per group."""
    dw = x.new_zeros(len(offsets), x.shape[1], dy.shape[1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        dw[g] = x[start:end].double().T @ dy[start:end].double()
        start = end
    return dw


@pytest.mark.parametrize("config", DW_CONFIGS)
@pytest.mark.parametrize("case", DW_CASES)
def test_dw_tma_kernel_matches_reference(case, config, triton_device):
    """Every entry written (dw starts as NaN), each group's rows only: the rows past offsets[-1]
    (NaN in x and dy) and the next group's rows add nothing."""
    sizes, tail, K, N = DW_CASES[case]
    x, _, offsets, dy = make(sizes, tail, K, N, triton_device)
    x = x.detach()
    if not tma_runs(x, torch.empty(len(sizes), K, N)):
        pytest.skip("the TMA kernel does not run here (no sm90 or float32 on a GPU)")
    dw = torch.full((len(sizes), K, N), float("nan"), device=triton_device)
    gm_tma.launch_grouped_mm_dw_tma(x, dy, offsets, dw, config=DW_CONFIGS[config])
    torch.testing.assert_close(dw, dw_reference(x, dy, offsets).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", DW_CONFIGS)
def test_dw_tma_keeps_each_groups_rows_apart(config, triton_device):
    """Group 1's rows are inf: its dw is non-finite, its neighbours', whose last row blocks end
    inside group 1 or start inside group 0, stay finite and exact."""
    x, _, offsets, dy = make([9, 21, 11], 1, 20, 12, triton_device)
    x = x.detach()
    if not tma_runs(x, torch.empty(3, 20, 12)):
        pytest.skip("the TMA kernel does not run here (no sm90 or float32 on a GPU)")
    x[9:30] = float("inf")
    dw = torch.full((3, 20, 12), float("nan"), device=triton_device)
    gm_tma.launch_grouped_mm_dw_tma(x, dy, offsets, dw, config=DW_CONFIGS[config])
    want = dw_reference(x, dy, offsets).float()
    assert not torch.isfinite(dw[1]).any()
    torch.testing.assert_close(dw[[0, 2]], want[[0, 2]], rtol=1e-5, atol=1e-5)


@KERNELS
@pytest.mark.parametrize("float32_out", [False, True])
def test_dw_stores_float32_or_the_input_dtype(float32_out, tma, triton_device, tma_calls):
    """float16 inputs (the interpreter runs them): dw in float32 with float32_out, else float16.
    Products of float16 values are exact in float32, so float32 dw differs from the float64
    reference by summation order only (1e-5 as above); float16 dw adds one rounding per entry
    (at most 2^-11 = 4.9e-4 relative), hence rtol 1e-3."""
    x, _, offsets, dy = make([0, 13, 30, 0, 5], 3, 24, 40, triton_device)
    x, dy = x.detach().half(), dy.half()
    dw = gm._launch_grouped_mm_dw(x, dy, offsets, float32_out, tma=tma)
    assert dw.dtype == (torch.float32 if float32_out else torch.float16)
    want = dw_reference(x, dy, offsets).to(dw.dtype)
    tol = 1e-5 if float32_out else 1e-3
    torch.testing.assert_close(dw, want, rtol=tol, atol=1e-5)
    assert tma_calls == ([("dw", tuple(x.shape), dw.dtype)] if tma and tma_runs(x, dw) else [])


@ALIGNED
@pytest.mark.parametrize("float32_out", [False, True])
def test_dw_op_passes_opcheck(K, N, float32_out, triton_device):
    x, _, offsets, dy = make([3, 0, 9], 2, K, N, triton_device)
    torch.library.opcheck(torch.ops.optimus.grouped_mm_dw, (x.detach(), dy, offsets, float32_out))


@jit
def _ranks_kernel(offsets_ptr, out_ptr, M, G, SEGMENTS: tl.constexpr, CHUNK: tl.constexpr):
    seg, starts, ends, rank = groups_by_size(offsets_ptr, M, G, SEGMENTS, CHUNK)
    for j in range(0, G):
        g, row_start, row_end = group_of_rank(j, seg, starts, ends, rank)
        tl.store(out_ptr + 3 * j, g)
        tl.store(out_ptr + 3 * j + 1, row_start)
        tl.store(out_ptr + 3 * j + 2, row_end)


@pytest.mark.parametrize("G,chunk", [(1, 1), (5, 8), (40, 16), (64, 32)])
def test_groups_by_size_deals_the_largest_first(G, chunk, triton_device):
    """Ranks from row counts (ties by index; lanes past G never ranked among the groups), the
    rows clamped to M, compared CHUNK lanes at a time; M here ends inside the groups."""
    gen = torch.Generator().manual_seed(G)
    sizes = torch.randint(0, 4, (G,), generator=gen) * torch.randint(0, 3, (G,), generator=gen)  # ties
    ends = sizes.cumsum(0)
    M = max(int(ends[-1]) - 3, 0)
    out = torch.full((G, 3), -1, dtype=torch.int32, device=triton_device)
    segments = 1 << (G - 1).bit_length()
    _ranks_kernel[(1,)](ends.to(torch.int32).to(triton_device), out, M, G, SEGMENTS=segments, CHUNK=chunk)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]]).clamp(max=M)
    ends = ends.clamp(max=M)
    rows = (ends - starts).tolist()
    order = sorted(range(G), key=lambda g: (-rows[g], g))
    assert out.tolist() == [[g, int(starts[g]), int(ends[g])] for g in order]


# ---------------------------------------------------------------- bf16 on a GPU
# Tolerance as test_grouped_mm.py's bf16 tests: float32 accumulation, one bf16 rounding per entry.
@pytest.mark.gpu
@KERNELS
@pytest.mark.parametrize("case", GPU_CASES)
def test_bf16_kernels_on_gpu(case, tma, gpu_device, rel_err, tma_calls):
    sizes, tail, K, N = GPU_CASES[case]
    x, w, offsets, dy = make(sizes, tail, K, N, gpu_device, torch.bfloat16)
    got = launch(x, w, offsets, dy, tma)
    xf, wf = (t.detach().float().requires_grad_() for t in (x, w))
    want = forward_backward(xf, wf, offsets, dy.float(), backend="loop")
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert g.dtype == torch.bfloat16
        assert rel_err(g, r) < 5e-3, name
    M = x.shape[0]
    assert not got[0][M - tail:].any() and not got[1][M - tail:].any()
    assert tma_calls == (expected_tma_calls(x, w, torch.bfloat16) if tma and tma_runs(x, w) else [])


@pytest.mark.gpu
def test_bf16_tma_with_float32_master_weights(gpu_device, rel_err):
    """w float32: grouped_mm (the TMA kernels where they run) casts it first and computes what
    the pointer kernels do, dw in float32."""
    x, w32, offsets, dy = make([5, 0, 9, 2], 3, 24, 16, gpu_device)
    x, dy = x.detach().bfloat16().requires_grad_(), dy.bfloat16()
    want = launch(x, w32, offsets, dy, tma=False)
    got = forward_backward(x, w32, offsets, dy, backend="triton")
    assert got[2].dtype == want[2].dtype == torch.float32
    for name, g, r in zip(("y", "dx", "dw"), got, want):  # same bf16 products, other tiles
        assert rel_err(g, r) < 5e-3, name


@pytest.mark.gpu
@pytest.mark.parametrize("float32_out", [False, True])
@pytest.mark.parametrize("case", GPU_CASES)
def test_bf16_dw_tma_on_gpu(case, float32_out, gpu_device, rel_err, tma_calls):
    """The autotuned dW kernel against a float32 reference of the same bf16 inputs: float32 dw
    sums exact products in another order (1e-5, as test_grouped_mm.py's float32 dw), bf16 dw
    adds one rounding per entry (5e-3, as the bf16 tests above)."""
    sizes, tail, K, N = GPU_CASES[case]
    x, _, offsets, dy = make(sizes, tail, K, N, gpu_device, torch.bfloat16)
    x = x.detach()
    dw = gm._launch_grouped_mm_dw(x, dy, offsets, float32_out)
    assert dw.dtype == (torch.float32 if float32_out else torch.bfloat16)
    assert rel_err(dw, dw_reference(x, dy, offsets)) < (1e-5 if float32_out else 5e-3)
    assert tma_calls == ([("dw", tuple(x.shape), dw.dtype)] if tma_runs(x, dw) else [])


def config_failures(configs, run, tolerance: float) -> list[str]:
    """Each config of an autotuning list on its own (the autotuner skips one that runs out of
    shared memory without a word): ``run(config)`` -> its relative error, raising where the
    config does not compile or launch. The failures, each named by its config."""
    failures = []
    for cfg in configs:
        config = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        try:
            err = run(config)
        except Exception as e:  # e.g. OutOfResources: drop the config from the list
            failures.append(f"{config}: {type(e).__name__}: {e}"[:300])
            continue
        if not err < tolerance:
            failures.append(f"{config}: rel_err {err}")
    return failures


def test_every_dw_config_compiles_for_hopper_within_shared_memory():
    """Each dW config, compiled for sm90 on the CPU for a float32 and a bf16 dw (in a fresh
    process: an interpreted kernel earlier in this one changes what Triton compiles): it fits the
    H200's shared memory and spills nothing."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", "import json; from optimus_kernels.hopper.grouped_mm_tma import dw_sm90_report; "
                          "print(json.dumps(dw_sm90_report()))"], cwd=Path(__file__).resolve().parents[2],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    float32 = {name.removeprefix("fp32/") for name in report if name.startswith("fp32/")}
    bf16 = {name.removeprefix("bf16/") for name in report if name.startswith("bf16/")}
    assert float32 == bf16 and "64x128x256 w8 s3 split2" in bf16  # the GPU's list (this process may interpret)
    for name, compiled in report.items():
        assert compiled["shared"] <= gm_ws.SHARED_MEMORY_LIMIT, (name, compiled["shared"])
        assert "Used " in compiled["ptxas"] and "0 bytes spill stores" in compiled["ptxas"], (name, compiled["ptxas"])


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_every_dw_tma_config_compiles_and_matches(out_dtype, gpu_device, rel_err):
    """Each config with either output (its staging tile's dtype): partial N and K tiles, empty
    groups, a tail."""
    x, _, offsets, dy = make([0, 300, 1, 0, 517, 64, 129, 0], 7, 200, 392, gpu_device, torch.bfloat16)
    x = x.detach()
    if gm_tma.tma_unsupported(x, torch.empty(8, 200, 392, device=gpu_device), dy) is not None:
        pytest.skip("the TMA kernel does not run on this GPU")
    want = dw_reference(x, dy, offsets)

    def run(config):
        dw = torch.full((8, 200, 392), float("nan"), device=gpu_device, dtype=out_dtype)
        gm_tma.launch_grouped_mm_dw_tma(x, dy, offsets, dw, config=config)
        return rel_err(dw.float(), want)

    tolerance = 1e-5 if out_dtype == torch.float32 else 1e-2  # bf16's rounding of the stored values
    failures = config_failures(gm_tma._dw_tma_configs(gpu_device.type, x.dtype), run, tolerance)
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("trans_w", [False, True], ids=["forward", "dx"])
def test_every_forward_tma_config_compiles_and_matches(trans_w, gpu_device, rel_err):
    """The forward / dx kernel's list, forward and dx (w read transposed): partial row, column
    and K tiles, empty groups, a tail."""
    x, w, offsets, dy = make([0, 300, 1, 0, 517, 64, 129, 0], 7, 200, 392, gpu_device, torch.bfloat16)
    x, w = x.detach(), w.detach()
    if gm_tma.tma_unsupported(x, w, dy) is not None:
        pytest.skip("the TMA kernel does not run on this GPU")
    a = dy if trans_w else x
    want = grouped_mm_reference(a.float(), (w.transpose(1, 2) if trans_w else w).float(), offsets)

    def run(config):
        y = torch.full(tuple(want.shape), float("nan"), device=gpu_device, dtype=x.dtype)
        gm_tma.launch_grouped_mm_tma(a, w, offsets, y, trans_w=trans_w, dx=trans_w, config=config)
        return rel_err(y, want)

    failures = config_failures(gm_tma._tma_configs(gpu_device.type, x.dtype), run, 5e-3)
    assert not failures, "\n".join(failures)


@KERNELS
@pytest.mark.parametrize("case", ["empty groups and a tail", "ragged, many tiles per program", "no rows",
                                  "all rows past the end"])
def test_dw_squares_are_those_of_the_stored_dw(case, tma, triton_device):
    """squares=True: the sum of the squares of dw as stored (float16 dw here: of the rounded
    values), summed per program by the kernel, in a fixed order: the same bits twice. The rows
    past offsets[-1] (NaN) and each tile's padding add nothing."""
    sizes, tail, K, N = CASES[case]
    x, _, offsets, dy = make(sizes, tail, K, N, triton_device)
    for dtype, float32_out in ((torch.float32, False), (torch.float16, False), (torch.float16, True)):
        xd, dyd = x.detach().to(dtype), dy.to(dtype)
        plain = gm._launch_grouped_mm_dw(xd, dyd, offsets, float32_out, tma=tma)
        dw_, square = gm._launch_grouped_mm_dw(xd, dyd, offsets, float32_out, squares=True, tma=tma)
        _, again = gm._launch_grouped_mm_dw(xd, dyd, offsets, float32_out, squares=True, tma=tma)
        assert torch.equal(dw_, plain) and torch.equal(square, again)
        assert square.shape == () and square.dtype == torch.float32
        want = dw_.double().square().sum()
        torch.testing.assert_close(square.double(), want, rtol=1e-5, atol=1e-6)


@ALIGNED
def test_dw_squares_op_passes_opcheck(K, N, triton_device):
    x, _, offsets, dy = make([3, 0, 9], 2, K, N, triton_device)
    torch.library.opcheck(torch.ops.optimus.grouped_mm_dw_squares, (x.detach(), dy, offsets, True))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_bf16_dw_squares_on_gpu(case, gpu_device, tma_calls):
    """The autotuned TMA dW kernel (its configs tuned on the same slots, zeroed before the chosen
    one runs): float32 dw's squares as a float64 pass over it finds them, twice the same bits."""
    sizes, tail, K, N = GPU_CASES[case]
    x, _, offsets, dy = make(sizes, tail, K, N, gpu_device, torch.bfloat16)
    results = [gm._launch_grouped_mm_dw(x.detach(), dy, offsets, True, squares=True) for _ in range(2)]
    (dw, square), (dw2, square2) = results
    assert torch.equal(dw, dw2) and torch.equal(square, square2)
    torch.testing.assert_close(square.double(), dw.double().square().sum(), rtol=1e-5, atol=0)
