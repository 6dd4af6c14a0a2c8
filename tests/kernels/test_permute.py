"""permute / unpermute: the triton kernels against the plain-torch references, which are
themselves checked against the definitions written out as Python loops.

float32 tolerances: permute's rows are copies (exact); the sums (dx over a token's k copies,
unpermute's k weighted rows, dw's dot over D features) add the same float32 terms in another
order, within about n * 6e-8 * (sum of |terms|) for n <= 37 terms of size O(1): rtol = atol =
1e-5 is a safe bound.
"""

import importlib

import pytest
import torch

from optimus_kernels import permute, permute_reference, unpermute, unpermute_reference
from optimus_kernels.permute import MAX_SORT_GROUPS, counting_sort_applies, expert_sort, sort_geometry

permute_module = importlib.import_module("optimus_kernels.permute")  # the package's `permute` is the function

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
    "many sort blocks": (300, 7, 2, 9, None),  # 600 assignments: 3 programs of 2 chunks (interpreter)
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


@pytest.mark.parametrize("case", CASES)
def test_unweighted_unpermute_is_the_combine_with_unit_weights(case, triton_device):
    """topk_weights None: the plain sum over each token's k rows, and dy_sorted the gather of
    dout; the same as unit weights (without their gradient), by either backend; also with only
    the first rows made (permute's n_rows)."""
    E, topk_idx, _, y_sorted, _, _, grad_out = make(case, triton_device)
    _, _, sorted_idx = permute_reference(torch.empty(len(topk_idx), 0), topk_idx.cpu(), E)
    sorted_idx = sorted_idx.to(triton_device)
    k = topk_idx.shape[1]
    ones = torch.ones(len(topk_idx), k, device=triton_device)
    for rows in (len(y_sorted), len(y_sorted) // 2):
        y = y_sorted[:rows].clone().requires_grad_()
        want = unpermute(y, sorted_idx, ones, backend="loop")
        (dy_want,) = torch.autograd.grad(want, y, grad_out)
        for backend in ("triton", "loop"):
            got = unpermute(y, sorted_idx, None, top_k=k, backend=backend)
            (dy,) = torch.autograd.grad(got, y, grad_out)
            torch.testing.assert_close(got, want, **TOL)
            torch.testing.assert_close(dy, dy_want, **TOL)


def test_unweighted_unpermute_checks_top_k():
    _, topk_idx, _, y_sorted, _, _, _ = make("top-2", "cpu")
    with pytest.raises(ValueError, match="without topk_weights, top_k must be given"):
        unpermute(y_sorted, topk_idx.reshape(-1), None)
    with pytest.raises(ValueError, match="top_k must be given and divide"):
        unpermute(y_sorted, topk_idx.reshape(-1)[:-1], None, top_k=2)


def test_unpermute_sum_opcheck(triton_device):
    E, topk_idx, _, y_sorted, _, _, _ = make("top-2", triton_device)
    _, _, sorted_idx = permute_reference(torch.empty(len(topk_idx), 0), topk_idx.cpu(), E)
    torch.library.opcheck(torch.ops.optimus.unpermute_sum, (y_sorted, sorted_idx.to(triton_device), 2))


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


def torch_sorted(ids, G):
    """What the counting sort must equal: torch's stable sort and the group ends."""
    sorted_ids, sorted_idx = torch.sort(ids.cpu(), stable=True)
    return sorted_idx, torch.searchsorted(sorted_ids, torch.arange(G), right=True, out_int32=True)


# name: (R assignments, G groups, how the ids are drawn, (BLOCK, CHUNK) or None for the default)
SORTS = {
    "uniform": (70, 5, "uniform", None),
    "one program, several chunks": (70, 5, "uniform", (72, 4)),
    "block = one chunk (18 blocks: a 3-step scan)": (70, 5, "uniform", (4, 4)),
    "blocks off the grid": (101, 9, "uniform", (12, 4)),
    "one scan step exactly (8 blocks)": (64, 3, "uniform", (8, 8)),
    "one group takes all": (40, 6, "one", (8, 4)),
    "most groups empty": (90, 20, "few", (16, 8)),
    "skewed, phantom group last": (120, 65, "phantom", (8, 4)),  # 64 experts + dropped assignments
    "one group": (33, 1, "uniform", (8, 2)),
    "group count not a power of two": (64, 17, "uniform", (16, 16)),
    "most groups the counting sort takes": (50, MAX_SORT_GROUPS, "uniform", None),
    "one assignment": (1, 3, "uniform", None),
    "no assignments": (0, 4, "uniform", None),
}


def draw(R, G, how, gen):
    if how == "one":
        return torch.full((R,), G // 2)
    if how == "few":
        return torch.tensor([3, 11, 12])[torch.randint(0, 3, (R,), generator=gen)]
    if how == "phantom":  # Zipf-like over the experts, a quarter of the ids in group G - 1
        ids = torch.multinomial(1 / torch.arange(1, G).double(), R, replacement=True, generator=gen)
        return torch.where(torch.rand(R, generator=gen) < 0.25, G - 1, ids)
    return torch.randint(0, G, (R,), generator=gen)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("case", SORTS)
def test_counting_sort_is_torchs_stable_sort(case, dtype, triton_device):
    """The counting sort's sorted_idx and offsets equal torch.sort(stable=True)'s and the
    searchsorted group ends exactly, at the default geometry and at blocks that put one chunk,
    several chunks or a partial chunk in a program."""
    R, G, how, shape = SORTS[case]
    block, chunk = shape or (None, None)
    ids = draw(R, G, how, torch.Generator().manual_seed(R + G)).to(triton_device, dtype)
    sorted_idx, offsets = permute_module._launch_expert_sort(ids, G, block, chunk)
    want_idx, want_offsets = torch_sorted(ids, G)
    assert sorted_idx.dtype == torch.int64 and torch.equal(sorted_idx.cpu(), want_idx)
    assert offsets.dtype == torch.int32 and torch.equal(offsets.cpu(), want_offsets)


def test_sort_geometry():
    """Blocks are whole chunks and cover every assignment; overrides are checked. (The
    interpreter's scan steps are 8 entries, so the SORTS cases with 9+ blocks scan in steps.)"""
    for R in (1, 5, 100, 65536, 262144):
        for G in (1, 64, 65, 257, MAX_SORT_GROUPS):
            g = sort_geometry(R, G)
            assert g["GP"] >= max(G, 16) and g["GP"] & (g["GP"] - 1) == 0
            assert g["BLOCK"] % g["CHUNK"] == 0 and (g["NB"] - 1) * g["BLOCK"] < R <= g["NB"] * g["BLOCK"]
            assert g["WARPS"] >= 1 and g["SCAN"] & (g["SCAN"] - 1) == 0
    assert sort_geometry(0, 4)["NB"] == 0
    g = sort_geometry(100, 9, block=12, chunk=4)
    assert (g["GP"], g["CHUNK"], g["BLOCK"], g["NB"]) == (16, 4, 12, 9)
    with pytest.raises(ValueError, match="multiple of the chunk"):
        sort_geometry(100, 9, block=10, chunk=4)
    with pytest.raises(ValueError, match="power of two"):
        sort_geometry(100, 9, chunk=12)


@pytest.mark.parametrize("counting, groups, counting_runs", [
    (True, 5, True),
    (True, MAX_SORT_GROUPS, True),
    (True, MAX_SORT_GROUPS + 1, False),  # past the counting sort's limit: torch.sort
    (False, 5, False),  # the private switch: torch.sort where the counting sort applies
])
def test_sort_choice(counting, groups, counting_runs, monkeypatch, triton_device):
    """The counting sort runs where it applies, torch.sort elsewhere (past MAX_SORT_GROUPS,
    or with counting=False). Either way the result is the stable sort."""
    calls = []
    launch = permute_module._launch_expert_sort
    monkeypatch.setattr(permute_module, "_launch_expert_sort", lambda *a: calls.append(1) or launch(*a))
    ids = draw(45, groups, "uniform", torch.Generator().manual_seed(1)).to(triton_device)
    counting_runs = counting_runs and triton_device.type != "xpu"  # not tried on Intel GPUs
    assert counting_sort_applies(ids, groups) == (groups <= MAX_SORT_GROUPS and triton_device.type != "xpu")
    sorted_idx, offsets = expert_sort(ids, groups, counting=counting)
    assert bool(calls) == counting_runs
    want_idx, want_offsets = torch_sorted(ids, groups)
    assert torch.equal(sorted_idx.cpu(), want_idx) and torch.equal(offsets.cpu(), want_offsets)


def test_expert_sort_opcheck(triton_device):
    """The counting sort's custom op: schema, fake tensors (torch.compile), AOT dispatch."""
    ids = draw(37, 6, "uniform", torch.Generator().manual_seed(2)).to(triton_device)
    torch.library.opcheck(torch.ops.optimus.expert_sort, (ids, 6))
    torch.library.opcheck(torch.ops.optimus.expert_sort, (ids[:0], 6))


@pytest.mark.parametrize("counting", [True, False], ids=["counting", "torch"])
@pytest.mark.parametrize("case", CASES)
def test_expert_sort_of_routed_ids_is_the_references(case, counting, triton_device):
    """Both sorts on the routings of CASES (empty experts, no tokens, one expert): the
    reference's sorted_idx and offsets exactly, which is all permute takes from the sort."""
    E, topk_idx, x, _, _, _, _ = make(case, triton_device)
    _, want_offsets, want_idx = permute_reference(x, topk_idx, E)
    sorted_idx, offsets = expert_sort(topk_idx.reshape(-1), E, counting=counting)
    assert sorted_idx.dtype == torch.int64 and torch.equal(sorted_idx, want_idx)
    assert offsets.dtype == torch.int32 and torch.equal(offsets, want_offsets)


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


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [8192, 32768])
@pytest.mark.parametrize("groups", [64, 65, 257])
def test_counting_sort_on_gpu(tokens, groups, gpu_device):
    """The compiled counting sort at the benchmark's sizes (top-8, its default geometry: many
    programs, full chunks) equals torch's stable sort, Zipf-skewed with a phantom group."""
    ids = draw(tokens * 8, groups, "phantom", torch.Generator().manual_seed(groups)).to(gpu_device)
    sorted_idx, offsets = permute_module._launch_expert_sort(ids, groups)
    want_idx, want_offsets = torch_sorted(ids, groups)
    assert torch.equal(sorted_idx.cpu(), want_idx) and torch.equal(offsets.cpu(), want_offsets)


def test_reference_backward_is_bit_identical_run_to_run_on_threads():
    """A token's k copies are summed in a fixed order in the backward, whatever the threads do:
    with x[sorted_idx // k] (index_put_ with accumulate) 20 of 20 repeats differed on 2 threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        x = torch.randn(512, 64, requires_grad=True)
        topk_idx = torch.randint(0, 16, (512, 8))
        weights = torch.rand(512, 8)
        dout = torch.randn(512, 64)

        def grad():
            x.grad = None
            x_sorted, _, sorted_idx = permute_reference(x, topk_idx, 16)
            unpermute_reference(x_sorted * 1.5, sorted_idx, weights).backward(dout)
            return x.grad.clone()

        first = grad()
        assert all(torch.equal(grad(), first) for _ in range(20))
    finally:
        torch.set_num_threads(threads)
