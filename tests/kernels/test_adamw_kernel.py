"""adamw_step_ (Triton) and its torch reference against torch.optim.AdamW; squared_norm.

float32 tolerance 1e-6 over 10 steps: the kernel does the same IEEE operations as torch's
single-tensor AdamW (division and square root rounded to nearest), in another order in places
(beta1 * m + (1 - beta1) * g instead of lerp, float32 scalars from float64 host arithmetic):
a few ulps (~1e-7 relative) per step on values of order 1, which 10 steps keep well under 1e-6.
The reference does torch's exact operations, so it is compared at 0 tolerance. The bf16 copy is
compared bit for bit with param.to(bfloat16) (round to nearest even).
"""

import pytest
import torch

from optimus_kernels import adamw_step_, adamw_step_reference_, squared_norm, squared_norm_reference

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)  # a large lr: the update moves p visibly


def make(n, device, seed=0):
    gen = torch.Generator().manual_seed(seed + n)
    p = torch.randn(n, generator=gen).to(device)
    grads = [torch.randn(n, generator=gen).to(device) * 3 for _ in range(10)]
    return p, grads


def run_ours(fn, p0, grads, weight_decay, scales=None, bf16=False):
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    copies = []
    for step, g in enumerate(grads, 1):
        p16 = torch.empty_like(p, dtype=torch.bfloat16) if bf16 else None
        g_before = g.clone()
        fn(p, g, m, v, **HYPER, weight_decay=weight_decay, step=step,
           grad_scale=None if scales is None else scales[step - 1], param_bf16_N=p16)
        assert torch.equal(g, g_before)  # the gradient is read, never written
        copies.append((p.clone(), p16))
    return p, m, v, copies


def run_torch(p0, grads, weight_decay, scales=None):
    """torch.optim.AdamW on one flat tensor; grad_scale as the division it stands for."""
    p = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([p], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=weight_decay, foreach=False)
    for i, g in enumerate(grads):
        p.grad = g.clone() if scales is None else g / scales[i]
        opt.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"]


LENGTHS = [1, 1000, 4097]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_triton_matches_torch_adamw(n, weight_decay, triton_device):
    p0, grads = make(n, triton_device)
    want = run_torch(p0.cpu(), [g.cpu() for g in grads], weight_decay)
    got = run_ours(adamw_step_, p0, grads, weight_decay)[:3]
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert not torch.equal(got[0].cpu(), p0.cpu())  # it did move


@pytest.mark.parametrize("n", LENGTHS)
def test_grad_scale_divides_the_gradient(n, triton_device):
    p0, grads = make(n, triton_device, seed=1)
    # 1 (no clip) and factors a clip produces; the scale is read on the device, per step
    scales = [torch.tensor(s, device=triton_device) for s in (1.0, 2.5, 7.0, 1.0, 3.3, 1.1, 40.0, 1.0, 2.0, 5.0)]
    want = run_torch(p0.cpu(), [g.cpu() for g in grads], 0.1, [s.cpu() for s in scales])
    got = run_ours(adamw_step_, p0, grads, 0.1, scales)[:3]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-6)
    unscaled = run_ours(adamw_step_, p0, grads, 0.1)[0]
    if n > 1:  # the scale changed the trajectory (at n=1 Adam's normalisation may hide it)
        assert (unscaled - got[0]).abs().max() > 1e-5


