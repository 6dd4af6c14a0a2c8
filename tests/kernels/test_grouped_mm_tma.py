"""grouped_mm's alternative triton kernels (kernels.grouped_mm.TRITON_KERNELS) against the loop:
the TMA forward (kernels/grouped_mm_tma.py: tensor descriptors, persistent grid), dx from a
contiguous copy of w^T, and dx through the TMA kernel with w transposed in shared memory.

The interpreter runs tensor descriptors (Triton 3.9), so the TMA kernel itself runs in CI, with
3 persistent programs so that each loops over several tiles. Shapes keep rows 16-byte aligned in
float32 (K, N multiples of 4), as TMA needs, and are off the interpreter's 16 x 16 x 16 blocks;
other shapes must fall back to the pointer kernel. Tolerances as in test_grouped_mm.py.
"""

import importlib

import pytest
import torch

import kernels.grouped_mm_tma as gm_tma
from kernels import grouped_mm
from test_grouped_mm import GPU_CASES, forward_backward, make

gm = importlib.import_module("kernels.grouped_mm")  # the module: the package's `grouped_mm` is the function

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
# (forward, dx, tma_flatten)
CHOICES = [("pointer", "copy", False), ("tma", "strided", False), ("tma", "copy", False),
           ("tma", "tma", False), ("tma", "tma", True), ("tma", "copy", True)]


@pytest.fixture
def tma_calls(monkeypatch):
    """The TMA launches of a test, as (x shape, trans_w) pairs."""
    calls = []

    def spy(x, w, offsets, y, **kw):
        calls.append((tuple(x.shape), kw.get("trans_w", False)))
        return gm_tma.launch_grouped_mm_tma(x, w, offsets, y, **kw)

    monkeypatch.setattr(gm, "launch_grouped_mm_tma", spy)
    return calls


def tma_runs(x, w) -> bool:
    return gm_tma.tma_unsupported(x, w, x.new_empty(x.shape[0], w.shape[2])) is None


def check_against_loop(x, w, offsets, dy, what):
    got = forward_backward(x, w, offsets, dy, backend="triton")
    want = forward_backward(x, w, offsets, dy, backend="loop")
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} {name}: {m}")
    return got


@pytest.mark.parametrize("forward,dx,flatten", CHOICES)
@pytest.mark.parametrize("case", CASES)
def test_kernel_choices_match_loop(case, forward, dx, flatten, triton_device, tma_calls):
    sizes, tail, K, N = CASES[case]
    x, w, offsets, dy = make(sizes, tail, K, N, triton_device)
    with gm.triton_kernels(forward=forward, dx=dx, tma_flatten=flatten):
        y, dx_, _ = check_against_loop(x, w, offsets, dy, f"{forward}/{dx}")
    M = x.shape[0]
    assert not y[M - tail:].any() and not dx_[M - tail:].any(), "rows past offsets[-1] must be 0"
    if not tma_runs(x, w) or M == 0:
        assert tma_calls == []
        return
    # the forward through TMA when chosen; dx through it when chosen, or on the copy of w^T
    want = [((M, K), False)] if forward == "tma" else []
    want += {"tma": [((M, N), True)], "copy": [((M, N), False)] if forward == "tma" else []}.get(dx, [])
    assert tma_calls == want


def test_dx_copy_runs_the_forward_kernel_on_a_contiguous_transpose(triton_device, monkeypatch):
    seen = []
    launch = gm._launch_grouped_mm

    def spy(x, w, offsets, **kw):
        seen.append((tuple(w.shape), w.is_contiguous(), kw.get("dx", False)))
        return launch(x, w, offsets, **kw)

    monkeypatch.setattr(gm, "_launch_grouped_mm", spy)
    x, w, offsets, dy = make([7, 0, 12], 2, 20, 12, triton_device)
    with gm.triton_kernels(forward="pointer", dx="copy"):
        check_against_loop(x, w, offsets, dy, "copy")
    assert seen == [((3, 20, 12), True, False), ((3, 12, 20), True, True)]
    seen.clear()
    with gm.triton_kernels(forward="pointer", dx="strided"):  # w^T read through strides
        check_against_loop(x, w, offsets, dy, "strided")
    assert seen == [((3, 20, 12), True, False), ((3, 12, 20), False, True)]


