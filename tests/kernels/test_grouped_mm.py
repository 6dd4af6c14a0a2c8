"""grouped_mm: the triton kernels against the plain-torch loop, outputs and both gradients.

float32 tolerance (rtol = atol = 1e-5): inputs are scaled so that every output and gradient
entry is O(1); both sides sum the same float32 products, only in different orders, and each
order lands within about n * 6e-8 * (sum of |terms|) of the exact sum, n <= 64 terms here,
so the two differ by well under 1e-5.
"""

import importlib.util
import os
import re

import pytest
import torch

from optimus_kernels import available_backends, grouped_mm, grouped_mm_reference, torch_grouped_mm_unsupported

# name: (rows per group, rows past offsets[-1], K, N). The interpreter's blocks are 16 x 16 x 16.
CASES = {
    "one group": ([37], 0, 24, 40),
    "empty groups and a tail": ([0, 17, 0, 30], 5, 24, 33),
    "one group takes all": ([0, 0, 45, 0, 0], 0, 32, 16),
    "ragged": ([3, 0, 21, 1, 16, 9, 0, 14], 0, 48, 40),
    "block-aligned": ([16, 32], 0, 32, 32),
    "K under one block": ([5, 7], 3, 3, 5),
    "all rows past the end": ([0, 0], 12, 16, 16),
    "no rows": ([0, 0, 0], 0, 8, 8),
}


def make(sizes, tail, K, N, device, dtype=torch.float32, seed=0):
    """x, w, offsets, dy; x's and dy's rows past offsets[-1] hold NaN, which must never leak."""
    gen = torch.Generator().manual_seed(seed)
    M = sum(sizes) + tail
    x = torch.randn(M, K, generator=gen)
    x[M - tail:] = float("nan")
    w = torch.randn(len(sizes), K, N, generator=gen) / K**0.5
    dy = torch.randn(M, N, generator=gen) / N**0.5
    dy[M - tail:] = float("nan")
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return (x.to(device, dtype).requires_grad_(), w.to(device, dtype).requires_grad_(),
            offsets.to(device), dy.to(device, dtype))


def forward_backward(x, w, offsets, dy, **kw):
    y = grouped_mm(x, w, offsets, **kw)
    return (y, *torch.autograd.grad(y, (x, w), dy))


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_loop(case, triton_device):
    sizes, tail, K, N = CASES[case]
    x, w, offsets, dy = make(sizes, tail, K, N, triton_device)
    got = forward_backward(x, w, offsets, dy, backend="triton")
    want = forward_backward(x, w, offsets, dy, backend="loop")
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    y, dx, _ = got
    M = x.shape[0]
    assert torch.equal(y[M - tail:], torch.zeros_like(y[M - tail:])), "rows past offsets[-1] must be 0"
    assert torch.equal(dx[M - tail:], torch.zeros_like(dx[M - tail:])), "and get zero gradient"


def test_triton_random_routings(triton_device):
    """Random group counts and sizes (many empty) at shapes off every block boundary."""
    gen = torch.Generator().manual_seed(1)
    for seed in range(3):
        G = int(torch.randint(1, 7, (1,), generator=gen))
        sizes = (torch.randint(0, 30, (G,), generator=gen) * (torch.rand(G, generator=gen) > 0.3)).tolist()
        tail = int(torch.randint(0, 4, (1,), generator=gen))
        x, w, offsets, dy = make(sizes, tail, 19, 23, triton_device, seed=seed)
        got = forward_backward(x, w, offsets, dy, backend="triton")
        want = forward_backward(x, w, offsets, dy, backend="loop")
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"sizes {sizes} tail {tail}: {m}")


def test_reference_is_the_row_by_row_definition():
    """The loop reference itself, against y[i] = x[i] @ w[group of row i] written out (float64)."""
    sizes, tail = [0, 3, 0, 4, 2], 2
    x, w, offsets, _ = make(sizes, tail, 5, 6, "cpu", torch.float64)
    group_of_row = [g for g, n in enumerate(sizes) for _ in range(n)] + [None] * tail
    want = torch.stack([x[i] @ w[g] if g is not None else torch.zeros(6, dtype=x.dtype)
                        for i, g in enumerate(group_of_row)])
    torch.testing.assert_close(grouped_mm_reference(x, w, offsets), want, rtol=0, atol=1e-12)


