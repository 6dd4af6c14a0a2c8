"""swiglu: the fused triton kernels against the plain-torch reference (output and dh).

float32 tolerance (rtol = atol = 1e-5): both sides evaluate the same formula in float32 with
differently rounded sigmoid/exp (a few ulps, ~1e-7 relative per operation, a handful of
operations per entry), far inside 1e-5.
"""

import pytest
import torch

from optimus_kernels import swiglu, swiglu_reference

# (M, H, scale of h): the large scale drives sigmoid into saturation, where a naive
# exp(-gate) overflows.
CASES = [(1, 1, 1.0), (37, 19, 1.0), (64, 32, 1.0), (5, 100, 30.0), (0, 8, 1.0)]


def make(M, H, scale, device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(M * 1000 + H)
    h = torch.randn(M, 2 * H, generator=gen) * scale
    return h.to(device, dtype).requires_grad_(), torch.randn(M, H, generator=gen).to(device, dtype)


def test_reference_is_the_definition():
    h, _ = make(7, 5, 3.0, "cpu", torch.float64)
    gate, up = h[:, :5], h[:, 5:]
    torch.testing.assert_close(swiglu_reference(h), gate / (1 + torch.exp(-gate)) * up, rtol=1e-12, atol=0)


# sigmoid(-100) = 1 / (1 + exp(100)) = 1 / inf = 0 is right; numpy (the interpreter) warns.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("M,H,scale", CASES)
def test_triton_matches_reference(M, H, scale, triton_device):
    h, dout = make(M, H, scale, triton_device)
    got = swiglu(h, backend="triton")
    want = swiglu(h, backend="loop")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (dh,) = torch.autograd.grad(got, h, dout)
    (dh_ref,) = torch.autograd.grad(want, h, dout)
    torch.testing.assert_close(dh, dh_ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(dh).all()


def test_argument_checks():
    h, _ = make(3, 4, 1.0, "cpu")
    with pytest.raises(ValueError, match=r"need h of shape \(M, 2H\)"):
        swiglu(h[:, :7])
    with pytest.raises(ValueError, match="backend must be one of"):
        swiglu(h, backend="fused")


# bf16 tolerance: the kernel reads bf16, computes in float32 and rounds each result once
# (<= 2^-9 relative per entry); compared with the float32 reference on the same bf16 inputs
# the norm-relative error stays under 2e-3, we allow 5e-3.
@pytest.mark.gpu
def test_bf16_on_gpu(gpu_device, rel_err):
    h, dout = make(1000, 1024, 2.0, gpu_device, torch.bfloat16)
    out = swiglu(h)
    (dh,) = torch.autograd.grad(out, h, dout)
    hf = h.detach().float().requires_grad_()
    out_ref = swiglu_reference(hf)
    (dh_ref,) = torch.autograd.grad(out_ref, hf, dout.float())
    assert out.dtype == dh.dtype == torch.bfloat16
    assert rel_err(out, out_ref) < 5e-3 and rel_err(dh, dh_ref) < 5e-3


def test_weighted_reference_scales_each_row():
    h, _ = make(6, 4, 2.0, "cpu", torch.float64)
    w = torch.rand(6, dtype=torch.float64)
    torch.testing.assert_close(swiglu_reference(h, w), swiglu_reference(h) * w[:, None], rtol=1e-12, atol=0)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("M,H,scale", CASES)
def test_weighted_triton_matches_reference(M, H, scale, triton_device):
    """Output, dh and the row weights' gradient (a sum over each row); zero weights (assignments
    dropped over capacity) among them. float32: the same tolerance as above, the row sum adds
    at most H roundings of ~1e-7 relative."""
    h, dout = make(M, H, scale, triton_device)
    w = torch.rand(M, generator=torch.Generator().manual_seed(M)).to(triton_device)
    w[::3] = 0.0
    w.requires_grad_()
    got = swiglu(h, row_weight=w, backend="triton")
    want = swiglu(h, row_weight=w, backend="loop")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(got, (h, w), dout)
    grads_ref = torch.autograd.grad(want, (h, w), dout)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(g).all()


def test_weighted_argument_checks():
    h, _ = make(3, 4, 1.0, "cpu")
    with pytest.raises(ValueError, match=r"row_weight must be \(3,\)"):
        swiglu(h, row_weight=torch.ones(4))


def test_weighted_ops_pass_opcheck(triton_device):
    h, dout = make(9, 6, 1.0, triton_device)
    w = torch.rand(9, device=triton_device)
    torch.library.opcheck(torch.ops.optimus.swiglu_weighted, (h.detach(), w))
    torch.library.opcheck(torch.ops.optimus.swiglu_weighted_backward, (h.detach(), w, dout))


@pytest.mark.gpu
def test_weighted_bf16_on_gpu(gpu_device, rel_err):
    """bf16 h and dout, float32 routing weights: the tolerance of test_bf16_on_gpu; the weights'
    gradient is a float32 sum of 1024 products of bf16-rounded inputs."""
    h, dout = make(1000, 1024, 2.0, gpu_device, torch.bfloat16)
    w = torch.rand(1000, device=gpu_device, requires_grad=True)
    out = swiglu(h, row_weight=w)
    dh, dw = torch.autograd.grad(out, (h, w), dout)
    hf, wf = h.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    out_ref = swiglu_reference(hf, wf)
    dh_ref, dw_ref = torch.autograd.grad(out_ref, (hf, wf), dout.float())
    assert out.dtype == dh.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert rel_err(out, out_ref) < 5e-3 and rel_err(dh, dh_ref) < 5e-3 and rel_err(dw, dw_ref) < 5e-3
