"""The MoE layer through each kernels backend: same training run as the loop reference."""
import pytest
import torch

import optimus_kernels
from optimus_core.config import ModelConfig, MoEConfig, OptimConfig
from optimus_core.execution import use_kernels
from optimus_core.model.transformer import Transformer
from optimus_core.train.optim import build_optimizer
from optimus_core.train.step import train_step

# These runs are on the CPU in float32, so the triton backend needs the interpreter here even on a
# machine with a GPU (bf16 on the GPU: tests/kernels and the gpu-marked tests of optimus_core).
needs_triton = pytest.mark.skipif(not (optimus_kernels.INTERPRET and optimus_kernels.triton),
                                  reason="the triton backend on CPU tensors needs TRITON_INTERPRET=1")


def losses(backend: str, capacity=None, steps=3):
    moe = MoEConfig(n_experts=6, top_k=2, d_expert=8, capacity_factor=capacity)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, max_seq_len=16, moe=moe)
    model = use_kernels(Transformer(cfg), experts=backend)
    model.init_weights(seed=0)
    opt = build_optimizer(model, OptimConfig(lr=1e-2))
    batch = torch.randint(0, 40, (4, 10), generator=torch.Generator().manual_seed(1))
    return [train_step(model, opt, batch, micro_batch=0, grad_clip=1.0, lr=1e-2, dtype="float32").loss
            for _ in range(steps)]


@needs_triton
@pytest.mark.parametrize("capacity", [None, 0.5], ids=["dropless", "capacity-0.5"])
def test_triton_training_matches_loop(capacity):
    # float32 both ways; sums in another order differ by ~1e-7 relative per op, far below 1e-5.
    ref = losses("loop", capacity)
    got = losses("triton", capacity)
    assert ref[-1] < ref[0]
    assert got == pytest.approx(ref, abs=1e-5)


@pytest.mark.parametrize("phantom", [False, True], ids=["all rows", "first rows only"])
def test_routing_weights_on_the_swiglu_output_are_the_weighted_combine(phantom):
    """combine_sorted puts each row's routing weight on its SwiGLU output, then sums plainly: the
    same output and the same gradients for x, the routing weights and both expert weights as
    weighting the expert outputs in the combine (the down projection is linear), with an empty
    expert, zero weights (dropped assignments) and, as expert parallelism does, only the first
    sorted rows made (the rest a phantom group). float32 (grouped_mm's widest dtype): the two
    orders round differently, a few ulps per entry."""
    from optimus_core.model.experts import Experts

    gen = torch.Generator().manual_seed(0)
    T, k, E = 9, 2, 5
    x = torch.randn(T, 16, generator=gen)
    topk_idx = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(T)])  # expert E-1: empty
    weights = torch.rand(T, k, generator=gen)
    weights[0, 1] = 0.0
    results = []
    for on_swiglu in (True, False):
        experts = Experts(E, 16, 8)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(1))
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        # tokens 0-2 to the phantom group E (another rank's experts): it sorts last, its rows not made
        idx = torch.where(torch.arange(T)[:, None] < 3, E, topk_idx) if phantom else topk_idx
        n_rows = int((idx < E).sum()) if phantom else None
        x_sorted, offsets, sorted_idx = experts.permute(xi, idx, E + phantom, n_rows)
        if on_swiglu:
            out = experts.combine_sorted(x_sorted, offsets[:E], sorted_idx, wi)
        else:  # the reference: the experts unweighted, their outputs weighted in the combine
            out = experts.unpermute(experts(x_sorted, offsets[:E]), sorted_idx, wi)
        grads = torch.autograd.grad(out.square().sum(), (xi, wi, experts.w_up, experts.w_down))
        results.append((out, *grads))
    assert results[0][0].abs().sum() > 0 and results[0][2].abs().sum() > 0  # not vacuous
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_backend_refuses_clearly_where_unsupported():
    if "torch" in optimus_kernels.available_backends():
        pytest.skip("torch._grouped_mm is supported here")
    with pytest.raises(RuntimeError, match="backend='torch' is unavailable"):
        losses("torch", steps=1)


def test_recast_expert_weights_changes_memory_not_numbers():
    """execution.recast_expert_weights casts the float32 weights inside the GEMMs instead of once per
    forward: under bf16 autocast the outputs and every gradient are bit-identical."""
    from optimus_core.model.experts import Experts

    torch.manual_seed(0)
    plain = Experts(4, 16, 8)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.2)
    recast = Experts(4, 16, 8)
    recast.load_state_dict(plain.state_dict())
    recast.recast_weights = True
    outs = bf16_outputs_and_grads(plain, recast)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[1][2].dtype == torch.float32


def bf16_outputs_and_grads(*experts_list):
    """Per Experts module, under bf16 autocast on one input: (y, dx, dw_up, dw_down)."""
    x = torch.randn(13, 16)
    offsets = torch.tensor([3, 3, 9, 11], dtype=torch.int32)  # an empty expert, 2 rows past the end
    outs = []
    for experts in experts_list:
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = experts(xi, offsets)
        y.float().square().sum().backward()
        outs.append((y, xi.grad, experts.w_up.grad, experts.w_down.grad))
    return outs


def test_tokens_are_cast_before_they_are_copied_top_k_times():
    """Under bf16 autocast the permuted copies are made in bf16 (the (T * K, D) rows, not the
    float32 tokens then a cast of k times as many rows): the forward is what permuting the
    float32 tokens and casting them would give, bit for bit, and the tokens' gradient is the
    float32 sum of their k copies' gradients, rounded to bf16 once."""
    from optimus_core.model.experts import Experts

    torch.manual_seed(0)
    experts = Experts(4, 16, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(7, 16, requires_grad=True)
    topk_idx = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1], [2, 0], [1, 3]])
    weights = torch.rand(7, 2)
    seen = []
    real_permute = experts.permute
    experts.permute = lambda x_TD, *a, **k: (seen.append(x_TD.dtype), real_permute(x_TD, *a, **k))[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts.apply_routed(x, topk_idx, weights, 4)
        x_sorted, offsets, sorted_idx = real_permute(x, topk_idx, 4)  # float32 rows, then the cast
        want = experts.combine_sorted(x_sorted.to(torch.bfloat16), offsets, sorted_idx, weights)
    assert seen == [torch.bfloat16] and torch.equal(out, want)
    (dx,) = torch.autograd.grad(out.float().sum(), x)
    (dx_ref,) = torch.autograd.grad(want.float().sum(), x)
    assert dx.dtype == torch.float32
    torch.testing.assert_close(dx, dx_ref, rtol=2 ** -8, atol=1e-6)  # one bf16 rounding apart
