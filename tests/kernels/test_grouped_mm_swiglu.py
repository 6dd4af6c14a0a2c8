"""grouped_mm_swiglu: the up projection and its SwiGLU as one op (kernels/grouped_mm_swiglu.py).

Its contract is the pair's: swiglu(grouped_mm(x, w, offsets), row_weight). On the CPU the
triton backend's op runs the two kernels in the interpreter (the fused epilogue is Gluon, Hopper
only), so these tests hold the op's autograd, weight variants and checks to the pair's; on a
Hopper GPU the fused kernel must give the pair's bits (the same 16-bit h into the same formula)
on odd shapes: empty groups, a partial last row tile per group, rows past offsets[-1], a few
programs with many items each and the whole GPU's.
"""

import pytest
import torch

import kernels.grouped_mm_tma as gm_tma
import kernels.grouped_mm_ws as ws
from kernels import grouped_mm, grouped_mm_swiglu, swiglu

from test_grouped_mm import make


def pair(x, w, offsets, row_weight, backend, **kw):
    return swiglu(grouped_mm(x, w, offsets, backend=backend, **kw), row_weight=row_weight, backend=backend)


def inputs(sizes, tail, K, H, device, dtype=torch.float32, seed=0):
    x, w, offsets, _ = make(sizes, tail, K, 2 * H, device, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    row_weight = torch.rand(x.shape[0], generator=gen).to(device).requires_grad_()
    dout = (torch.randn(x.shape[0], H, generator=gen) / H**0.5).to(device, dtype)
    return x, w, offsets, row_weight, dout


def grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


CASES = {  # sizes, tail, K, H
    "odd groups and a tail": ([3, 0, 5, 1, 9], 2, 24, 20),
    "one group": ([13], 0, 16, 8),
    "empty groups only but one": ([0, 0, 7, 0], 3, 8, 12),
}


@pytest.mark.parametrize("weighted", [True, False], ids=["row weights", "no row weights"])
@pytest.mark.parametrize("case", CASES)
def test_triton_op_is_the_pair(case, weighted, triton_device):
    """Output and every gradient (x, w, the row weights, the dW's sum of squares) are the two
    ops', which test_grouped_mm and test_swiglu hold to their references."""
    sizes, tail, K, H = CASES[case]
    x, w, offsets, row_weight, dout = inputs(sizes, tail, K, H, triton_device)
    rw = row_weight if weighted else None
    leaves = [x, w] + ([row_weight] if weighted else [])
    results = []
    for fn in (grouped_mm_swiglu, pair):
        square = torch.zeros((), device=triton_device, requires_grad=True)
        kw = {"row_weight": rw, "backend": "triton"} if fn is grouped_mm_swiglu else {}
        out = grouped_mm_swiglu(x, w, offsets, dw_square=square, **kw) if kw else \
            pair(x, w, offsets, rw, "triton", dw_square=square)
        results.append((out, *grads(out, leaves + [square], dout)))
    M = x.shape[0] - tail  # x's rows past offsets[-1] hold NaN: their dx is zero in both
    for name, got, want in zip(["out", "dx", "dw"] + (["drow_weight"] if weighted else []) + ["dw_square"],
                               *results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert not results[0][0][M:].any(), "rows past offsets[-1] come out zero"


def test_other_backends_and_loop_agree(triton_device):
    x, w, offsets, row_weight, dout = inputs([4, 0, 11, 2], 1, 16, 12, triton_device)
    got = grouped_mm_swiglu(x, w, offsets, row_weight=row_weight, backend="triton")
    want = grouped_mm_swiglu(*(t.cpu() for t in (x, w, offsets)), row_weight=row_weight.cpu(), backend="loop")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads(got, (x, w, row_weight), dout), grads(want, (x, w, row_weight), dout.cpu())):
        torch.testing.assert_close(g.cpu(), r.cpu(), rtol=1e-5, atol=1e-5)


def test_the_copy_is_read_and_the_gradient_goes_to_w(triton_device):
    """w_cast: the product reads the copy (here of other values than w, so that it shows);
    w gets the gradient, the copy none."""
    x, w, offsets, row_weight, dout = inputs([5, 0, 9], 2, 16, 8, triton_device)
    other = (w.detach() * 1.5 + 0.1).contiguous()
    out = grouped_mm_swiglu(x, w, offsets, row_weight=row_weight, w_cast=other)
    w_other = other.clone().requires_grad_()
    want = pair(x, w_other, offsets, row_weight, "loop")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    (dw,) = grads(out, (w,), dout)
    (want_dw,) = grads(want, (w_other,), dout)
    torch.testing.assert_close(dw, want_dw, rtol=1e-5, atol=1e-5)
    assert other.grad is None and not other.requires_grad


def test_float32_weights_with_half_inputs_cast_inside(triton_device):
    """float32 master weights and float16 rows (the interpreter has no bf16): the weights are
    cast inside the op, the gradient comes back in float32; keep_cast takes grouped_mm's op
    that keeps its copy. Both are the pair's, bit for bit."""
    x, w, offsets, row_weight, dout = inputs([4, 0, 7, 12], 2, 16, 12, triton_device)
    x, dout = x.detach().half().requires_grad_(), dout.half()
    for keep_cast in (False, True):
        got = grouped_mm_swiglu(x, w, offsets, row_weight=row_weight, keep_cast=keep_cast)
        want = pair(x, w, offsets, row_weight, "triton", keep_cast=keep_cast)
        assert got.dtype == torch.float16 and torch.equal(got, want)
        (gx, gw, grw), (rx, rw_, rrw) = grads(got, (x, w, row_weight), dout), grads(want, (x, w, row_weight), dout)
        M = x.shape[0] - 2
        assert gw.dtype == torch.float32 and torch.equal(gw, rw_) and torch.equal(gx[:M], rx[:M])
        assert torch.equal(grw, rrw)


def test_argument_checks(triton_device):
    x, w, offsets, row_weight, _ = inputs([3, 2], 0, 8, 4, triton_device)
    with pytest.raises(ValueError, match="even number"):
        grouped_mm_swiglu(x, w[:, :, :7], offsets)
    with pytest.raises(ValueError, match=r"row_weight must be \(5,\)"):
        grouped_mm_swiglu(x, w, offsets, row_weight=row_weight[:4])
    with pytest.raises(ValueError, match="need x"):
        grouped_mm_swiglu(x[:, :6], w, offsets)


def test_opcheck(triton_device):
    x, w, offsets, row_weight, _ = inputs([3, 0, 6], 1, 8, 4, triton_device)
    torch.library.opcheck(torch.ops.optimus.grouped_mm_swiglu,
                          (x.detach().requires_grad_(), w, None, offsets, row_weight, None))
    torch.library.opcheck(torch.ops.optimus.grouped_mm_swiglu,
                          (x.detach().requires_grad_(), w, None, offsets, None, None))


def test_says_why_it_cannot_fuse(monkeypatch):
    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 256, dtype=torch.bfloat16)
    h, out = torch.zeros(8, 256, dtype=torch.bfloat16), torch.zeros(8, 128, dtype=torch.bfloat16)
    assert ws.swiglu_unsupported(x, w, h, out, None)  # CPU tensors: no Hopper GPU
    monkeypatch.setattr(ws, "_device_unsupported", lambda t: None)  # the shape rules alone
    assert ws.swiglu_unsupported(x, w, h, out, None) is None
    assert ws.swiglu_unsupported(x, w, h, out, torch.ones(8)) is None
    assert "whole 64-column" in ws.swiglu_unsupported(x, w[:, :, :192].contiguous(), h[:, :192].contiguous(),
                                                      out[:, :96].contiguous(), None)
    assert "must be (8, 128)" in ws.swiglu_unsupported(x, w, h, out.float(), None)
    assert "row_weight" in ws.swiglu_unsupported(x, w, h, out, torch.ones(7))
    assert "multiple of 64" in ws.swiglu_unsupported(x[:, :40], w[:, :40], h, out, None)  # the GEMM's own rules


