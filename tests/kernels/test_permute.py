"""permute / unpermute: the triton kernels against the plain-torch references, which are
themselves checked against the definitions written out as Python loops.

float32 tolerances: permute's rows are copies (exact); the sums (dx over a token's k copies,
unpermute's k weighted rows, dw's dot over D features) add the same float32 terms in another
order, within about n * 6e-8 * (sum of |terms|) for n <= 37 terms of size O(1): rtol = atol =
1e-5 is a safe bound.
"""

import pytest
import torch

from kernels import permute, permute_reference, unpermute, unpermute_reference

TOL = dict(rtol=1e-5, atol=1e-5)


def route(T, E, k, gen, allowed=None):
    """topk_idx (T, k): k distinct experts per token, drawn from `allowed` (default all E)."""
    allowed = torch.arange(E) if allowed is None else torch.tensor(allowed)
    choice = torch.rand(T, len(allowed), generator=gen).argsort(1)[:, :k]
    return allowed[choice]


# name: (T, E, k, D, experts the router may pick, None = all)
CASES = {
    "top-1": (13, 4, 1, 24, None),
    "top-2": (13, 6, 2, 37, None),
    "top-8, empty experts": (5, 16, 8, 33, [1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14]),
    "one expert takes all": (20, 5, 1, 16, [2]),
    "one token": (1, 8, 8, 16, None),
    "no tokens": (0, 4, 2, 8, None),
}


def make(case, device, dtype=torch.float32):
    T, E, k, D, allowed = CASES[case]
    gen = torch.Generator().manual_seed(T * 100 + k)
    topk_idx = route(T, E, k, gen, allowed)
    x = torch.randn(T, D, generator=gen)
    y_sorted = torch.randn(T * k, D, generator=gen)
    weights = torch.rand(T, k, generator=gen)
    grad = torch.randn(T * k, D, generator=gen)
    grad_out = torch.randn(T, D, generator=gen)
    return (E, topk_idx.to(device), x.to(device, dtype), y_sorted.to(device, dtype),
            weights.to(device), grad.to(device, dtype), grad_out.to(device, dtype))