def test_torch_backend_refuses_cpu_with_the_reason():
    x, w, offsets, _ = make([4, 4], 0, 8, 8, "cpu")
    with pytest.raises(RuntimeError, match="backend='torch' is unavailable: torch._grouped_mm's fast "
                                           "path needs an NVIDIA CUDA device"):
        grouped_mm(x, w, offsets, backend="torch")


def test_available_backends_lists_what_runs_here():
    backends = available_backends()
    assert backends[0] == "loop"
    gpu = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    runs_triton = importlib.util.find_spec("triton") is not None and (
        gpu or os.environ.get("TRITON_INTERPRET") == "1")
    assert ("triton" in backends) == runs_triton
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    assert ("torch" in backends) == hopper


def test_argument_checks():
    x, w, offsets, _ = make([4, 4], 0, 8, 8, "cpu")
    with pytest.raises(ValueError, match="offsets must be int32"):
        grouped_mm(x, w, offsets.long())
    with pytest.raises(ValueError, match=r"need x \(M, K\) and w \(G, K, N\)"):
        grouped_mm(x, w.transpose(1, 2)[:, :7], offsets)
    with pytest.raises(ValueError, match="backend must be one of"):
        grouped_mm(x, w, offsets, backend="cutlass")


# ---------------------------------------------------------------- bf16 on a GPU
# bf16 tolerance: the inputs are bf16 on both sides, exact in float32, so the only difference
# from the float32 reference is float32 summation order (~1e-6) plus one rounding of each
# output to bf16 (at most 2^-9 = 2e-3 relative per entry); the norm-relative error is under
# 2e-3 and we allow 5e-3.
GPU_CASES = {
    "skewed, empty groups, tail": ([0, 300, 1, 0, 517, 64, 129, 0], 7, 256, 384),
    "off the block grid": ([33, 0, 250, 3], 0, 200, 136),
}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_bf16_on_gpu(case, backend, gpu_device, rel_err):
    sizes, tail, K, N = GPU_CASES[case]
    x, w, offsets, dy = make(sizes, tail, K, N, gpu_device, torch.bfloat16)
    if backend == "torch" and (reason := torch_grouped_mm_unsupported(x, w)) is not None:
        with pytest.raises(RuntimeError, match=re.escape(reason)):
            grouped_mm(x, w, offsets, backend="torch")
        return
    got = forward_backward(x, w, offsets, dy, backend=backend)
    xf, wf = (t.detach().float().requires_grad_() for t in (x, w))
    want = forward_backward(xf, wf, offsets, dy.float(), backend="loop")
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert g.dtype == torch.bfloat16
        assert rel_err(g, r) < 5e-3, name
    M = x.shape[0]
    assert not got[0][M - tail:].any() and not got[1][M - tail:].any()


@pytest.mark.parametrize("backend, keep_cast", [
    ("loop", False), pytest.param("triton", False, marks=pytest.mark.gpu),
    pytest.param("triton", True, marks=pytest.mark.gpu), pytest.param("torch", False, marks=pytest.mark.gpu)])
def test_float32_master_weights_compute_like_their_half_copy(backend, keep_cast, request, rel_err):
    """w float32 with x bf16: the same y and dx as with w cast to bf16 first, and dw in float32:
    loop and torch widen the bf16 dw; triton writes its float32 accumulator (no rounding to bf16
    between), so its dw is the float32 sum of the same bf16 products. Loop runs on the CPU;
    the others where they can run (GPU)."""
    device = "cpu" if backend == "loop" else request.getfixturevalue("gpu_device")
    x, w32, offsets, dy = make([5, 0, 9, 2], 3, 24, 16, device)
    x, dy = x.detach().bfloat16().requires_grad_(), dy.bfloat16()
    if backend == "torch" and torch_grouped_mm_unsupported(x, w32.detach().bfloat16()) is not None:
        pytest.skip("torch._grouped_mm has no fast path here")
    w16 = w32.detach().bfloat16().requires_grad_()
    y16, dx16, dw16 = forward_backward(x, w16, offsets, dy, backend=backend)
    x2 = x.detach().requires_grad_()
    y, dx, dw = forward_backward(x2, w32, offsets, dy, backend=backend, keep_cast=keep_cast)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert torch.equal(y, y16) and torch.equal(dx, dx16)
    if backend == "triton":
        xf = x.detach().float().nan_to_num()  # rows past offsets[-1] (NaN) belong to no group
        want = torch.zeros_like(dw)
        rows, start = dy.float().nan_to_num(), 0
        for g, end in enumerate(offsets.tolist()):
            want[g] = xf[start:end].T @ rows[start:end]
            start = end
        assert rel_err(dw, want) < 1e-5 and rel_err(dw.bfloat16(), dw16) < 1e-2
    else:
        assert torch.equal(dw, dw16.float())


