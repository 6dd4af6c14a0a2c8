"""The experts' bf16 weight copies (the execution plan's expert copies, optimus_core.execution.
weight_copies) on the model side: the forward with copies computes exactly what it computes
without them, state dicts do not change, and loading a state dict leaves each copy equal to its
weight cast, bit for bit."""
import os

import pytest
import torch

from optimus_core.config import DataConfig, ExecutionConfig, ModelConfig, MoEConfig, RunConfig
from optimus_core.execution import resolve_choices
from optimus_core.execution.weight_copies import (assert_copies_current, expert_copies, keep_expert_copies,
                                                  refresh_copies)
from optimus_core.model.experts import Experts
from optimus_core.model.transformer import Transformer
from test_experts_backends import bf16_outputs_and_grads

MODEL = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, pad_vocab_to=64,
                    moe=MoEConfig(n_experts=4, top_k=2, d_expert=8))


def _experts(seed=0, casts=True):
    torch.manual_seed(seed)
    experts = Experts(4, 16, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if casts:
        keep_expert_copies(experts, torch.bfloat16)
    return experts


def _model(seed=0):
    model = Transformer(MODEL)
    model.init_weights(seed=seed)
    return model


def test_the_forward_with_copies_equals_the_forward_without():
    """Under bf16 autocast: outputs and every gradient bit-identical, and the weights' gradients
    stay float32 (the copies get none)."""
    plain = _experts(casts=False)
    copied = _experts(casts=False)
    copied.load_state_dict(plain.state_dict())
    keep_expert_copies(copied, torch.bfloat16)
    outs = bf16_outputs_and_grads(plain, copied)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[1][2].dtype == torch.float32 and copied.w_up_cast.grad is None


def test_the_forward_reads_the_copy_not_the_weights():
    """A copy of the autocast dtype is what the product uses (so a stale copy would show);
    one of another dtype is ignored; outside autocast the float32 weights compute as before."""
    experts = _experts()
    x = torch.randn(9, 16)
    offsets = torch.tensor([2, 4, 6, 9], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = experts(x, offsets)
        experts.w_up_cast.mul_(2)
        assert not torch.equal(experts(x, offsets), before)
    keep_expert_copies(experts, torch.float16)  # not autocast's dtype: the weights are cast as usual
    experts.w_up_cast.mul_(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(experts(x, offsets), before)
    assert experts(x, offsets).dtype == torch.float32


def test_state_dicts_do_not_change_and_loading_recasts():
    model = _model()
    keys = set(model.state_dict())
    keep_expert_copies(model, torch.bfloat16)
    assert set(model.state_dict()) == keys  # the copies are non-persistent
    assert assert_copies_current(model) == 2 * len(model.moe_layers())
    model.load_state_dict(_model(seed=1).state_dict())
    assert assert_copies_current(model) == 4
    assert torch.equal(model.blocks["0"].ffn.experts.w_up_cast, _model(seed=1).blocks["0"].ffn.experts.w_up.bfloat16())


def test_copies_are_made_from_the_weights_as_they_are_and_dropped_on_request():
    model = _model()
    model.init_weights(seed=5)
    copies = keep_expert_copies(model, torch.bfloat16)
    assert len(copies) == 4 and assert_copies_current(model) == 4
    assert all(copy.dtype == torch.bfloat16 and not copy.requires_grad for copy in copies.values())
    assert keep_expert_copies(model, None) == {} and expert_copies(model) == {}
    assert assert_copies_current(model) == 0


def test_a_stale_copy_is_caught():
    experts = _experts()
    with torch.no_grad():
        experts.w_down.add_(1e-2)
    with pytest.raises(AssertionError, match="differ from the weight"):
        assert_copies_current(experts)
    refresh_copies(expert_copies(experts))
    assert assert_copies_current(experts) == 2


@pytest.mark.parametrize("execution, world, on", [
    (ExecutionConfig(dtype="bfloat16"), 1, True),
    (ExecutionConfig(dtype="float32"), 1, False),  # no autocast: nothing is cast
    (ExecutionConfig(dtype="bfloat16", recast_expert_weights=True), 1, False),  # memory over time
    (ExecutionConfig(dtype="bfloat16"), 2, False),  # sharded units are gathered in bf16
])
def test_the_plan_keeps_copies_where_they_pay(execution, world, on):
    """The plan's expert_copies, and build_model makes them (bf16, on every MoE layer) or none."""
    from optimus_core.train.build import build_model

    cfg = RunConfig(model=MODEL, data=DataConfig(seq_len=8), execution=execution)
    plan = resolve_choices(cfg, "cpu", world, probe=False)
    assert plan.expert_copies is on
    if world == 1:
        model = build_model(cfg, plan=plan)
        assert {copy.dtype for copy in expert_copies(model).values()} == ({torch.bfloat16} if on else set())
        assert assert_copies_current(model) == (2 * len(model.moe_layers()) if on else 0)
    dense = RunConfig(model=ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=8),
                      data=DataConfig(seq_len=8), execution=execution)
    assert resolve_choices(dense, "cpu", world, probe=False).expert_copies is False


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_triton_experts_read_the_copies_eager_and_compiled():
    """The triton backend (float16: the interpreter runs it) through optimus::grouped_mm_cast:
    the same outputs and gradients as its keep_cast path without copies, also under
    torch.compile (fullgraph), which sees a copy written in place between calls."""
    experts = _experts(casts=False)
    experts.backend = "triton"
    x = torch.randn(13, 16)
    offsets = torch.tensor([3, 3, 9, 11], dtype=torch.int32)

    def run(f):
        experts.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            y = f(x, offsets)
        y.float().square().sum().backward()
        return y, experts.w_up.grad.clone(), experts.w_down.grad.clone()

    without = run(experts)
    keep_expert_copies(experts, torch.float16)
    torch._dynamo.reset()
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    for got in (run(experts), run(compiled)):
        assert all(torch.equal(a, b) for a, b in zip(got, without))
    with torch.no_grad():
        experts.w_up_cast.mul_(2)
    assert not torch.equal(run(compiled)[0], without[0])
    assert torch.equal(run(compiled)[0], run(experts)[0])
