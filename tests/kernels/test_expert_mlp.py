"""expert_mlp: the fused up projection + SwiGLU + down projection against the unfused ops.

The fused kernels round what they compute where the unfused ops store it (h and d(out) in
the inputs' dtype), so in float32 the output and every gradient but the row weights' equal the
unfused triton path bit for bit; row_weight's gradient adds per-tile partial sums (float32,
O(1) terms, at most a few dozen): within 1e-5 of the unfused row sums. Against the float32
loop reference, grouped_mm's tolerance (tests/kernels/test_grouped_mm.py) applies.
"""

import pytest
import torch

from kernels import grouped_mm, swiglu
from kernels.expert_mlp import expert_mlp, expert_mlp_reference, expert_mlp_unsupported
from kernels.grouped_mm_tma import tma_unsupported

# name: (rows per group, rows past offsets[-1], D, F). The interpreter's tiles are 16 x 16 x 16:
# D and F off them (a partial K block, a column tile running past F into up's columns).
CASES = {
    "one group": ([37], 0, 24, 20),
    "empty groups and a tail": ([0, 17, 0, 30], 5, 24, 12),
    "ragged": ([3, 0, 21, 1, 16, 9, 0, 14], 0, 40, 36),
    "block-aligned": ([16, 32], 0, 32, 16),
    "all rows past the end": ([0, 0], 12, 16, 16),
    "no rows": ([0, 0, 0], 0, 8, 8),
}


def make(sizes, tail, D, F, device, dtype=torch.float32, seed=0):
    """x, w_up, w_down, offsets, row_weight, dy: the rows past offsets[-1] carry NaN in x and dy
    and weight 0 (as dropped assignments do), which must never leak."""
    gen = torch.Generator().manual_seed(seed)
    M, E = sum(sizes) + tail, len(sizes)
    x = torch.randn(M, D, generator=gen)
    x[M - tail:] = float("nan")
    w_up = torch.randn(E, D, 2 * F, generator=gen) / D**0.5
    w_down = torch.randn(E, F, D, generator=gen) / F**0.5
    row_weight = torch.rand(M, generator=gen)
    row_weight[M - tail:] = 0
    dy = torch.randn(M, D, generator=gen)
    dy[M - tail:] = float("nan")
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x, w_up, w_down, row_weight = (t.to(device, dtype).requires_grad_() for t in (x, w_up, w_down, row_weight))
    return x, w_up, w_down, offsets.to(device), row_weight, dy.to(device, dtype)


def unfused(x, w_up, w_down, offsets, row_weight, backend="triton"):
    h = swiglu(grouped_mm(x, w_up, offsets, backend=backend), row_weight=row_weight, backend=backend)
    return grouped_mm(h, w_down, offsets, backend=backend)


def forward_backward(fn, x, w_up, w_down, offsets, row_weight, dy):
    y = fn(x, w_up, w_down, offsets, row_weight)
    return (y, *torch.autograd.grad(y, (x, w_up, w_down, row_weight), dy))


NAMES = ("y", "dx", "dw_up", "dw_down", "drow_weight")


@pytest.mark.parametrize("case", CASES)
def test_fused_equals_the_unfused_ops(case, triton_device):
    x, w_up, w_down, offsets, rw, dy = make(*CASES[case], triton_device)
    assert expert_mlp_unsupported(x, w_up, w_down) is None
    got = forward_backward(expert_mlp, x, w_up, w_down, offsets, rw, dy)
    want = forward_backward(unfused, x, w_up, w_down, offsets, rw, dy)
    for name, g, r in zip(NAMES[:-1], got, want):
        assert torch.equal(g, r), f"{name}: differs from the unfused ops by {(g - r).abs().max().item()}"
    torch.testing.assert_close(got[-1], want[-1], rtol=1e-5, atol=1e-5)
    reference = forward_backward(lambda *a: expert_mlp_reference(*a), x, w_up, w_down, offsets, rw, dy)
    for name, g, r in zip(NAMES, got, reference):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} against the loop: {m}")
    M, tail = x.shape[0], CASES[case][1]
    for name, t in zip(("y", "dx", "drow_weight"), (got[0], got[1], got[4])):
        assert torch.equal(t[M - tail:], torch.zeros_like(t[M - tail:])), f"{name}: rows past offsets[-1] must be 0"


def test_random_routings(triton_device):
    gen = torch.Generator().manual_seed(3)
    for seed in range(3):
        E = int(torch.randint(1, 6, (1,), generator=gen))
        sizes = (torch.randint(0, 30, (E,), generator=gen) * (torch.rand(E, generator=gen) > 0.3)).tolist()
        tail = int(torch.randint(0, 4, (1,), generator=gen))
        x, w_up, w_down, offsets, rw, dy = make(sizes, tail, 20, 28, triton_device, seed=seed)
        got = forward_backward(expert_mlp, x, w_up, w_down, offsets, rw, dy)
        want = forward_backward(unfused, x, w_up, w_down, offsets, rw, dy)
        for name, g, r in zip(NAMES, got, want):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{sizes} tail {tail} {name}: {m}")


