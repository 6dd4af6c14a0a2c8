"""The memory model: its parameter table is the model's, its activation count is what autograd
saves (fake tensors: no memory, no compute), its terms move the right way, the fit picks the
least recomputation that fits, and an over-budget layout is one clear error."""
import math
from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from optimus_core import presets
from optimus_core.config import ConfigError, ModelConfig, MoEConfig
from optimus_core.execution import recompute, use_kernels
from optimus_core.flops import checkpointed_blocks, level_bits
from optimus_core.memory import (FIT_MARGIN, GIB, LM_LOSS_CHUNK_ROWS, MemoryBudgetError, MemoryLayout, block_activation_bytes,
                                 check_fits, checkpointing_candidates, estimate, fit_checkpointing,
                                 _held_elements, heaviest_stage, parameter_table, static_bytes)
from optimus_core.model.transformer import Transformer

MOE = ModelConfig(vocab_size=97, d_model=96, n_layers=3, n_heads=6, moe=MoEConfig(n_experts=6, top_k=2, d_expert=40))
WIDE = ModelConfig(vocab_size=97, d_model=160, n_layers=2, n_heads=5, moe=MoEConfig(n_experts=16, top_k=4, d_expert=48))
DENSE = ModelConfig(vocab_size=97, d_model=96, n_layers=2, n_heads=6, d_ff=200)
OLMO = DENSE.replace(qk_norm=False, norm="nonparametric_layernorm")  # OLMo-1B's block (mula-1b)


@pytest.mark.parametrize("cfg", [MOE, DENSE, DENSE.replace(n_kv_heads=2, qk_norm=False), OLMO],
                         ids=["moe", "dense", "gqa", "olmo"])
def test_parameter_table_is_the_models(cfg):
    with torch.device("meta"):
        model = use_kernels(Transformer(cfg), experts="triton")
    got = [(p.name, p.rows, p.cols) for p in parameter_table(cfg)]
    want = [(n, p.shape[0], math.prod(p.shape[1:])) for n, p in model.named_parameters()]
    assert got == want
    assert sum(p.numel for p in parameter_table(cfg)) == cfg.num_params()