def test_references_are_the_definitions():
    E, topk_idx, x, y_sorted, weights, _, _ = make("top-2", "cpu", torch.float64)
    weights = weights.double()
    T, k = topk_idx.shape
    # permute: assignments (t, j) listed expert by expert, tokens in order within an expert.
    order = [t * k + j for e in range(E) for t in range(T) for j in range(k) if topk_idx[t, j] == e]
    x_sorted, offsets, sorted_idx = permute_reference(x, topk_idx, E)
    assert sorted_idx.tolist() == order
    assert offsets.tolist() == [sum(int((topk_idx == e).sum()) for e in range(g + 1)) for g in range(E)]
    assert torch.equal(x_sorted, torch.stack([x[a // k] for a in order]))
    # unpermute: out[t] = sum_j w[t, j] * (the sorted row holding assignment t*k + j).
    want = torch.stack([sum(weights[t, j] * y_sorted[order.index(t * k + j)] for j in range(k))
                        for t in range(T)])
    torch.testing.assert_close(unpermute_reference(y_sorted, sorted_idx, weights), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_permute_triton_matches_reference(case, triton_device):
    E, topk_idx, x, _, _, grad, _ = make(case, triton_device)
    x.requires_grad_()
    got = permute(x, topk_idx, E, backend="triton")
    want = permute(x, topk_idx, E, backend="loop")
    assert torch.equal(got[0], want[0]), "rows are copies: exact"
    assert got[1].dtype == torch.int32 and torch.equal(got[1], want[1])
    assert got[2].dtype == torch.int64 and torch.equal(got[2], want[2])
    (dx,) = torch.autograd.grad(got[0], x, grad)
    (dx_ref,) = torch.autograd.grad(want[0], x, grad)
    torch.testing.assert_close(dx, dx_ref, **TOL)


@pytest.mark.parametrize("case", CASES)
def test_unpermute_triton_matches_reference(case, triton_device):
    E, topk_idx, _, y_sorted, weights, _, grad_out = make(case, triton_device)
    _, _, sorted_idx = permute_reference(torch.empty(len(topk_idx), 0), topk_idx.cpu(), E)
    sorted_idx = sorted_idx.to(triton_device)
    y_sorted.requires_grad_(), weights.requires_grad_()
    results = []
    for backend in ("triton", "loop"):
        out = unpermute(y_sorted, sorted_idx, weights, backend=backend)
        results.append((out, *torch.autograd.grad(out, (y_sorted, weights), grad_out)))
    for name, g, r in zip(("out", "dy_sorted", "dweights"), *results):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["triton", "loop"])
@pytest.mark.parametrize("case", ["top-1", "top-2", "top-8, empty experts"])
def test_round_trip_with_weights_one_over_k(case, backend, triton_device):
    E, topk_idx, x, *_ = make(case, triton_device)
    x_sorted, _, sorted_idx = permute(x, topk_idx, E, backend=backend)
    k = topk_idx.shape[1]
    back = unpermute(x_sorted, sorted_idx, torch.full((len(x), k), 1 / k, device=x.device), backend=backend)
    torch.testing.assert_close(back, x, rtol=1e-6, atol=1e-6)  # k terms x/k: a few ulps at most


@pytest.mark.parametrize("backend", ["triton", "loop"])
def test_only_the_real_assignments_rows(backend, triton_device):
    """The phantom group (the last, here the highest expert routed to: another rank's experts)
    sorts last; with n_rows = the real assignments, permute makes only their rows, and unpermute
    and every gradient equal the full computation with the phantom rows' outputs zero (their
    weights need not be 0)."""
    _, topk_idx, x, _, weights, _, grad_out = make("top-8, empty experts", triton_device)
    E = int(topk_idx.max()) + 1  # groups; E - 1 the phantom
    n_real = int((topk_idx < E - 1).sum())
    assert 0 < n_real < topk_idx.numel()
    x, weights = x.requires_grad_(), weights.requires_grad_()
    full, offsets, sorted_idx = permute(x, topk_idx, E, backend=backend)
    part, offsets_p, sorted_idx_p = permute(x, topk_idx, E, backend=backend, n_rows=n_real)
    assert part.shape == (n_real, x.shape[1]) and torch.equal(part, full[:n_real])
    assert torch.equal(offsets, offsets_p) and torch.equal(sorted_idx, sorted_idx_p)
    assert int(offsets[E - 2]) == n_real
    y_part = part * 2.0  # stands in for the experts: any function of the rows made
    y_full = torch.cat([full[:n_real] * 2.0, torch.zeros_like(full[n_real:])])
    got = unpermute(y_part, sorted_idx, weights, backend=backend)
    want = unpermute(y_full, sorted_idx, weights, backend=backend)
    torch.testing.assert_close(got, want, **TOL)
    grads = torch.autograd.grad(got, (x, weights), grad_out)
    grads_ref = torch.autograd.grad(want, (x, weights), grad_out)
    for name, g, r in zip(("dx", "dweights"), grads, grads_ref):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="n_rows"):
        permute(x, topk_idx, E, backend=backend, n_rows=topk_idx.numel() + 1)


def test_argument_checks():
    E, topk_idx, x, y_sorted, weights, _, _ = make("top-2", "cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        permute(x, topk_idx, E, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        unpermute(y_sorted, topk_idx.reshape(-1), weights, backend="cuda")
    with pytest.raises(ValueError, match=r"need x \(T, D\) and topk_idx \(T, k\)"):
        permute(x[:-1], topk_idx, E)
    with pytest.raises(ValueError, match=r"need y_sorted \(n <= T\*k, D\)"):
        unpermute(torch.cat([y_sorted, y_sorted[:1]]), topk_idx.reshape(-1), weights)


# bf16 tolerances: permute copies (exact). unpermute sums in float32 and rounds each output
# once to bf16 (<= 2^-9 relative per entry, so < 5e-3 in norm); dy_sorted = w * dout is one
# product rounded to bf16 (same bound); dweights stay float32 (weights are float32), sums of
# exact products of bf16 values: float32 order noise only, < 1e-5.
@pytest.mark.gpu
def test_bf16_on_gpu(gpu_device, rel_err):
    T, E, k, D = 700, 64, 8, 520
    gen = torch.Generator().manual_seed(0)
    topk_idx = route(T, E, k, gen, allowed=list(range(0, 64, 3))).to(gpu_device)  # 2/3 of experts empty
    x = torch.randn(T, D, generator=gen).to(gpu_device, torch.bfloat16).requires_grad_()
    weights = torch.rand(T, k, generator=gen).to(gpu_device).requires_grad_()
    x_sorted, offsets, sorted_idx = permute(x, topk_idx, E)
    want = permute_reference(x, topk_idx, E)
    assert all(torch.equal(g, r) for g, r in zip((x_sorted, offsets, sorted_idx), want))
    out = unpermute(x_sorted, sorted_idx, weights)
    grad_out = torch.randn(T, D, generator=gen).to(gpu_device, torch.bfloat16)
    dx, dweights = torch.autograd.grad(out, (x, weights), grad_out)
    xf = x.detach().float().requires_grad_()
    wf = weights.detach().clone().requires_grad_()
    out_ref = unpermute_reference(permute_reference(xf, topk_idx, E)[0], sorted_idx, wf)
    dx_ref, dw_ref = torch.autograd.grad(out_ref, (xf, wf), grad_out.float())
    assert out.dtype == torch.bfloat16 and rel_err(out, out_ref) < 5e-3
    assert rel_err(dx, dx_ref) < 5e-3
    assert dweights.dtype == torch.float32 and rel_err(dweights, dw_ref) < 1e-5