# --------------------------------------------------------------------------- on a Hopper GPU
@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [True, False], ids=["row weights", "no row weights"])
@pytest.mark.parametrize("programs", [3, None], ids=["3 programs", "one per SM"])
def test_fused_epilogue_gives_the_pairs_bits_on_hopper(weighted, programs, gpu_device, monkeypatch):
    """The fused kernel's h and out against the two kernels', bit for bit, on odd shapes (rows
    per group not multiples of 128, empty groups, a tail past offsets[-1] whose h and out must
    come out zero: both start as NaN)."""
    sizes = [0, 3000, 1, 0, 5170, 640, 1290, 0, 77] if programs is None else [0, 300, 1, 0, 517, 64, 129, 0]
    x, w, offsets, row_weight, _ = inputs(sizes, 7, 192, 192, gpu_device, torch.bfloat16)
    x, w, rw = x.detach(), w.detach(), row_weight.detach() if weighted else None
    h = torch.full((x.shape[0], w.shape[2]), float("nan"), device=gpu_device, dtype=x.dtype)
    out = torch.full((x.shape[0], w.shape[2] // 2), float("nan"), device=gpu_device, dtype=x.dtype)
    if (reason := ws.swiglu_unsupported(x, w, h, out, rw)) is not None:
        pytest.skip(reason)
    if programs is not None:
        monkeypatch.setattr(gm_tma, "_num_programs", lambda device: programs)
    ws.launch_grouped_mm_ws(x, w, offsets, h, swiglu_out=out, row_weight=rw)
    want_h = torch.full_like(h, float("nan"))
    ws.launch_grouped_mm_ws(x, w, offsets, want_h)
    want_out = swiglu(want_h, row_weight=rw)
    assert torch.equal(h, want_h)
    assert torch.equal(out, want_out)
    tail = int(offsets[-1])
    assert not h[tail:].any() and not out[tail:].any()


@pytest.mark.gpu
def test_fused_op_matches_float32_reference_on_hopper(gpu_device, rel_err):
    """The op in bf16 (forward fused, backward the pair's) against the float32 loop."""
    x, w, offsets, row_weight, dout = inputs([0, 700, 3, 1200, 64], 5, 256, 128, gpu_device, torch.bfloat16)
    out = grouped_mm_swiglu(x, w, offsets, row_weight=row_weight)
    got = (out, *grads(out, (x, w, row_weight), dout))
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    rwf = row_weight.detach().clone().requires_grad_()
    want_out = pair(xf, wf, offsets, rwf, "loop")
    want = (want_out, *grads(want_out, (xf, wf, rwf), dout.float()))
    M = x.shape[0] - 5
    for name, g, r in zip(("out", "dx", "dw", "drow_weight"), got, want):
        g, r = (g[:M], r[:M]) if name in ("out", "dx") else (g, r)
        assert rel_err(g, r) < 1e-2, name