@pytest.mark.parametrize("shape", [(3, 20, 12), (1, 17, 33), (2, 64, 16)])
def test_transposed_copy(shape, triton_device):
    """dx="copy"'s w^T: contiguous (G, N, K), exact, also from a w that is itself a strided view."""
    w = torch.randn(*shape, device=triton_device)
    for src in (w, w.transpose(1, 2).contiguous().transpose(1, 2), w[:, :, :]):
        wt = gm._transposed_copy(src, w.dtype)
        assert wt.is_contiguous() and torch.equal(wt, w.transpose(1, 2))


@pytest.mark.parametrize("forward,dx,flatten", CHOICES)
def test_non_finite_weights_of_an_empty_group_never_leak(forward, dx, flatten, triton_device):
    """A K block running past K reads the next group's weights (w is one (G*K, N) matrix to
    the descriptor): they must be zeroed, or an inf there turns its neighbour's outputs NaN."""
    x, w, offsets, dy = make([9, 21, 0], 1, 20, 12, triton_device)  # K = 20: a partial K block
    with torch.no_grad():
        w[2] = float("inf")
    with gm.triton_kernels(forward=forward, dx=dx, tma_flatten=flatten):
        y, dx_, dw = forward_backward(x, w, offsets, dy, backend="triton")
    want = forward_backward(x, w, offsets, dy, backend="loop")
    for name, g, r in zip(("y", "dx", "dw"), (y, dx_, dw), want):
        assert torch.isfinite(g[:30] if name != "dw" else g[:2]).all(), name
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_misaligned_rows_fall_back_to_the_pointer_kernel(triton_device, tma_calls):
    x, w, offsets, dy = make([5, 0, 9], 2, 6, 10, triton_device)  # 24- and 40-byte float32 rows
    reason = gm_tma.tma_unsupported(x, w, x.new_empty(len(x), 10))
    assert reason is not None  # 16-byte rows in the interpreter; float32 or no sm90 on a GPU
    with gm.triton_kernels(forward="tma", dx="tma"):
        check_against_loop(x, w, offsets, dy, "fallback")
    assert tma_calls == []


def test_the_interpreter_runs_tensor_descriptors(triton_device):
    """Guards the tests above from passing through the fallback alone: where the kernels run
    in the interpreter, TMA-legal float32 shapes must take the TMA kernel."""
    import triton.language as tl

    if triton_device.type != "cpu":
        pytest.skip("the interpreter's case; on a GPU, test_kernel_choices_match_loop checks it")
    if not hasattr(tl, "make_tensor_descriptor"):
        pytest.skip("this Triton's interpreter has no tensor descriptors (needs Triton 3.4+)")
    x, w, _, _ = make([4, 4], 0, 8, 8, triton_device)
    assert tma_runs(x, w)


def test_kernel_choices_are_checked_and_restored():
    before = dict(gm.TRITON_KERNELS)
    with pytest.raises(ValueError, match=r"dx must be one of \('strided', 'copy', 'tma'\), got 'cutlass'"):
        with gm.triton_kernels(dx="cutlass"):
            pass
    with pytest.raises(ValueError, match="unknown choice 'backward'"):
        with gm.triton_kernels(backward="tma"):
            pass
    with pytest.raises(RuntimeError, match="inside"):
        with gm.triton_kernels(forward="tma", dx="copy"):
            assert gm.TRITON_KERNELS == {"forward": "tma", "dx": "copy", "tma_flatten": False}
            raise RuntimeError("inside")
    assert gm.TRITON_KERNELS == before


@pytest.mark.parametrize("dx", ["strided", "copy", "tma"])
def test_dx_op_passes_opcheck(dx, triton_device):
    x, w, offsets, dy = make([3, 0, 9], 2, 8, 12, triton_device)
    with gm.triton_kernels(forward="tma", dx=dx):
        torch.library.opcheck(torch.ops.optimus.grouped_mm_dx, (dy, w.detach(), offsets))


