"""The shared layers: RMSNorm against float64 autograd on odd shapes (its hand-written backward
for a 16-bit input in eager mode, torch's ops otherwise), and what it keeps for the backward (a
16-bit input as it came, not float32 copies)."""
import pytest
import torch

from optimus_core.model.layers import RMSNorm


def _float64_norm(x, w, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(7, 33), (2, 5, 48), (3, 1, 4, 13)])
def test_rms_norm_matches_float64_autograd(shape, dtype, tol):
    g = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_()
    dout = torch.randn(shape, generator=g).to(dtype)
    out = norm(x)
    out.backward(dout)
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    want = _float64_norm(x64, w64, 1e-5)
    want.backward(dout.double())
    assert out.dtype == dtype and x.grad.dtype == dtype and norm.weight.grad.dtype == torch.float32
    # the forward's float32 arithmetic, rounded once to the input's dtype
    torch.testing.assert_close(out.double(), want.detach().to(dtype).double(), rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(norm.weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-4)


def test_rms_norm_forward_is_the_plain_ops_bit_for_bit():
    x = torch.randn(4, 40).to(torch.bfloat16)
    norm = RMSNorm(40)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x32 = x.float()
    plain = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight).to(x.dtype)
    assert torch.equal(norm(x), plain)


def test_rms_norm_keeps_a_16_bit_input_and_one_rsqrt_per_row():
    norm = RMSNorm(64)
    x = torch.randn(6, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    activations = [t for t in saved if t is not norm.weight]
    assert sorted((tuple(t.shape), str(t.dtype)) for t in activations) == [((6, 1), "torch.float32"),
                                                                            ((6, 64), "torch.bfloat16")]
    assert any(t.data_ptr() == x.data_ptr() for t in activations)  # the input itself, not a copy


def test_a_float32_input_and_a_compiled_graph_take_torch_ops():
    """Where the Function gains nothing (a float32 input is its own copy; a compiled graph's
    partitioner picks what to keep), torch's ops, which torch.compile differentiates itself: on
    an H200 the Function passed no gradient through a compiled float32 norm."""
    norm = RMSNorm(64)
    x = torch.randn(6, 64, requires_grad=True)
    assert type(norm(x).grad_fn).__name__ == "MulBackward0"
    assert type(norm(x.to(torch.bfloat16)).grad_fn).__name__ == "_RMSNormFunctionBackward"
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward
    compiled = torch.compile(norm.forward, backend=backend)
    out = compiled(x.detach().to(torch.bfloat16).requires_grad_())
    assert out.dtype == torch.bfloat16 and "autograd_function_apply" not in seen[0].code


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(7, 33), (2, 5, 48), (3, 1, 4, 13)])
def test_olmo_layer_norm_matches_float64_autograd(shape, dtype, tol):
    """OLMo-1B's LayerNorm without scale or bias: its hand-written backward for a 16-bit input
    (torch's F.layer_norm otherwise) against float64 autograd; it keeps that input and two float32
    numbers per row."""
    from optimus_core.model.layers import NonParametricLayerNorm

    g = torch.Generator().manual_seed(sum(shape) + 1)
    norm = NonParametricLayerNorm(eps=1e-5)
    x = (3 * torch.randn(shape, generator=g) + 1).to(dtype).requires_grad_()
    dout = torch.randn(shape, generator=g).to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = norm(x)
    out.backward(dout)
    x64 = x.detach().double().requires_grad_()
    want = torch.nn.functional.layer_norm(x64, shape[-1:], eps=1e-5)
    want.backward(dout.double())
    assert out.dtype == dtype and x.grad.dtype == dtype and not list(norm.parameters())
    torch.testing.assert_close(out.double(), want.detach().to(dtype).double(), rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol)
    if dtype == torch.bfloat16:
        rows = (*shape[:-1], 1)
        assert sorted((tuple(t.shape), str(t.dtype)) for t in saved) == sorted(
            [(rows, "torch.float32"), (rows, "torch.float32"), (shape, "torch.bfloat16")])
