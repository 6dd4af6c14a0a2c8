"""grouped_mm(..., w_cast=): the product reads the copy, the gradient goes to w.

The copy is what the optimizer keeps of float32 master weights (optimus_core.model.experts). Two
checks per backend: with a copy of *other values* than w (float32, so the interpreter runs it),
y and dx are those of the copy and dw lands on w, none on the copy; with the real half-precision
copy of float32 w (float16: the interpreter runs it), every result is bit-identical to the op
casting w itself, and the backward keeps no float32 w alive.
"""

import pytest
import torch

from optimus_kernels import grouped_mm

from test_grouped_mm import make


def _backend_device(backend, request):
    return "cpu" if backend == "loop" else request.getfixturevalue("triton_device")


@pytest.mark.parametrize("backend", ["loop", "triton"])
def test_the_product_reads_the_copy_and_the_gradient_goes_to_w(backend, request):
    device = _backend_device(backend, request)
    x, w, offsets, dy = make([5, 0, 19, 3], 4, 24, 20, device)
    other = (w.detach() * 1.5 + 0.1).contiguous()  # not w: what is read must be this
    y = grouped_mm(x, w, offsets, backend=backend, w_cast=other)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    w_other = other.clone().requires_grad_()
    want = grouped_mm(x, w_other, offsets, backend="loop")
    want_dx, want_dw = torch.autograd.grad(want, (x, w_other), dy)
    for name, g, r in (("y", y, want), ("dx", dx, want_dx), ("dw", dw, want_dw)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert dw.dtype == torch.float32 and not other.requires_grad and other.grad is None
    assert not torch.allclose(y[:27], grouped_mm(x, w, offsets, backend="loop")[:27])  # w itself differs


@pytest.mark.parametrize("backend, dtype", [
    ("loop", torch.float16), ("triton", torch.float16), ("loop", torch.bfloat16),
    pytest.param("triton", torch.bfloat16, marks=pytest.mark.gpu)])  # the interpreter has no bf16
def test_a_current_half_copy_changes_nothing_but_the_cast(backend, dtype, request):
    if backend == "triton" and dtype == torch.bfloat16:
        device = request.getfixturevalue("gpu_device")
    else:
        device = _backend_device(backend, request)
    x, w, offsets, dy = make([4, 0, 7, 12], 2, 16, 24, device)
    x, dy = x.detach().to(dtype).requires_grad_(), dy.to(dtype)
    w_half = w.detach().to(dtype)
    results = []
    for kw in ({}, {"w_cast": w_half}):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = grouped_mm(x, w, offsets, backend=backend, **kw)
        results.append((y, *torch.autograd.grad(y, (x, w), dy)))
        if kw:  # the copy is kept for the backward, never the float32 weights
            assert not [t for t in saved if t.dtype == torch.float32 and t.shape == w.shape]
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    assert y1.dtype == dx1.dtype == dtype and dw1.dtype == torch.float32
    M = x.shape[0] - 2  # the rows past offsets[-1] hold NaN in x and dy: compare the rest
    assert torch.equal(y1, y0) and torch.equal(dx1[:M], dx0[:M]) and torch.equal(dw1, dw0)


def test_the_custom_op_passes_opcheck(triton_device):
    x, w, offsets, _ = make([3, 0, 9], 0, 16, 8, triton_device)
    torch.library.opcheck(torch.ops.optimus.grouped_mm_cast,
                          (x.detach().half().requires_grad_(), w, w.detach().half(), offsets))


def test_compiled_matches_eager(triton_device):
    torch._dynamo.reset()
    x, w, offsets, dy = make([6, 0, 10], 0, 16, 16, triton_device)
    w_cast = (w.detach() * 0.5).contiguous()

    def f(x, w, w_cast, offsets):
        return grouped_mm(x, w, offsets, w_cast=w_cast)

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, w_cast, offsets)
    want = f(x, w, w_cast, offsets)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, r in zip(torch.autograd.grad(got, (x, w), dy), torch.autograd.grad(want, (x, w), dy)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("bad, match", [
    (lambda w: w.detach()[:, :-1].half(), "w's shape"),
    (lambda w: w.detach().bfloat16(), "in x's dtype"),
    (lambda w: w.detach().half().requires_grad_(), "must not require grad"),
])
def test_wrong_copies_are_refused(bad, match):
    x, w, offsets, _ = make([2, 3], 0, 8, 8, "cpu")
    with pytest.raises(ValueError, match=match):
        grouped_mm(x.detach().half(), w, offsets, backend="loop", w_cast=bad(w))
