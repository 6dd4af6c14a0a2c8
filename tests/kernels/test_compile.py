"""The triton ops as torch custom ops: torch.library.opcheck on each (schema, fake tensor,
autograd registration, AOT dispatch), and a whole SwiGLU expert block under torch.compile
(fullgraph, AOTAutograd) matching the eager loop backend in output and every gradient."""

import pytest
import torch

import optimus_kernels  # noqa: F401  (registers the optimus:: ops)
from optimus_kernels import grouped_mm, permute, swiglu, unpermute


def expert_block(x, topk_idx, topk_weights, w_up, w_down, backend):
    """An MoE layer's expert compute: route, gate+up projection, SwiGLU, down, combine."""
    x_sorted, offsets, sorted_idx = permute(x, topk_idx, w_up.shape[0], backend=backend)
    h = grouped_mm(x_sorted, w_up, offsets, backend=backend)
    y = grouped_mm(swiglu(h, backend=backend), w_down, offsets, backend=backend)
    return unpermute(y, sorted_idx, topk_weights, backend=backend)


def inputs(device, T=11, D=16, H=8, E=4, k=2):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=gen)
    topk_weights, topk_idx = torch.rand(T, E, generator=gen).softmax(-1).topk(k)
    w_up = torch.randn(E, D, 2 * H, generator=gen) / D**0.5
    w_down = torch.randn(E, H, D, generator=gen) / H**0.5
    leaves = [t.to(device).requires_grad_() for t in (x, topk_weights, w_up, w_down)]
    return leaves, topk_idx.to(device)


def test_opcheck(triton_device):
    """The *_backward / _dw ops have no autograd of their own (no double backward), so their
    inputs do not require grad."""
    (x, weights, w_up, _), topk_idx = inputs(triton_device)
    x_sorted, offsets, sorted_idx = (t.detach() for t in permute(x, topk_idx, w_up.shape[0]))
    h, y = torch.randn(len(x_sorted), 16, device=triton_device), torch.randn_like(x_sorted)
    grad = lambda t: t.detach().requires_grad_()  # noqa: E731
    ops = torch.ops.optimus
    for op, args in [
        (ops.grouped_mm, (grad(x_sorted), w_up, offsets)),
        (ops.grouped_mm_dw, (x_sorted, h, offsets)),
        (ops.grouped_mm_dw, (x_sorted, h, offsets, True)),
        (ops.grouped_mm_keep_cast, (grad(x_sorted.half()), w_up, offsets)),
        (ops.permute_rows, (x, sorted_idx, topk_idx.shape[1], len(sorted_idx))),
        (ops.permute_rows, (x, sorted_idx, topk_idx.shape[1], len(sorted_idx) - 3)),  # a prefix only
        (ops.unpermute, (grad(y), sorted_idx, weights)),
        (ops.unpermute, (grad(y[:-3]), sorted_idx, weights)),
        (ops.unpermute_backward, (x.detach(), y, sorted_idx, weights.detach())),
        (ops.swiglu, (grad(h),)),
        (ops.swiglu_backward, (h, h[:, :8])),
    ]:
        torch.library.opcheck(op, args)


def test_compiled_block_matches_eager_loop(triton_device):
    torch._dynamo.reset()
    leaves, topk_idx = inputs(triton_device)
    compiled = torch.compile(expert_block, backend="aot_eager", fullgraph=True)
    out = compiled(leaves[0], topk_idx, *leaves[1:], backend="triton")
    want = expert_block(leaves[0], topk_idx, *leaves[1:], backend="loop")
    grad = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, leaves, grad)
    want_grads = torch.autograd.grad(want, leaves, grad)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for name, g, r in zip(("x", "topk_weights", "w_up", "w_down"), got_grads, want_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"d{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_compiled_block_bf16_on_gpu(backend, gpu_device, rel_err):
    """The same under torch.compile in bf16, for both fast backends ("torch" launches a Triton
    kernel inside an autograd.Function, which dynamo must trace too). Compiled and eager run
    the same kernels, so they agree to bf16 rounding of differently fused elementwise ops."""
    torch._dynamo.reset()
    leaves, topk_idx = inputs(gpu_device, T=300, D=64, H=32, E=8, k=2)
    leaves = [t.detach().bfloat16().requires_grad_() for t in leaves]
    if backend == "torch" and optimus_kernels.torch_grouped_mm_unsupported(leaves[0], leaves[2]):
        pytest.skip(optimus_kernels.torch_grouped_mm_unsupported(leaves[0], leaves[2]))
    compiled = torch.compile(expert_block, backend="aot_eager", fullgraph=True)
    out = compiled(leaves[0], topk_idx, *leaves[1:], backend=backend)
    want = expert_block(leaves[0], topk_idx, *leaves[1:], backend=backend)
    grad = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, leaves, grad))
    for g, r in zip(got, (want, *torch.autograd.grad(want, leaves, grad))):
        assert rel_err(g, r) < 1e-2


def test_qk_norm_rope_opcheck_and_compiled_attention_inputs(triton_device):
    """The QK-norm + RoPE op: opcheck (its backward op has no autograd: plain inputs), and under
    torch.compile (fullgraph, AOTAutograd) the same output and gradients as eager, with the
    head-major transposed view the attention takes."""
    from optimus_kernels import qk_norm_rope
    from optimus_core.model.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(3)
    B, S, H, Dh = 2, 5, 3, 8
    x = torch.randn(B, S, H * Dh, generator=gen).to(triton_device)
    w = (torch.rand(H * Dh, generator=gen) + 0.5).to(triton_device)
    cos, sin = (t.to(triton_device) for t in RotaryEmbedding(Dh, 10000.0, S)(S))
    ops = torch.ops.optimus
    torch.library.opcheck(ops.qk_norm_rope, (x.clone().requires_grad_(), w.clone().requires_grad_(), cos, sin, 1e-5))
    torch.library.opcheck(ops.qk_norm_rope_backward, (x, w, cos, sin, torch.randn_like(x), 1e-5))

    def heads(x, w):
        return qk_norm_rope(x, w, cos, sin, eps=1e-5).view(B, S, H, Dh).transpose(1, 2)

    torch._dynamo.reset()
    compiled_leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    eager_leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    out = torch.compile(heads, backend="aot_eager", fullgraph=True)(*compiled_leaves)
    want = heads(*eager_leaves)
    grad = torch.randn_like(out)
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # the same kernels on the same inputs
    for g, r in zip(torch.autograd.grad(out, compiled_leaves, grad), torch.autograd.grad(want, eager_leaves, grad)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