def test_only_the_gradients_asked_for(triton_device):
    """A frozen input gets no gradient and costs no kernel: x alone, the weights alone."""
    x, w_up, w_down, offsets, rw, dy = make([9, 14], 2, 16, 12, triton_device)
    want = forward_backward(unfused, x, w_up, w_down, offsets, rw, dy)
    (dx,) = torch.autograd.grad(expert_mlp(x, w_up, w_down, offsets, rw), (x,), dy)
    assert torch.equal(dx, want[1])
    dw_up, dw_down = torch.autograd.grad(expert_mlp(x, w_up, w_down, offsets, rw), (w_up, w_down), dy)
    assert torch.equal(dw_up, want[2]) and torch.equal(dw_down, want[3])


def test_squares_are_the_weights_gradients_squared(triton_device):
    x, w_up, w_down, offsets, rw, dy = make([11, 0, 20], 3, 16, 20, triton_device)
    up_sq, down_sq = (torch.zeros((), device=triton_device, requires_grad=True) for _ in range(2))
    y = expert_mlp(x, w_up, w_down, offsets, rw, up_square=up_sq, down_square=down_sq)
    dw_up, dw_down, g_up, g_down = torch.autograd.grad(y, (w_up, w_down, up_sq, down_sq), dy)
    torch.testing.assert_close(g_up, dw_up.square().sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(g_down, dw_down.square().sum(), rtol=1e-5, atol=0)


def test_what_it_refuses():
    x, w_up, w_down, offsets, rw, _ = make([4, 4], 0, 16, 8, "cpu")
    assert "x's dtype" in expert_mlp_unsupported(x, w_up.double(), w_down)
    assert "shapes" in expert_mlp_unsupported(x, w_up[:, :, :-1], w_down)
    assert "shapes" in expert_mlp_unsupported(x, w_up, w_down[:, :3])
    assert expert_mlp_unsupported(x, w_up, w_down) is None
    with pytest.raises(ValueError, match="use kernels.grouped_mm and kernels.swiglu"):
        expert_mlp(x, w_up.double(), w_down, offsets, rw)
    with pytest.raises(ValueError, match="offsets must be int32"):
        expert_mlp(x, w_up, w_down, offsets.long(), rw)
    with pytest.raises(ValueError, match="row_weight must be"):
        expert_mlp(x, w_up, w_down, offsets, rw[:-1])


def test_unfused_kernels_where_tma_cannot_run(triton_device):
    """Rows TMA cannot address (x starting 4 bytes into its storage): the op computes the same
    values with the unfused kernels, forward and backward."""
    x, w_up, w_down, offsets, rw, dy = make([13, 0, 9], 2, 16, 12, triton_device)
    shifted = torch.empty(x.numel() + 1, device=triton_device)[1:].view_as(x).copy_(x).requires_grad_()
    assert tma_unsupported(shifted, w_up, shifted) is not None
    got = forward_backward(expert_mlp, shifted, w_up, w_down, offsets, rw, dy)
    want = forward_backward(unfused, shifted, w_up, w_down, offsets, rw, dy)
    for name, g, r in zip(NAMES, got, want):
        assert torch.equal(g, r), name


# bf16 on the GPU: every output within the unfused path's own rounding of the float64 loop.
@pytest.mark.gpu
@pytest.mark.parametrize("sizes,D,F", [([300, 0, 517, 64, 1000], 256, 136), ([4096] * 8, 2048, 1024)])
def test_bf16_on_gpu(sizes, D, F, gpu_device, rel_err):
    x, w_up, w_down, offsets, rw, dy = make(sizes, 7, D, F, gpu_device, torch.bfloat16)
    got = forward_backward(expert_mlp, x, w_up, w_down, offsets, rw, dy)
    want = forward_backward(unfused, x, w_up, w_down, offsets, rw, dy)
    leaves64 = [t.detach().double().requires_grad_() for t in (x, w_up, w_down, rw)]
    exact = forward_backward(lambda *a: expert_mlp_reference(*a), *leaves64[:3], offsets, leaves64[3], dy.double())
    M = x.shape[0] - 7
    for name, g, u, r in zip(NAMES, got, want, exact):
        g, u, r = (t[:M] if name in ("y", "dx", "drow_weight") else t for t in (g, u, r))
        if name in ("y", "dx", "dw_up", "dw_down"):
            assert torch.equal(g, u), f"{name}: the fused kernels must round as the unfused ops"
        assert rel_err(g, r) < max(2 * rel_err(u, r), 1e-3), f"{name}: {rel_err(g, r)} vs unfused {rel_err(u, r)}"
