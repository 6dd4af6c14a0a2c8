"""Apply a run's execution plan to a plain model: the one place where how a run executes meets it.

    with torch.device("meta"):
        model = Transformer(cfg.model)                      # plain: its config, nothing else
    model = parallelize(model, plan, mesh, cfg.parallel)    # how it executes, in the order below
    materialize(model, mesh, device, seed=cfg.train.seed)   # this rank's rows (parallel.sharding)
    keep_expert_copies(model, torch.bfloat16)               # where plan.expert_copies (weight_copies)

``parallelize`` applies, in this order:

0. pipeline stages (parallel.pp > 1): the model pruned to this rank's stage's layers
   (parallel.pipeline.keep_stage); every step below then applies to the stage on its stage mesh
   (the ranks of the stage: parallel.mesh), as to a whole model on a world of that size;
1. kernels: the experts' backend and their GEMMs' kernel family (process-wide: one device per
   process), the LM loss and the QK-norm + RoPE kernels;
2. precision: the residual stream's dtype, the experts' weights cast in each GEMM or once;
3. activation recomputation: whole blocks ("full", every n-th) or the experts' compute ("moe");
4. expert parallelism: each EP rank keeps its experts, tokens go to them (parallel.expert_parallel);
5. sharding: FSDP2 over the dense and expert meshes (parallel.sharding; the plan's
   weight_gathers is the optimizer's: optimus_core.train.sharded_adamw);
6. compile: each block's forward and the final norm's, last, so that the hooks the steps above
   put on a module (FSDP2's gathers, the optimizer's waits) run as Python around compiled code.

A new way of executing (another parallelism) is one more step here, with its choice resolved in
the plan (optimus_core.execution.plan); the pipeline's schedule runs in the training step
(optimus_core.train.step, parallel.pipeline.Pipeline). The weight copies wait for the
weights (they are made from them); the optimizer enables what its update needs itself
(optimus_core.train.optim). Every step sets plain attributes the model's modules document; the
model has no method for any of it.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ParallelConfig
from ..flops import RECOMPUTE_LEVELS, checkpointed_blocks, level_bits
from ..model.transformer import Transformer
from ..parallel import Mesh, expert_parallel
from ..parallel.pipeline import keep_stage
from ..parallel.sharding import shard_model
from .plan import ExecutionPlan

RECOMPUTE_MODES = ("none", "full", "moe", *RECOMPUTE_LEVELS)


def parallelize(model: Transformer, plan: ExecutionPlan, mesh: Mesh | None = None,
                parallel: ParallelConfig | None = None) -> Transformer:
    """``model`` (plain, on any device, the meta one included) executing as ``plan`` says on
    ``mesh`` (default: one process), in the module docstring's order; returns the model to use
    (expert parallelism swaps modules inside it). ``parallel``: the run's parallel section
    (optimizer, reduce_dtype, the pipeline's cut; default: its defaults)."""
    parallel = parallel or ParallelConfig()
    if mesh is not None and mesh.pp > 1:
        keep_stage(model, parallel.rank_stages(mesh.pp_rank), parallel.stage_layers(model.cfg.n_layers))
        mesh = mesh.stage
    if plan.expert_gemms is not None:
        from optimus_kernels.grouped_mm import use_family

        use_family(plan.expert_gemms)
    use_kernels(model, experts=plan.experts or "loop", lm_loss=plan.lm_loss == "triton",
                qk_norm_rope=plan.qk_norm_rope == "triton")
    model.fp32_residual = plan.residual_dtype == "float32"
    for layer in model.moe_layers():
        layer.experts.recast_weights = plan.recast_expert_weights
    recompute(model, *plan.checkpointing)
    if mesh is not None and mesh.distributed:
        model = expert_parallel(model, mesh, plan.expert_exchange or "all_to_all")
        shard_model(model, mesh, dtype=plan.dtype, optimizer=parallel.optimizer, reduce_dtype=parallel.reduce_dtype)
    if plan.compile:
        compile_blocks(model)
    return model


def use_kernels(model: Transformer, *, experts: str | None = None, lm_loss: bool | None = None,
                qk_norm_rope: bool | None = None) -> Transformer:
    """How the model's hot spots compute (None: as they are): the experts' backend ("loop" |
    "torch" | "triton", kernels/), the LM loss's softmax by the Triton kernel, the attention's
    QK-norm and RoPE by the Triton kernel (ValueError on a model without QK-norm). Returns
    ``model``, set in place."""
    if qk_norm_rope and not model.cfg.qk_norm:
        raise ValueError("the QK-norm + RoPE kernel needs a model with QK-norm (model.qk_norm)")
    if experts is not None:
        for layer in model.moe_layers():
            layer.experts.backend = experts
    if lm_loss is not None:
        model.lm_loss_kernel = lm_loss
    if qk_norm_rope is not None:
        for block in model.blocks.values():
            block.attn.qk_norm_rope_kernel = qk_norm_rope
    return model


def recompute(model: Transformer, mode: str, every: int = 1) -> None:
    """What the backward recomputes (execution.activation_checkpointing, resolved): "none",
    "full" (every ``every``-th block whole), "moe" (the experts' computation of every MoE layer,
    the dispatch kept) or the authors' "level<N>" (optimus_core.flops.LEVEL_BITS: of every layer
    the MoE block after its routing, the attention, the norms)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"activation checkpointing {mode!r}: must be one of {', '.join(RECOMPUTE_MODES)}")
    bits = level_bits(mode)
    if (mode == "moe" or bits & 1) and not model.moe_layers():
        raise ValueError(f"activation checkpointing {mode!r} needs MoE layers; this model is dense")
    model.recompute_blocks = frozenset(checkpointed_blocks(model.cfg.n_layers, mode, every))  # layer indices
    model.recompute_final_norm = bool(bits & 4)
    for block in model.blocks.values():
        block.recompute_attention, block.recompute_norms = bool(bits & 2), bool(bits & 4)
    for layer in model.moe_layers():
        layer.experts.checkpoint_compute = mode == "moe"
        layer.recompute_routed = bool(bits & 1)


def compile_blocks(model: Transformer) -> None:
    """torch.compile each block's forward and the final norm's, in place: parameter names (and so
    checkpoints) stay those of the eager model, and hooks on a module (FSDP2's, the optimizer's
    per-stage waits: optimus_core.train.update_stream) run as plain Python before its compiled
    code, not traced into it. The final norm, eager, is ~20 float32 passes over the (tokens x
    d_model) residual stream each step (its pow, mean, rsqrt, products and their gradients);
    compiled, one kernel each way. (Each compiled forward is bound to its module: a deep copy of
    a compiled model would call the original's; copy, then compile.)"""
    module: nn.Module
    for module in (*model.blocks.values(), model.final_norm):
        if module is not None:  # (a pipeline stage but the last has no final norm)
            module.forward = torch.compile(module.forward)
