"""parallelize applies every choice of an execution plan to a plain model, and nothing else: the
model built plain has the plain-torch defaults; each choice of the plan lands on the modules that
read it; expert parallelism keeps what was applied before it; a bad choice is refused by name."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from optimus_core.config import DataConfig, ExecutionConfig, ModelConfig, MoEConfig, RunConfig
from optimus_core.execution import parallelize, recompute, resolve_choices, use_kernels
from optimus_core.model.transformer import Transformer
from optimus_core.parallel.expert_parallel import ExpertParallelExperts

MODEL = ModelConfig(vocab_size=64, d_model=16, n_layers=4, n_heads=2, max_seq_len=8, pad_vocab_to=64,
                    moe=MoEConfig(n_experts=4, top_k=2, d_expert=8))


def _executed(model: Transformer) -> dict:
    """Every execution attribute of ``model``, read off its modules."""
    experts = [layer.experts for layer in model.moe_layers()]
    return {"experts": {e.backend for e in experts}, "recast": {e.recast_weights for e in experts},
            "moe recompute": {e.checkpoint_compute for e in experts},
            "qk_norm_rope": {b.attn.qk_norm_rope_kernel for b in model.blocks.values()},
            "lm_loss": model.lm_loss_kernel, "fp32_residual": model.fp32_residual,
            "blocks": model.recompute_blocks,
            "compiled": {"forward" in vars(m) for m in (*model.blocks.values(), model.final_norm)}}


PLAIN = {"experts": {"loop"}, "recast": {False}, "moe recompute": {False}, "qk_norm_rope": {False},
         "lm_loss": False, "fp32_residual": False, "blocks": frozenset(), "compiled": {False}}


def test_a_plain_model_executes_as_plain_torch():
    assert _executed(Transformer(MODEL)) == PLAIN


def _plan(**choices):
    run = RunConfig(model=MODEL, data=DataConfig(seq_len=8), execution=ExecutionConfig(dtype="bfloat16"))
    return dataclasses.replace(resolve_choices(run, "cpu", probe=False), **choices)


def test_each_choice_of_the_plan_lands_where_it_is_read(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn: fn)  # compile_blocks' wrapper, not a real compile
    plan = _plan(experts="triton", lm_loss="triton", qk_norm_rope="triton", residual_dtype="float32",
                 recast_expert_weights=True, checkpointing=("full", 2), compile=True)
    model = parallelize(Transformer(MODEL), plan)
    assert _executed(model) == {"experts": {"triton"}, "recast": {True}, "moe recompute": {False},
                                "qk_norm_rope": {True}, "lm_loss": True, "fp32_residual": True,
                                "blocks": frozenset({1, 3}), "compiled": {True}}
    moe = parallelize(Transformer(MODEL), _plan(checkpointing=("moe", 1)))
    assert _executed(moe) == {**PLAIN, "moe recompute": {True}}


def test_a_plan_of_the_defaults_leaves_the_model_plain():
    assert _executed(parallelize(Transformer(MODEL), _plan(experts="loop", lm_loss="torch",
                                                           qk_norm_rope="torch"))) == PLAIN


def test_expert_parallelism_keeps_how_the_experts_execute():
    """An EP rank's experts execute as the whole module was set to: backend, recast, recompute."""
    model = Transformer(MODEL)
    use_kernels(model, experts="triton")
    recompute(model, "moe")
    full = model.moe_layers()[0].experts
    full.recast_weights = True
    local = ExpertParallelExperts(full, SimpleNamespace(ep=2, ep_group=None, ep_rank=1))
    assert (local.backend, local.recast_weights, local.checkpoint_compute, local.n_held) == ("triton", True, True, 2)


def test_bad_choices_are_refused_by_name():
    dense = Transformer(dataclasses.replace(MODEL, moe=None, d_ff=32, qk_norm=False))
    with pytest.raises(ValueError, match="needs a model with QK-norm"):
        use_kernels(dense, qk_norm_rope=True)
    with pytest.raises(ValueError, match="'moe' needs MoE layers"):
        recompute(dense, "moe")
    with pytest.raises(ValueError, match="must be one of none, full, moe"):
        recompute(dense, "selective")


def test_the_plans_gemm_family_becomes_the_processs_ceiling():
    import importlib

    gm = importlib.import_module("optimus_kernels.grouped_mm")  # the module: the package's `grouped_mm` is the function
    before = gm._ceiling
    try:
        parallelize(Transformer(MODEL), _plan(experts="triton", expert_gemms="pointer"))
        assert gm._ceiling == "pointer" and not gm.allows("tma")
        parallelize(Transformer(MODEL), _plan(experts="triton", expert_gemms="warp_specialized"))
        assert gm.allows("warp_specialized")
    finally:
        gm.use_family(before)


@pytest.mark.parametrize("level", ["level1", "level2", "level4", "level7"])
def test_the_authors_recompute_levels_change_no_gradient(level):
    """Each level recomputes its parts of every layer (the MoE block after its routing, the
    attention, the norms) in the backward: the same loss and gradients as keeping everything
    (float32), and fewer tensors kept for the backward."""
    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                      moe=MoEConfig(n_experts=4, top_k=2, d_expert=16))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def run(mode):
        torch.manual_seed(0)
        model = Transformer(cfg)
        model.init_weights(seed=0)
        recompute(model, mode)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
            loss = model(tokens).float().logsumexp(-1).mean() + model.aux_loss()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(kept)

    ref_loss, ref_grads, ref_kept = run("none")
    loss, grads, kept = run(level)
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert kept < ref_kept
