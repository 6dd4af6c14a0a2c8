"""GradNormUnderBackward (optimus_core.train.grad_norm): the clip's gradient norm taken by hooks
during the last backward equals the norm of the final gradients, and clipping with it trains to
the same parameters. On a GPU the norms run on a side stream (the gpu-marked test)."""
import os

import pytest
import torch
from torch import nn

from optimus_core.config import OptimConfig
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
    cfg = OptimConfig(lr=1e-2, implementation="triton", grad_clip=max_norm)
    ref, mine = _model(), _model()
    ref_opt, opt = build_optimizer(ref, cfg), build_optimizer(mine, cfg)
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