@pytest.mark.parametrize("dx", ["copy", "tma"])
def test_compiled_two_layer_product_with_the_tma_kernels(dx, triton_device):
    """Under torch.compile (AOTAutograd traces the dx op in the backward) as in eager."""
    torch._dynamo.reset()
    x, w1, offsets, _ = make([6, 0, 11], 2, 12, 20, triton_device)
    w2 = make([6, 0, 11], 2, 20, 8, triton_device, seed=1)[1]

    def two_layers(x, w1, w2, backend):
        return grouped_mm(grouped_mm(x, w1, offsets, backend=backend), w2, offsets, backend=backend)

    compiled = torch.compile(two_layers, backend="aot_eager", fullgraph=True)
    with gm.triton_kernels(forward="tma", dx=dx):
        out = compiled(x, w1, w2, "triton")
        got = (out, *torch.autograd.grad(out.nan_to_num().sum(), (x, w1, w2)))
    want = two_layers(x, w1, w2, "loop")
    want = (want, *torch.autograd.grad(want.nan_to_num().sum(), (x, w1, w2)))
    for name, g, r in zip(("y", "dx", "dw1", "dw2"), got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- bf16 on a GPU
# Tolerance as test_grouped_mm.py's bf16 tests: float32 accumulation, one bf16 rounding per entry.
@pytest.mark.gpu
@pytest.mark.parametrize("forward,dx,flatten", CHOICES)
@pytest.mark.parametrize("case", GPU_CASES)
def test_bf16_kernel_choices_on_gpu(case, forward, dx, flatten, gpu_device, rel_err, tma_calls):
    sizes, tail, K, N = GPU_CASES[case]
    x, w, offsets, dy = make(sizes, tail, K, N, gpu_device, torch.bfloat16)
    with gm.triton_kernels(forward=forward, dx=dx, tma_flatten=flatten):
        got = forward_backward(x, w, offsets, dy, backend="triton")
    xf, wf = (t.detach().float().requires_grad_() for t in (x, w))
    want = forward_backward(xf, wf, offsets, dy.float(), backend="loop")
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert g.dtype == torch.bfloat16
        assert rel_err(g, r) < 5e-3, name
    M = x.shape[0]
    assert not got[0][M - tail:].any() and not got[1][M - tail:].any()
    assert bool(tma_calls) == (tma_runs(x, w) and "tma" in (forward, dx))


@pytest.mark.gpu
def test_transposed_copy_casts_like_to(gpu_device):
    w = torch.randn(4, 136, 200, device=gpu_device)
    assert torch.equal(gm._transposed_copy(w, torch.bfloat16), w.to(torch.bfloat16).transpose(1, 2))


@pytest.mark.gpu
def test_bf16_tma_with_float32_master_weights(gpu_device, rel_err):
    """w float32: the TMA paths cast it first and compute exactly what the pointer kernel does."""
    x, w32, offsets, dy = make([5, 0, 9, 2], 3, 24, 16, gpu_device)
    x, dy = x.detach().bfloat16().requires_grad_(), dy.bfloat16()
    want = forward_backward(x, w32, offsets, dy, backend="triton")
    with gm.triton_kernels(forward="tma", dx="tma"):
        got = forward_backward(x, w32, offsets, dy, backend="triton")
    assert got[2].dtype == torch.float32
    for name, g, r in zip(("y", "dx", "dw"), got, want):  # same bf16 products, other tiles
        assert rel_err(g, r) < 5e-3, name


def test_grouped_mm_entry_point_defaults_to_the_measured_winner(triton_device):
    """The defaults are what the H200 A/B measured fastest (bench/NOTES.md): TMA forward and dx."""
    assert gm.TRITON_KERNELS == {"forward": "tma", "dx": "tma", "tma_flatten": False}
    x, w, offsets, _ = make([3, 5], 1, 8, 8, triton_device)
    torch.testing.assert_close(grouped_mm(x, w, offsets), grouped_mm(x, w, offsets, backend="loop"))
