"""A run's model and optimizer on this rank, built without ever holding the whole model.

    plan = plan_execution(cfg, mesh.device, mesh.world_size)   # how it executes (optimus_core.execution)
    model = build_model(cfg, mesh, plan=plan)  # meta -> the plan applied -> this rank's rows, seeded
    optimizer = build_run_optimizer(model, cfg, mesh, plan)

One process: the whole model on the device, the one-process optimizer (TritonAdamW beside the
forward, bf16 expert copies: optimus_core.train.optim). Several ranks: expert parallelism and
full sharding (optimus_core.parallel.sharding) with the sharded AdamW
(optimus_core.train.sharded_adamw). Either way the model is constructed on the meta device and
each rank allocates and draws only its own rows (optimus_core.parallel.layout), so host and
device memory at start-up are one rank's share, and the initial weights do not depend on the
layout. The trainer, the scaling sweep and the rehearsal all build through here.
"""
from __future__ import annotations

import torch

from ..config import RunConfig
from ..execution import ExecutionPlan, parallelize, plan_execution
from ..execution.weight_copies import expert_copies, keep_expert_copies, refresh_copies
from ..model.transformer import Transformer
from ..parallel import Mesh
from ..parallel.layout import shares
from ..parallel.sharding import materialize
from .optim import build_optimizer
from .sharded_adamw import ShardedAdamW


def build_model(cfg: RunConfig, mesh: Mesh | None = None, device: torch.device | str | None = None,
                plan: ExecutionPlan | None = None) -> Transformer:
    """The model of ``cfg`` on this rank of ``mesh`` (a world of one on ``device`` by default),
    initialised from ``cfg.train.seed`` or, with ``cfg.train.init_from`` (a Hugging Face export,
    optimus_core.hf), from its weights, executed as ``plan`` says (default: the plan of ``cfg``
    on the mesh with no memory budget, so "auto" checkpointing is "none": a training run passes
    its own, checked, plan_execution). ``device``: where the shares are allocated (default: the
    mesh's; "meta": nowhere, the shapes only)."""
    mesh = mesh or Mesh.single(device or "cpu")
    device = torch.device(device) if device is not None else mesh.device
    plan = plan or plan_execution(cfg, device, mesh.world_size, budget_bytes=None)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model = parallelize(model, plan, mesh, cfg.parallel)  # with pipeline stages: this rank's stage
    materialize(model, mesh.stage, device, seed=cfg.train.seed)
    if device.type == "meta":
        return model
    if cfg.train.init_from:
        load_whole_weights_(model, mesh.stage, _import_weights(cfg))
    if plan.expert_copies:  # from the weights, before the optimizer: it keeps them
        keep_expert_copies(model, torch.bfloat16)
    return model


def build_run_optimizer(model: Transformer, cfg: RunConfig, mesh: Mesh, plan: ExecutionPlan | None = None):
    """The optimizer a run of ``cfg`` on ``mesh`` updates ``model`` with, as ``plan`` says (with
    pipeline stages: the stage's, on its stage mesh; the clip's norm spans the stages)."""
    plan = plan or plan_execution(cfg, mesh.device, mesh.world_size, budget_bytes=None)
    if mesh.stage.distributed:
        return ShardedAdamW(model, mesh.stage, cfg.optim, mode=cfg.parallel.optimizer, kernel=plan.adamw,
                            weight_gathers=plan.weight_gathers or "per_micro_batch")
    return build_optimizer(model, cfg.optim, plan)


@torch.no_grad()
def load_whole_weights_(model: Transformer, mesh: Mesh, state: dict[str, torch.Tensor]) -> None:
    """Set every parameter's local share from ``state``, a whole (unsharded) state dict: each rank
    copies its rows. Persistent buffers are taken as they are."""
    for name, share in shares(model, mesh).items():
        whole = state[name]
        share.local.copy_(whole[share.first_row:share.first_row + share.local.shape[0]])
    for name, buf in model.named_buffers():
        if name in state:
            buf.copy_(state[name])
    refresh_copies(expert_copies(model))


def _import_weights(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The whole weights of ``cfg.train.init_from``, checked against ``cfg.model`` (ValueError
    listing the fields that differ). Read whole on every rank: fine for the laptop-scale runs
    that start from an export; a paper-scale start would read each rank's rows instead."""
    from ..hf import ExportError, import_hf  # safetensors: only when asked

    where = f"train.init_from = {cfg.train.init_from!r}"
    try:
        source, source_cfg = import_hf(cfg.train.init_from)
    except (ExportError, FileNotFoundError) as e:
        raise ValueError(f"{where}: {e}") from None

    def arch(m) -> dict:  # what fixes the weights' shapes and the function they compute
        moe = m.moe
        return {"padded vocab_size": m.padded_vocab_size, "d_model": m.d_model, "n_layers": m.n_layers,
                "n_heads": m.n_heads, "kv heads": m.kv_heads, "qk_norm": m.qk_norm, "rope_theta": m.rope_theta,
                "norm_eps": m.norm_eps, "d_ff": None if moe else m.d_ff, "moe": moe is not None,
                "moe.n_experts": moe and moe.n_experts, "moe.top_k": moe and moe.top_k,
                "moe.d_expert": moe and moe.d_expert, "moe.norm_topk_probs": moe and moe.norm_topk_probs}
    ours, theirs = arch(cfg.model), arch(source_cfg)
    differ = [f"{k} {ours[k]} here, {theirs[k]} there" for k in ours if ours[k] != theirs[k]]
    if differ:
        raise ValueError(f"{where}: its model does not match model ({cfg.preset or 'this run'}): "
                         f"{'; '.join(differ)}. Use the preset the export was trained with")
    return source.state_dict()
