"""Clipping through a fused optimizer's grad_scale updates like clip_grad_norm_ + step."""
import copy

import pytest
import torch
from torch import nn

from optimus_core.train.optim import clip_and_step


def _model_and_grads(seed: int, scale: float) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * scale
    return model


@pytest.mark.parametrize("scale", [10.0, 1e-3])  # clipped, and under the threshold
def test_fused_grad_scale_clip_matches_clip_then_step(scale):
    plain = _model_and_grads(0, scale)
    fused = copy.deepcopy(plain)
    for p, q in zip(plain.parameters(), fused.parameters()):
        q.grad = p.grad.clone()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    opt_fused = torch.optim.AdamW(fused.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(3):
        norm_plain = clip_and_step(plain, opt_plain, max_norm=1.0)
        norm_fused = clip_and_step(fused, opt_fused, max_norm=1.0)
        assert float(norm_fused) == pytest.approx(float(norm_plain), rel=1e-6)
        for p, q in zip(plain.parameters(), fused.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
            p.grad = torch.randn_like(p) * scale
            q.grad = p.grad.clone()
    assert not hasattr(opt_fused, "grad_scale")  # the hook is removed after each step
