"""GradNormUnderBackward (optimus_core.train.grad_norm): the clip's gradient norm taken by hooks
during the last backward equals the norm of the final gradients, and clipping with it trains to
the same parameters. On a GPU the norms run on a side stream (the gpu-marked test)."""
import dataclasses
import os

import pytest
import torch
from torch import nn

from optimus_core.config import ExecutionConfig, OptimConfig, RunConfig
from optimus_core.execution import compile_blocks, resolve_choices, use_kernels
from optimus_core.execution.weight_copies import keep_expert_copies
from optimus_core.train.grad_norm import GradNormUnderBackward
from optimus_core.train.optim import build_optimizer, clip_and_step


def _model(device="cpu", seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 33), nn.LayerNorm(33), nn.Linear(33, 5), nn.Linear(5, 3)).to(device)


def _loss(model, seed, device="cpu"):
    x = torch.randn(16, 7, generator=torch.Generator().manual_seed(seed)).to(device)
    return model(x).square().mean()


def _total(model):
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])


def _check_last_backward(device):
    model = _model(device)
    norms = GradNormUnderBackward(model.parameters())
    _loss(model, 0, device).backward()  # an earlier micro-batch: not armed, its grads not final
    norms.arm()
    _loss(model, 1, device).backward()
    assert len(norms._squares) == len(list(model.parameters()))  # every hook saw its final gradient
    torch.testing.assert_close(norms.total(), _total(model), rtol=1e-6, atol=0)
    assert not norms.armed


def test_norm_of_the_final_gradients_after_accumulation():
    _check_last_backward("cpu")


@pytest.mark.gpu
def test_norm_on_a_side_stream_matches():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check_last_backward("cuda")


def test_gradients_the_hooks_did_not_see_are_counted():
    model = _model()
    norms = GradNormUnderBackward(model.parameters())
    norms.arm()
    _loss(model, 0).backward()
    model[3].weight.grad = torch.full_like(model[3].weight, 5.0)  # written by hand, after the hook
    norms._squares.pop(id(model[3].weight))
    torch.testing.assert_close(norms.total(), _total(model), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="no parameter has a gradient"):
        GradNormUnderBackward(_model().parameters()).total()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton AdamW on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("max_norm", [1e-2, None])
def test_clipping_with_it_trains_to_the_same_parameters(max_norm):
    """TritonAdamW (fused clip) with and without the norms under the backward: same norms, same
    parameters; without clipping the armed norms are dropped, not left armed."""
    cfg = OptimConfig(lr=1e-2, grad_clip=max_norm)
    plan = resolve_choices(RunConfig(optim=cfg, execution=ExecutionConfig(adamw="triton")), "cpu")
    assert plan.adamw == "triton" and not plan.grad_norm_under_backward  # a CPU: no side stream
    ref, mine = _model(), _model()
    ref_opt, opt = build_optimizer(ref, cfg, plan), build_optimizer(mine, cfg, plan)
    assert type(opt).__name__ == "TritonAdamW"
    assert getattr(opt, "grad_norms", None) is None  # built on a CPU: not attached by default
    opt.grad_norms = GradNormUnderBackward(mine.parameters())
    for step in range(6):
        _loss(ref, step).backward()
        opt.grad_norms.arm()
        _loss(mine, step).backward()
        n_ref, n = clip_and_step(ref, ref_opt, max_norm), clip_and_step(mine, opt, max_norm)
        assert not opt.grad_norms.armed
        if max_norm:
            assert float(n_ref) > max_norm  # the step really clipped
        torch.testing.assert_close(n, n_ref, rtol=1e-5, atol=0)
        ref_opt.zero_grad(), opt.zero_grad()
    for p, q in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_dropped_model_is_freed_without_the_cycle_collector():
    """The hooks must not tie the parameters into a reference cycle: a benchmark that builds
    one model after another would otherwise hold every earlier model's weights."""
    import gc
    import weakref

    model = _model()
    opt_norms = GradNormUnderBackward(model.parameters())
    weight = weakref.ref(model[0].weight)
    gc.disable()
    try:
        del model, opt_norms
        assert weight() is None
    finally:
        gc.enable()