@pytest.mark.parametrize("n", LENGTHS)
def test_bf16_copy_is_the_rounded_param(n, triton_device):
    p0, grads = make(n, triton_device, seed=2)
    p, _, _, copies = run_ours(adamw_step_, p0, grads, 0.1, bf16=True)
    plain = run_ours(adamw_step_, p0, grads, 0.1)[0]
    assert torch.equal(p, plain)  # writing the copy does not change the update
    for param, p16 in copies:
        assert p16.dtype == torch.bfloat16
        assert torch.equal(p16.view(torch.int16), param.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("n", LENGTHS)
def test_bf16_gradient_is_read_as_float32(n, triton_device):
    """A bf16 gradient (the experts', the execution plan's bf16_expert_grads) updates exactly as its float32
    value does: the kernel widens it on load, with and without a clip factor."""
    p0, grads = make(n, triton_device, seed=5)
    grads16 = [g.to(torch.bfloat16) for g in grads]
    scales = [torch.tensor(1.0 + i, device=triton_device) for i in range(10)]
    for fn in (adamw_step_, adamw_step_reference_):
        for s in (None, scales):
            got = run_ours(fn, p0, grads16, 0.1, s, bf16=True)
            want = run_ours(fn, p0, [g.float() for g in grads16], 0.1, s, bf16=True)
            for a, b in zip(got[:3], want[:3]):
                assert torch.equal(a, b)
            assert torch.equal(got[3][-1][1], want[3][-1][1])


def test_bf16_rounding_ties_and_specials(triton_device):
    """Round to nearest even on the exact tie values and past the largest finite bf16, where a
    truncating cast differs: lr = weight_decay = 0 and a zero grad leave p as it was."""
    one = 1.0 + 2.0 ** -8  # halfway between two bf16 values: ties to even (down)
    three = 1.0 + 3 * 2.0 ** -8  # halfway: ties to even (up)
    vals = torch.tensor([one, three, -three, 1.0 + 2.0 ** -9 + 2.0 ** -20, 3.3e38, float("inf"),
                         -float("inf"), 0.0, -0.0, 1e-40, 65504.0])
    p = vals.to(triton_device)
    p16 = torch.empty_like(p, dtype=torch.bfloat16)
    zero = torch.zeros_like(p)
    adamw_step_(p, zero, zero.clone(), zero.clone(), lr=0.0, beta1=0.9, beta2=0.95, eps=1e-8,
                weight_decay=0.0, step=1, param_bf16_N=p16)
    assert torch.equal(p.cpu(), vals)
    assert torch.equal(p16.cpu().view(torch.int16), vals.to(torch.bfloat16).view(torch.int16))
    nan = torch.full((3,), float("nan"), device=triton_device)
    nan16 = torch.zeros(3, dtype=torch.bfloat16, device=triton_device)
    z = torch.zeros_like(nan)
    adamw_step_(nan, z, z.clone(), z.clone(), lr=0.0, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                step=1, param_bf16_N=nan16)
    assert nan16.isnan().all()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_reference_is_torch_adamw(weight_decay):
    p0, grads = make(1001, "cpu", seed=3)
    scales = [torch.tensor(1.0 + i) for i in range(10)]
    for s in (None, scales):
        want = run_torch(p0, grads, weight_decay, s)
        p, m, v, copies = run_ours(adamw_step_reference_, p0, grads, weight_decay, s, bf16=True)
        for a, b in zip((p, m, v), want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert torch.equal(copies[-1][1], p.to(torch.bfloat16))


def test_launch_ranges_split_off_the_ragged_tail():
    """The vectorized launch covers a multiple of 16 elements, the second the rest (see _ranges)."""
    from optimus_kernels.adamw import _ranges

    assert _ranges(4097, 128) == [(0, 4096, 32), (4096, 4097, 1)]
    assert _ranges(1000, 128) == [(0, 992, 8), (992, 1000, 1)]
    assert _ranges(1, 128) == [(0, 1, 1)]
    assert _ranges(4096, 1024) == [(0, 4096, 4)]
    assert _ranges(0, 128) == []


@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_writes_stay_inside_the_buffers(n, triton_device):
    """Buffers that are views into larger ones (a sharded parameter's padded local share): nothing past n changes."""
    big = [torch.full((n + 300,), 7.0, device=triton_device) for _ in range(4)]
    big16 = torch.full((n + 300,), 7.0, device=triton_device, dtype=torch.bfloat16)
    p, g, m, v = (b[:n] for b in big)
    g.fill_(0.5)
    adamw_step_(p, g, m, v, **HYPER, weight_decay=0.1, step=1, param_bf16_N=big16[:n])
    assert all((b[n:] == 7.0).all() for b in big) and (big16[n:] == 7.0).all()
    assert (p != 7.0).all() and (big16[:n] != 7.0).all()


def test_empty_buffers_are_a_no_op(triton_device):
    e = torch.empty(0, device=triton_device)
    adamw_step_(e, e.clone(), e.clone(), e.clone(), **HYPER, weight_decay=0.1, step=1)
    assert squared_norm(e).item() == 0.0


@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_squared_norm(n, triton_device):
    x = make(n, triton_device, seed=4)[0] * 5
    got = squared_norm(x)
    assert got.dtype == torch.float64 and got.dim() == 0
    want = x.double().square().sum()  # exact up to float64 rounding
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-6, atol=0)
    torch.testing.assert_close(squared_norm_reference(x).cpu(), want.cpu(), rtol=1e-6, atol=0)


# ---------------------------------------------------------------- errors
def bufs(n=8, **changes):
    out = dict(param_N=torch.zeros(n), grad_N=torch.zeros(n), exp_avg_N=torch.zeros(n), exp_avg_sq_N=torch.zeros(n))
    out.update(changes)
    return out


ARGS = dict(**HYPER, weight_decay=0.1, step=1)

BAD_BUFFERS = [
    (dict(grad_N=torch.zeros(9)), "equal lengths"),
    (dict(exp_avg_N=torch.zeros(8, dtype=torch.float64)), "exp_avg_N must be a 1-D contiguous float32"),
    (dict(param_N=torch.zeros(8, dtype=torch.bfloat16)), "param_N must be a 1-D contiguous float32 tensor"),
    (dict(grad_N=torch.zeros(8, dtype=torch.float16)), "grad_N must be a 1-D contiguous float32 or bfloat16"),
    (dict(exp_avg_sq_N=torch.zeros(2, 4)), r"exp_avg_sq_N must be a 1-D .* shape \(2, 4\)"),
    (dict(grad_N=torch.zeros(16)[::2]), r"grad_N must be a 1-D contiguous float32 .* \(strided\)"),
    (dict(grad_N=[0.0] * 8), "grad_N must be a tensor"),
    (dict(param_N=torch.zeros(8, device="meta")), "all tensors must be on one device"),
]


@pytest.mark.parametrize("fn", [adamw_step_, adamw_step_reference_])
@pytest.mark.parametrize("changes,match", BAD_BUFFERS)
def test_bad_buffers(fn, changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fn(**bufs(**changes), **ARGS)


@pytest.mark.parametrize("fn", [adamw_step_, adamw_step_reference_])
@pytest.mark.parametrize("extra,match", [
    (dict(grad_scale=torch.tensor([2.0])), "grad_scale must be a 0-d float32"),
    (dict(grad_scale=torch.tensor(2.0, dtype=torch.float64)), "grad_scale must be a 0-d float32"),
    (dict(grad_scale=2.0), "grad_scale must be a 0-d float32"),
    (dict(grad_scale=torch.tensor(2.0, device="meta")), "all tensors must be on one device"),
    (dict(param_bf16_N=torch.zeros(8)), "param_bf16_N must be a 1-D contiguous bfloat16"),
    (dict(param_bf16_N=torch.zeros(7, dtype=torch.bfloat16)), "equal lengths"),
])
def test_bad_optional_tensors(fn, extra, match):
    with pytest.raises(ValueError, match=match):
        fn(**bufs(), **ARGS, **extra)


@pytest.mark.parametrize("fn", [adamw_step_, adamw_step_reference_])
@pytest.mark.parametrize("changes,match", [
    (dict(step=0), "step must be a host int >= 1"),
    (dict(step=torch.tensor(3)), "step must be a host int"),
    (dict(step=2.0), "step must be a host int"),
    (dict(lr=torch.tensor(1e-3)), "lr must be a host float"),
    (dict(beta2=1.0), r"betas must lie in \[0, 1\)"),
    (dict(eps=-1.0), "must be >= 0"),
])
def test_bad_hyperparameters(fn, changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fn(**bufs(), **{**ARGS, **changes})


def test_shared_param_and_grad_is_refused():
    p = torch.zeros(8)
    with pytest.raises(ValueError, match="share memory"):
        adamw_step_reference_(p, p, torch.zeros(8), torch.zeros(8), **ARGS)


def test_squared_norm_argument_check():
    with pytest.raises(ValueError, match="1-D contiguous float32"):
        squared_norm(torch.zeros(2, 3))


# ---------------------------------------------------------------- natively compiled
@pytest.mark.gpu
def test_native_kernel_on_gpu(gpu_device):
    """Compiled on the GPU (tuning included: lengths past TUNE_MIN), against torch's own
    single-tensor AdamW on the same device, with grad_scale and the bf16 copy."""
    n = (1 << 20) + 3  # past the tuning threshold, ragged tail
    p0, grads = make(n, gpu_device, seed=5)
    scales = [torch.tensor(1.0 + (i % 3), device=gpu_device) for i in range(10)]
    want = run_torch(p0, grads, 0.1, scales)
    p, m, v, copies = run_ours(adamw_step_, p0, grads, 0.1, scales, bf16=True)
    for a, b in zip((p, m, v), want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(copies[-1][1].view(torch.int16), p.to(torch.bfloat16).view(torch.int16))
    x = grads[0]
    torch.testing.assert_close(squared_norm(x), x.double().square().sum(), rtol=1e-6, atol=0)