@pytest.mark.parametrize("keep_cast", [False, True])
def test_keep_cast_keeps_the_half_copy_or_not(keep_cast, triton_device):
    """float32 w with float16 x (the interpreter runs float16): the same results either way; the
    backward keeps the forward's half-precision copy of w only with keep_cast, else a float32
    w (cast again in the backward); dw comes back float32."""
    x, w, offsets, dy = make([4, 0, 7], 2, 16, 8, triton_device)
    x, dy = x.detach().half().requires_grad_(), dy.half()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t,
                                                  lambda t: t):
        y = grouped_mm(x, w, offsets, keep_cast=keep_cast)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    weights_saved = [dtype for dtype, shape in saved if shape == tuple(w.shape)]
    assert weights_saved == ([torch.float16] if keep_cast else [torch.float32])
    ref = forward_backward(x.detach().float().requires_grad_(), w, offsets, dy.float(), backend="loop")
    M = x.shape[0] - 2
    for name, g, r in zip(("y", "dx", "dw"), (y, dx, dw), ref):
        torch.testing.assert_close(g[:M].float() if name != "dw" else g, r[:M] if name != "dw" else r,
                                   rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")
    assert dw.dtype == torch.float32


def test_mixed_dtypes_other_than_float32_master_weights_are_refused():
    x, w, offsets, _ = make([2, 3], 0, 8, 8, "cpu")
    with pytest.raises(ValueError, match="w float32 with x in half precision"):
        grouped_mm(x, w.bfloat16(), offsets, backend="loop")


@pytest.mark.parametrize("backend", ["loop", "triton"])
@pytest.mark.parametrize("weights", ["same dtype", "float32 master", "float32 master, w_cast", "keep_cast"])
def test_dw_square_gets_the_squared_norm_of_ws_gradient(backend, weights, request):
    """dw_square's gradient is sum(w.grad ** 2) of this call's w gradient, on every path that
    makes dw (the triton backend's from its dW kernel), and gradients otherwise unchanged."""
    device = "cpu" if backend == "loop" else request.getfixturevalue("triton_device")
    x, w, offsets, dy = make([5, 0, 9, 2], 3, 24, 16, device)
    kw = {}
    if weights != "same dtype":  # half-precision activations (float16: the interpreter runs it)
        x, dy = x.detach().half().requires_grad_(), dy.half()
        if weights == "float32 master, w_cast":
            kw["w_cast"] = w.detach().half()
        kw["keep_cast"] = weights == "keep_cast"
    square = torch.zeros((), requires_grad=True, device=device)
    want = forward_backward(x, w, offsets, dy, backend=backend, **kw)
    y = grouped_mm(x, w, offsets, backend=backend, dw_square=square, **kw)
    got = (y, *torch.autograd.grad(y, (x, w, square), dy))
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert torch.equal(g.nan_to_num(), r.nan_to_num()), name
    torch.testing.assert_close(got[3].double(), got[2].double().square().sum(), rtol=1e-5, atol=1e-6)


def test_dw_square_must_be_a_0d_float32_that_wants_a_gradient():
    x, w, offsets, _ = make([2, 3], 0, 8, 8, "cpu")
    for bad in (torch.zeros(()), torch.zeros(1, requires_grad=True), torch.zeros((), dtype=torch.float64,
                                                                                  requires_grad=True)):
        with pytest.raises(ValueError, match="dw_square must be a 0-d float32 tensor that requires grad"):
            grouped_mm(x, w, offsets, backend="loop", dw_square=bad)