def saved_activation_bytes(cfg: ModelConfig, batch: int, seq: int, mode: str = "none",
                           qk_norm_rope_kernel: bool = False, residual=torch.bfloat16) -> int:
    """What one block keeps for its backward, counted from autograd's saved tensors on fake
    tensors: the weights in bf16 (as FSDP2 gathers them under bf16), the residual stream in
    ``residual``, bf16 autocast, weights and buffers apart."""
    records = {}

    def pack(t):
        records.setdefault(t.untyped_storage()._cdata, t)
        return t

    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = use_kernels(Transformer(cfg.replace(n_layers=1)), experts="triton")  # the count's backend
        finally:
            torch.set_default_dtype(torch.float32)
        recompute(model, mode if mode == "moe" or mode.startswith("level") else "none")
        use_kernels(model, qk_norm_rope=qk_norm_rope_kernel)
        block, (cos, sin) = model.blocks["0"], model.rope(seq)
        x = torch.randn(batch, seq, cfg.d_model, dtype=residual, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if mode == "full":  # as Transformer.hidden checkpoints a block
                checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                block(x, cos, sin)
        weights = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    return sum(t.untyped_storage().nbytes() for key, t in records.items() if key not in weights)


@pytest.mark.parametrize("residual", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kernel", [False, True], ids=["qk-torch", "qk-kernel"])
@pytest.mark.parametrize("cfg, mode", [(MOE, "none"), (MOE, "moe"), (MOE, "full"), (WIDE, "none"), (WIDE, "moe"),
                                       (DENSE, "none"), (DENSE, "full"), (OLMO, "none"),
                                       (MOE, "level1"), (MOE, "level2"), (MOE, "level4"), (MOE, "level7"),
                                       (DENSE, "level6"), (OLMO, "level2")])
def test_block_activations_are_what_autograd_saves(cfg, mode, kernel, residual):
    """Within 3%: the count leaves out the QK-norms' statistics (a few bytes per token). Both
    QK-norm paths (execution.qk_norm_rope) keep the q and k projections as they are, in bf16. The
    RoPE tables (float32 cos and sin), which every block saves, are made once per forward: not a
    block's (but a recomputed attention keeps them as its inputs). A checkpointed block keeps its
    input and nothing else; the authors' levels keep their recomputed parts' inputs."""
    if kernel and not cfg.qk_norm:
        pytest.skip("the QK-norm + RoPE kernel needs a model with QK-norm")
    batch, seq = 2, 64
    tables = 2 * seq * cfg.head_dim * 4
    want = saved_activation_bytes(cfg, batch, seq, mode, qk_norm_rope_kernel=kernel, residual=residual) - tables
    r = residual.itemsize
    got = block_activation_bytes(cfg, batch * seq, checkpointed=mode == "full", experts_only=mode == "moe",
                                 residual_bytes=r, level=level_bits(mode))
    assert got == pytest.approx(want, rel=0.03)
    if mode == "full":
        assert got == want == r * cfg.d_model * batch * seq


def test_a_bf16_residual_stream_keeps_less():
    """A bf16 residual halves the block's input and the residual after attention; each norm
    keeps that input as it comes (given a float32 one, torch's ops keep its normalised value too),
    and the q, k and v projections read one bf16 normed input instead of three casts."""
    for cfg, per_token in ((MOE, 2 * 2 + 2 * 4 + 2 * 2), (DENSE, 2 * 2 + 2 * 4 + 2 * 2 + 2)):  # + gate and up
        fp32, bf16 = (saved_activation_bytes(cfg, 2, 64, residual=dt) for dt in (torch.float32, torch.bfloat16))
        assert fp32 - bf16 == pytest.approx(per_token * cfg.d_model * 2 * 64, rel=0.01)  # and the rsqrts


def test_terms_move_the_right_way():
    cfg = presets.get("mula-220b-a10b").model
    base = MemoryLayout(world=384, ep=12, micro_batch=1, accumulation=2, seq_len=2048)
    more_ranks = estimate(cfg, MemoryLayout(world=3072, ep=12, micro_batch=1, accumulation=2, seq_len=2048))
    assert more_ranks.terms["weights"] < estimate(cfg, base).terms["weights"]  # sharded further
    # hybrid blocks of 384 hold what 384 ranks hold, however many replicas
    hybrid = MemoryLayout(world=3072, ep=12, dp_shard=384, micro_batch=1, accumulation=2, seq_len=2048)
    assert static_bytes(cfg, hybrid) == static_bytes(cfg, base)
    peaks = [estimate(cfg, MemoryLayout(**{**base.__dict__, "checkpointing": m, "every": k})).peak_bytes
             for m, k in (("none", 1), ("full", 2), ("full", 1))]
    assert peaks[0] > peaks[1] > peaks[2]
    # the paper's baseline: the dense state sharded over the 32 data-parallel ranks, not all 384
    baseline = MemoryLayout(**{**base.__dict__, "optimizer": "dp_sharded"})
    dense, experts = _held_elements(cfg, base)
    assert _held_elements(cfg, baseline) == (pytest.approx(12 * dense, rel=0.02), experts)  # FSDP2's padding
    one = estimate(presets.get("mula-7b-a1b").model.replace(n_layers=8),
                   MemoryLayout(micro_batch=2, seq_len=2048, bf16_expert_grads=True))
    assert one.terms["weight copies"] > 0 and one.terms["gathered"] == 0  # one process: whole, with bf16 copies


def test_the_fit_takes_the_least_recomputation_that_fits():
    cfg = presets.get("mula-220b-a10b").model
    layout = MemoryLayout(world=3072, ep=12, dp_shard=384, micro_batch=1, accumulation=2, seq_len=2048)
    order = checkpointing_candidates(cfg, layout.seq_len)
    assert order[0] == ("none", 1) and order[-1] == ("full", 1)
    peaks = {c: estimate(cfg, MemoryLayout(**{**layout.__dict__, "checkpointing": c[0], "every": c[1]})).peak_bytes
             for c in order}
    budget = 57.6 * GIB
    chosen = fit_checkpointing(cfg, layout, budget)
    assert peaks[chosen] * (1 + FIT_MARGIN) <= budget  # with the model's error to spare
    assert all(peaks[c] * (1 + FIT_MARGIN) > budget for c in order[:order.index(chosen)])
    assert fit_checkpointing(cfg, layout, None) == ("none", 1)  # no budget known: nothing recomputed
    # a budget that leaves the margin to no mode: the least recomputation that fits at all
    tight = peaks[("full", 1)] * (1 + FIT_MARGIN / 2)
    assert fit_checkpointing(cfg, layout, tight) == next(c for c in order if peaks[c] <= tight)


def test_a_float32_residual_needs_more_recomputation():
    """mula-220b-a10b at 384 tiles (32 accumulated micro-batches, the sweep's smallest point): a
    budget the bf16 residual stream fits whole, the float32 one (twice the residual's bytes) only
    with blocks recomputed; each the least recomputation with FIT_MARGIN to spare."""
    cfg = presets.get("mula-220b-a10b").model
    layouts = {fp32: MemoryLayout(world=384, ep=12, micro_batch=1, accumulation=32, seq_len=2048,
                                  expert_weight_casts=False, fp32_residual=fp32) for fp32 in (False, True)}
    none = {fp32: estimate(cfg, layout).peak_bytes for fp32, layout in layouts.items()}
    assert none[True] > none[False]
    budget = none[False] * (1 + FIT_MARGIN) * 1.001
    order = checkpointing_candidates(cfg, 2048)
    chosen = {fp32: fit_checkpointing(cfg, layout, budget) for fp32, layout in layouts.items()}
    assert chosen[False] == ("none", 1)
    assert order.index(chosen[True]) > 0
    peak = estimate(cfg, MemoryLayout(**{**layouts[True].__dict__, "checkpointing": chosen[True][0],
                                         "every": chosen[True][1]})).peak_bytes
    assert peak * (1 + FIT_MARGIN) <= budget


def test_the_estimate_counts_what_the_model_does():
    from optimus_core.model.linear_cross_entropy import DEFAULT_CHUNK_ROWS

    assert LM_LOSS_CHUNK_ROWS == DEFAULT_CHUNK_ROWS  # the torch-free twin of the loss's chunk
    model = Transformer(MOE.replace(n_layers=5))
    for mode, every, blocks in [("full", 2, {1, 3}), ("full", 1, {0, 1, 2, 3, 4}), ("moe", 1, set()), ("none", 1, set())]:
        recompute(model, mode, every)
        assert model.recompute_blocks == checkpointed_blocks(5, mode, every) == blocks


def test_over_budget_is_one_error_naming_the_run_the_gib_the_budget_and_the_knobs():
    cfg = presets.get("mula-220b-a10b").model
    layout = MemoryLayout(world=384, ep=12, micro_batch=1, accumulation=2, seq_len=2048)
    with pytest.raises(MemoryBudgetError, match=r"^scaling 384: \d+\.\d GiB at the (forward end|backward start) \(.*activations.*\) "
                                                r"per rank is over the budget of 30.0 GiB per device; try "
                                                r"execution.activation_checkpointing=full \(or auto\), or a larger "
                                                r"parallel.ep \(16\), or more ranks"):
        check_fits(cfg, layout, 30.0 * GIB, run="scaling 384")
    assert isinstance(MemoryBudgetError("x"), ConfigError)  # the command line's exit status 2
    with pytest.raises(MemoryBudgetError, match="over the budget of 1.0 GiB"):
        fit_checkpointing(cfg, layout, 1.0 * GIB)


def test_bad_layouts_are_clear_errors():
    with pytest.raises(ConfigError, match=r"activation_checkpointing = 'selective': must be one of"):
        MemoryLayout(checkpointing="selective")
    with pytest.raises(ConfigError, match=r"parallel.dp_shard = 36: must divide the world \(384\)"):
        MemoryLayout(world=384, ep=12, dp_shard=36)
    with pytest.raises(ConfigError, match="needs an MoE model"):
        estimate(DENSE, MemoryLayout(seq_len=64, checkpointing="moe"))
    with pytest.raises(ConfigError, match=r"parallel.ep = 4: must divide model.moe.n_experts \(6\)"):
        estimate(MOE, MemoryLayout(world=8, ep=4, seq_len=64))


def test_a_runs_layout_is_what_its_execution_plan_runs():
    import dataclasses

    from optimus_core.config import ExecutionConfig, RunConfig, TrainConfig
    from optimus_core.execution import resolve_choices

    def of_run(cfg, world, checkpointing, device):  # planned for a device not here: its kernels assumed to pass
        return MemoryLayout.of_run(cfg, world, checkpointing, resolve_choices(cfg, device, world, probe=False))

    cfg = RunConfig(model=MOE, train=TrainConfig(global_batch=4))
    gpu = of_run(cfg, 1, ("none", 1), "cuda")  # planned for a GPU: its kernels assumed to pass
    assert (gpu.dtype, gpu.lm_loss_kernel, gpu.expert_weight_casts, gpu.bf16_expert_grads) == ("bfloat16", True,
                                                                                               True, True)
    cpu = of_run(cfg, 1, ("full", 2), "cpu")
    assert (cpu.dtype, cpu.lm_loss_kernel, cpu.expert_weight_casts, cpu.bf16_expert_grads) == ("float32", False,
                                                                                               False, False)
    assert (cpu.checkpointing, cpu.every, cpu.micro_batch, cpu.accumulation) == ("full", 2, 4, 1)
    # micro-batches would add up in bf16: float32 expert gradients, the copies stay
    accumulating = of_run(cfg.replace(train=TrainConfig(global_batch=4, micro_batch=2)), 1, ("none", 1), "cuda")
    assert (accumulating.accumulation, accumulating.expert_weight_casts, accumulating.bf16_expert_grads) == (2, True,
                                                                                                           False)
    recast = of_run(cfg.replace(execution=ExecutionConfig(recast_expert_weights=True)), 1, ("none", 1), "cuda")
    assert not recast.expert_weight_casts and not recast.bf16_expert_grads
    sharded = of_run(cfg, 2, ("none", 1), "xpu")
    assert (sharded.world, sharded.dtype, sharded.expert_weight_casts, sharded.bf16_expert_grads) == (2, "bfloat16",
                                                                                                      False, False)
    # a plan given as it is: its choices, not the device type's
    plan = dataclasses.replace(resolve_choices(cfg, "cuda", probe=False), lm_loss="torch", bf16_expert_grads=False)
    given = MemoryLayout.of_run(cfg, 1, ("none", 1), plan)
    assert (given.lm_loss_kernel, given.expert_weight_casts, given.bf16_expert_grads) == (False, True, False)
    assert static_bytes(MOE, given)["gradients"] > static_bytes(MOE, gpu)["gradients"]  # float32 expert grads


def test_the_papers_exchange_holds_every_ranks_tokens_for_a_moment():
    """all_gather: each rank gathers its EP group's tokens and makes their partial sums, ep x its
    own tokens x width each way; the all-to-all sends only to the ranks of each token's experts
    (at most top_k of them), so at a large EP group the all-gather holds more."""
    cfg = presets.get("mula-20b-a2b").model
    a2a = MemoryLayout(world=96, ep=96, micro_batch=1, seq_len=2048)
    gather = MemoryLayout(**{**a2a.__dict__, "exchange": "all_gather"})
    T, D = a2a.tokens, cfg.d_model
    assert estimate(cfg, gather).terms["transient"] >= 2 * 96 * T * D * 2
    assert estimate(cfg, gather).terms["transient"] > estimate(cfg, a2a).terms["transient"]


def test_pipeline_stages_split_the_model_and_the_first_holds_the_most_micro_batches():
    """PP 4 over 4 layers, 8 micro-batches of one sequence: the stages' weights add up to the
    whole model's; the first holds the embedding and 4 micro-batches' activations, the last the
    LM head, its loss and one; the middle stages receive hidden states and send gradients back."""
    cfg = presets.get("mula-7b-a1b@laptop").model.replace(n_layers=4)
    whole = MemoryLayout(world=1, micro_batch=1, accumulation=8, seq_len=64, dtype="float32")
    stages = replace(whole, pp=4, cut=((0, 1), (1, 2), (2, 3), (3, 4))).stage_layouts()
    ests = [estimate(cfg, S) for S in stages]
    assert sum(e.terms["weights"] for e in ests) == estimate(cfg, whole).terms["weights"]
    assert [S.in_flight for S in stages] == [4, 3, 2, 1]
    one_block = block_activation_bytes(cfg, 64, residual_bytes=4)
    assert [e.terms["activations"] for e in ests] == [4 * one_block, 3 * one_block, 2 * one_block, one_block]
    assert [e.terms["lm loss"] > 0 for e in ests] == [False, False, False, True]
    assert [e.terms["pipeline"] for e in ests] == [8 * 64 * cfg.d_model * 4 * n for n in (1, 2, 2, 1)]
    assert heaviest_stage(cfg, stages[0]).stage == max(range(4), key=lambda s: ests[s].peak_bytes)
    with pytest.raises(ConfigError, match="a pipeline's layout gives each stage's layers"):
        replace(whole, pp=2)


def test_an_interleaved_rank_holds_its_chunks_and_more_micro_batches_in_flight():
    """PP 2 x 2 chunks over 4 layers, 8 micro-batches: rank 0 holds layers 0 and 2 (the embedding,
    not the head), rank 1 layers 1 and 3 (the head); rank 0 runs 2 (pp - 1) + pp = 4 chunk
    forwards and one more before its first backward: 2.5 micro-batches' worth of its layers."""
    cfg = presets.get("mula-7b-a1b@laptop").model.replace(n_layers=4)
    L = MemoryLayout(world=1, micro_batch=1, accumulation=8, seq_len=64, dtype="float32", pp=2, chunks=2,
                     cut=((0, 1), (1, 2), (2, 3), (3, 4)))
    first, second = L.stage_layouts()
    assert first.stage_layers(4) == [0, 2] and second.stage_layers(4) == [1, 3]
    assert (first.in_flight, second.in_flight) == (2.5, 1.5)
    assert first.holds("embed.weight", 4) and not first.holds("lm_head.weight", 4) and second.holds("lm_head.weight", 4)
    one_block = block_activation_bytes(cfg, 64, residual_bytes=4)
    assert estimate(cfg, first).terms["activations"] == 2.5 * 2 * one_block
