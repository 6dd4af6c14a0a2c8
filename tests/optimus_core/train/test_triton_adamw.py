"""TritonAdamW (optimus_core.train.adamw): torch.optim.AdamW's parameters after many steps, with
the clip divisor as grad_scale, its state dict in both directions, and the execution plan's adamw choice.
The kernel runs in the Triton interpreter on the CPU (TRITON_INTERPRET=1, as `make test` sets)."""
import copy
import os

import pytest
import torch
from torch import nn

from optimus_core.config import ExecutionConfig, OptimConfig, RunConfig
from optimus_core.execution import ExecutionError, resolve_choices
from optimus_core.train.optim import build_optimizer, clip_and_step, param_groups

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton AdamW on CPU needs TRITON_INTERPRET=1")


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 33), nn.LayerNorm(33), nn.Linear(33, 5))


def _plan(cfg, adamw="triton", device="cpu", **kw):
    """The execution plan of a run of ``cfg`` asking for the ``adamw`` kernel on ``device``."""
    return resolve_choices(RunConfig(optim=cfg, execution=ExecutionConfig(adamw=adamw)), device, **kw)


def _train(model, opt, steps, max_norm, start=0):
    norms = []
    for step in range(start, start + steps):
        x = torch.randn(16, 7, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        norms.append(float(clip_and_step(model, opt, max_norm)))
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("max_norm", [None, 1e-2])
def test_same_parameters_as_torch_adamw(max_norm):
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    ref, mine = _model(), _model()
    ref_opt = torch.optim.AdamW(param_groups(ref, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    opt = build_optimizer(mine, cfg, _plan(cfg))
    assert type(opt).__name__ == "TritonAdamW"
    norms_ref, norms = _train(ref, ref_opt, 12, max_norm), _train(mine, opt, 12, max_norm)
    if max_norm:
        assert min(norms_ref) > max_norm  # every step was really clipped (through grad_scale)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(norms_ref), rtol=1e-5, atol=0)
    for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_state_dicts_load_both_ways():
    """A run that saved torch AdamW state continues on TritonAdamW and vice versa, unchanged."""
    cfg = OptimConfig(lr=1e-2)
    ref = _model()
    ref_opt = torch.optim.AdamW(param_groups(ref, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    _train(ref, ref_opt, 3, 1.0)
    mine = _model()
    mine.load_state_dict(ref.state_dict())
    opt = build_optimizer(mine, cfg, _plan(cfg))
    assert type(opt).__name__ == "TritonAdamW"
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # torch shares the step tensors otherwise
    _train(ref, ref_opt, 3, 1.0, start=3)
    _train(mine, opt, 3, 1.0, start=3)
    for p, q in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    back = torch.optim.AdamW(param_groups(ref, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    back.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(float(s["step"]) == 6 for s in back.state.values())


def test_the_plans_adamw_choice(monkeypatch):
    """execution.adamw: "auto" is the Triton kernel on a GPU (planned without probing), torch's on a
    CPU; an explicit "triton" runs on a CPU only under the interpreter (tests), else it is an
    ExecutionError naming the choice; build_optimizer follows the plan (default: a CPU's)."""
    cfg = OptimConfig()
    assert _plan(cfg, "auto").adamw == "torch"  # torch's loop on a CPU
    assert _plan(cfg, "auto", "cuda", probe=False).adamw == "triton"
    assert _plan(cfg, "torch", "cuda", probe=False).adamw == "torch"
    assert _plan(cfg, "triton").adamw == "triton"  # the interpreter: tests only
    assert type(build_optimizer(_model(), cfg)).__name__ == "AdamW"
    assert type(build_optimizer(_model(), cfg, _plan(cfg, "torch"))).__name__ == "AdamW"
    assert type(build_optimizer(_model(), cfg, _plan(cfg, "triton"))).__name__ == "TritonAdamW"
    import optimus_kernels._triton

    monkeypatch.setattr(optimus_kernels._triton, "INTERPRET", False)
    with pytest.raises(ExecutionError, match=r"execution\.adamw = 'triton'.*no Triton on cpu"):
        _plan(cfg, "triton")
    assert _plan(cfg, "auto").adamw == "torch"
