"""A run's model and optimizer on this rank, built without ever holding the whole model.

    model = build_model(cfg, mesh)             # meta -> EP -> FSDP2 -> this rank's rows, seeded
    optimizer = build_run_optimizer(model, cfg, mesh)

One process: the whole model on the device, the one-process optimizer (TritonAdamW beside the
forward, bf16 expert copies: optimus_core.train.optim). Several ranks: expert parallelism and
full sharding (optimus_core.parallel.sharding) with the sharded AdamW
(optimus_core.train.sharded_adamw). Either way the model is constructed on the meta device and
each rank allocates and draws only its own rows (optimus_core.parallel.layout), so host and
device memory at start-up are one rank's share, and the initial weights do not depend on the
layout. The trainer, the scaling sweep and the rehearsal all build through here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import RunConfig
from ..memory import GIB, MemoryEstimate, check_run, device_budget
from ..model.linear_cross_entropy import use_softmax_kernel
from ..model.transformer import Transformer
from ..parallel import Mesh, parallelize
from ..parallel.layout import shares
from ..parallel.sharding import materialize, shard_model
from .optim import build_optimizer, use_bf16_expert_grads
from .sharded_adamw import ShardedAdamW


def build_model(cfg: RunConfig, mesh: Mesh | None = None, device: torch.device | str | None = None,
                checkpointing: tuple[str, int] | None = None) -> Transformer:
    """The model of ``cfg`` on this rank of ``mesh`` (a world of one on ``device`` by default),
    initialised from ``cfg.train.seed`` or, with ``cfg.train.init_from`` (a Hugging Face export,
    optimus_core.hf), from its weights. ``device``: where the shares are allocated (default: the
    mesh's; "meta": nowhere, the shapes only). ``checkpointing``: the resolved (mode, every) of
    train.activation_checkpointing (``plan_memory``); by default the configured mode, "auto"
    meaning "none"."""
    mesh = mesh or Mesh.single(device or "cpu")
    device = torch.device(device) if device is not None else mesh.device
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if checkpointing is None:
        mode = cfg.train.activation_checkpointing
        checkpointing = ("none" if mode == "auto" else mode, cfg.train.activation_checkpointing_every)
    model.set_activation_checkpointing(*checkpointing)
    model.lm_loss_kernel = use_softmax_kernel(cfg.train.lm_loss_softmax, device)
    model.set_recast_expert_weights(cfg.train.recast_expert_weights)
    if mesh.distributed:
        model = parallelize(model, mesh, cfg.parallel.dispatch)
        shard_model(model, mesh, dtype=cfg.train.dtype, experts_sharded=cfg.parallel.optimizer == "ep_aware",
                    reduce_dtype=cfg.parallel.reduce_dtype)
    materialize(model, mesh, device, seed=cfg.train.seed, std=cfg.model.init_std)
    if device.type == "meta":
        return model
    _trusted_expert_kernels(model, device)
    if cfg.train.init_from:
        load_whole_weights_(model, mesh, _import_weights(cfg))
    if not mesh.distributed:  # sharded units are gathered in bf16: they need no copies
        model.use_expert_weight_casts(cfg.train)  # before the optimizer: it looks the copies up
    if cfg.train.compile:
        model.compile_blocks(cfg.train.compile_mode)
    return model


@dataclass(frozen=True)
class MemoryPlan:
    """How a run of ``cfg`` on a mesh fits its device: the checkpointing it resolves to, the
    memory model's estimate per rank and the budget it was checked against (None: unknown)."""

    checkpointing: tuple[str, int]
    estimate: MemoryEstimate
    budget_bytes: float | None

    def describe(self) -> str:
        mode, every = self.checkpointing
        ac = mode + (f" (every {every})" if mode == "full" and every > 1 else "")
        budget = f" of a {self.budget_bytes / GIB:.1f} GiB budget" if self.budget_bytes else " (no budget known)"
        return f"activation checkpointing {ac}; memory per rank {self.estimate.describe()}{budget}"


def device_memory_bytes(device: torch.device) -> float | None:
    """The device's total memory, or None where the allocator does not say (a CPU)."""
    if device.type in ("cuda", "xpu"):
        return float(getattr(torch, device.type).get_device_properties(device).total_memory)
    return None


def plan_memory(cfg: RunConfig, mesh: Mesh, budget_bytes: float | None | str = "device") -> MemoryPlan:
    """Resolve train.activation_checkpointing ("auto": the least recomputation that fits) and
    check that the run fits ``budget_bytes`` (default: train.memory_budget_gib, else the usable
    share of this rank's device, optimus_core.memory.device_budget; None: no check). MemoryBudgetError, naming the run, the
    GiB, the budget and what would help, before anything is allocated."""
    if budget_bytes == "device":
        chosen = cfg.train.memory_budget_gib
        budget_bytes = chosen * GIB if chosen is not None else device_budget(device_memory_bytes(mesh.device))
    checkpointing, est = check_run(cfg, mesh.world_size, mesh.device.type, budget_bytes, run=cfg.preset or "this run")
    return MemoryPlan(checkpointing, est, budget_bytes)


def build_run_optimizer(model: Transformer, cfg: RunConfig, mesh: Mesh):
    """The optimizer a run of ``cfg`` on ``mesh`` updates ``model`` with."""
    if mesh.distributed:
        # float32 expert gradients there (FSDP2 reduces into float32 shards); "bfloat16" raises
        use_bf16_expert_grads(model, cfg.train, cfg.optim, mesh.device, ranks=mesh.world_size)
        return ShardedAdamW(model, mesh, cfg.optim, mode=cfg.parallel.optimizer)
    return build_optimizer(model, cfg.optim, cfg.train)


@torch.no_grad()
def load_whole_weights_(model: Transformer, mesh: Mesh, state: dict[str, torch.Tensor]) -> None:
    """Set every parameter's local share from ``state``, a whole (unsharded) state dict: each rank
    copies its rows. Persistent buffers are taken as they are."""
    for name, share in shares(model, mesh).items():
        whole = state[name]
        if whole.ndim == 3 and share.local.ndim == 2:  # experts in the earlier (E, rows, cols) layout
            whole = whole.reshape(-1, whole.shape[-1])
        share.local.copy_(whole[share.first_row:share.first_row + share.local.shape[0]])
    for name, buf in model.named_buffers():
        if name in state:
            buf.copy_(state[name])
    model.refresh_weight_casts()


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


def _trusted_expert_kernels(model, device: torch.device) -> None:
    """The experts' Triton kernels only where they passed their self-check on this device
    (kernels.selfcheck: the first build on a device runs it and warns once on a failure); the
    loop over experts otherwise. The config is left as it is: only the modules' backend changes."""
    from kernels.selfcheck import validated

    from ..model.experts import Experts

    experts = [m for m in model.modules() if isinstance(m, Experts) and m.backend == "triton"]
    if experts and not validated("experts", device):
        for m in experts:
            m.backend = "loop"