class _GroupedLayer(nn.Module):
    """A Linear, then a grouped GEMM whose weight has a dw_square (optimus_kernels.grouped_mm, loop backend)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(7, 12)
        self.w = nn.Parameter(torch.randn(3, 12, 5) / 12**0.5)
        self.square = torch.zeros((), requires_grad=True)

    def forward(self, x):
        import optimus_kernels

        offsets = torch.tensor([4, 4, 16], dtype=torch.int32)  # one empty group
        return optimus_kernels.grouped_mm(self.inp(x), self.w, offsets, backend="loop", dw_square=self.square)


def test_squares_from_the_kernel_stand_for_whole_gradients(monkeypatch):
    """A gradient the armed backward makes whole is not read: its square comes with dw_square's
    gradient. One with an earlier micro-batch in it is read (its kernel square covers only the
    last part). The total is the final gradients' norm either way; dw_square keeps no gradient."""
    import optimus_core.train.grad_norm as grad_norm

    model = _GroupedLayer()
    norms = GradNormUnderBackward(model.parameters())
    norms.take_squares_from({model.w: model.square})
    read = []
    monkeypatch.setattr(grad_norm, "_square_norm", lambda g: read.append(g) or g.double().square().sum().float())
    for earlier in (False, True):
        model.zero_grad()
        if earlier:
            _loss(model, 5).backward()  # an earlier micro-batch: w's gradient is not whole after the last
        read.clear()
        norms.arm()
        _loss(model, 1).backward()
        total = norms.total()
        assert model.square.grad is None
        assert any(g is model.w.grad for g in read) == earlier
        assert len(read) == 2 + earlier  # the Linear's weight and bias, and w after an earlier micro-batch
        torch.testing.assert_close(total, _total(model), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="a parameter this tracker does not cover"):
        GradNormUnderBackward(model.inp.parameters()).take_squares_from({model.w: model.square})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the triton experts on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_moe_models_norm_with_the_dw_kernels_squares(compiled, monkeypatch):
    """The triton experts' dW kernels sum their gradients' squares (optimus_core.train.optim.
    dw_squares enables them): no expert gradient is read, and the norm is the final gradients'
    norm, eager and with compiled blocks (the squares leave the compiled backward as a gradient)."""
    import optimus_core.train.grad_norm as grad_norm
    from optimus_core.config import ModelConfig, MoEConfig
    from optimus_core.model.transformer import Transformer
    from optimus_core.train.optim import dw_squares
    from optimus_core.train.step import micro_batch_loss

    moe = MoEConfig(n_experts=4, top_k=2, d_expert=8)
    model = use_kernels(Transformer(ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, max_seq_len=8,
                                                moe=moe)), experts="triton")
    model.init_weights(seed=0)
    if compiled:
        compile_blocks(model)
    squares = dw_squares(model)
    assert len(squares) == 4 and all(w.ndim == 2 for w in squares)  # the experts' weights (rows)
    norms = GradNormUnderBackward(model.parameters())
    norms.take_squares_from(squares)
    read = []
    real = grad_norm._square_norm
    monkeypatch.setattr(grad_norm, "_square_norm", lambda g: read.append(g) or real(g))
    tokens = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model.zero_grad()
        read.clear()
        norms.arm()
        micro_batch_loss(model, tokens, dtype="float32").backward()
        total = norms.total()
        assert not any(g is w.grad for g in read for w in squares)
        assert len(read) == len([p for p in model.parameters() if p.grad is not None]) - 4
        torch.testing.assert_close(total, _total(model), rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled, micro_batch", [(False, 0), (True, 0), (True, 2)])
def test_training_with_the_dw_kernels_squares_on_gpu(compiled, micro_batch):
    """build_optimizer on CUDA with the triton experts (the plan's grad_norm_from_dw, always on
    there): the clip's norms and the training follow the run that reads every gradient, bf16,
    eager and compiled; with two micro-batches the expert gradients are read (not whole in the
    last one)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from optimus_core.config import DataConfig, ModelConfig, MoEConfig, TrainConfig
    from optimus_core.model.transformer import Transformer
    from optimus_core.train.step import train_step

    moe = MoEConfig(n_experts=4, top_k=2, d_expert=64)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, max_seq_len=32, pad_vocab_to=64, moe=moe)
    run = RunConfig(model=cfg, optim=OptimConfig(lr=1e-2), train=TrainConfig(global_batch=4, micro_batch=micro_batch),
                    data=DataConfig(seq_len=32), execution=ExecutionConfig(dtype="bfloat16", experts="triton"))
    plan = resolve_choices(run, "cuda")
    assert plan.grad_norm_under_backward and plan.grad_norm_from_dw and plan.expert_copies
    runs = []
    for from_dw in (False, True):
        model = use_kernels(Transformer(cfg), experts="triton")
        model.init_weights(seed=0)
        model = model.cuda()
        keep_expert_copies(model, torch.bfloat16)  # the bf16 copies: the cast op
        if compiled:
            compile_blocks(model)
        opt = build_optimizer(model, run.optim, dataclasses.replace(plan, grad_norm_from_dw=from_dw))
        assert bool(opt.grad_norms._from_kernel) == from_dw
        norms, losses = [], []
        for step in range(4):
            batch = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(step)).cuda()
            stats = train_step(model, opt, batch, micro_batch=micro_batch, grad_clip=0.05, lr=1e-2, dtype="bfloat16")
            norms.append(float(stats.grad_norm))
            losses.append(stats.loss)
        runs.append((norms, losses, [p.detach().clone() for p in model.parameters()]))
    (n_ref, l_ref, p_ref), (n, l, p) = runs
    # The first step's gradients are the same bits: its norms differ by summation order only.
    # Later steps start from parameters a clip factor's rounding apart, which bf16 can amplify.
    assert n[0] == pytest.approx(n_ref[0], rel=1e-5) and min(n_ref) > 0.05  # every step clipped
    assert n == pytest.approx(n_ref, rel=1e-3) and l == pytest.approx(l_ref, rel=1e-3)
    for a, b in zip(p, p_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
