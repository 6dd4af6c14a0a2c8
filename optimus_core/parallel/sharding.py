"""Fully sharded data parallelism, EP-aware: torch's FSDP2 on the dense and the expert meshes.

    with torch.device("meta"):
        model = Transformer(cfg.model)                        # nothing allocated
    model = expert_parallel(model, mesh)                      # EP: this rank's experts (meta)
    shard_model(model, mesh, dtype="bfloat16", optimizer="ep_aware")
    materialize(model, mesh, device, seed=cfg.train.seed)     # each rank allocates and draws its rows

What each rank keeps between uses (ZeRO-3 semantics): its rows of every parameter in float32,
their gradients and (optimus_core.train.sharded_adamw) their AdamW moments:

    dense parameters      ep_aware: sharded over the world (1/W each), or with parallel.dp_shard
                          = S over the rank's block of S ranks, replicated over the W / S blocks
                          (HSDP); dp_sharded (the paper's baseline, GitHub IntelLabs/Optimus-LM's
                          "sharded" optimizer): sharded over the rank's expert-dp group (the
                          data-parallel ranks, 1/(W/ep) each) and replicated over its EP group,
                          their gradients reduce-scattered over the first and all-reduced over
                          the second (HSDP on the (ep, expert_dp) grid)
    expert parameters     sharded over the rank's expert-dp group (1/(W/ep) of the rank's
                          n_experts/ep experts), or over its block's S / ep of them

With replicas, FSDP2 reduce-scatters each unit's gradient within the block and all-reduces the
shard over the replicas; with several micro-batches the all-reduce waits for the last one
(ShardedAdamW.before_micro_batch).

Units, each all-gathered just before use and freed after (FSDP2's ``fully_shard``):

    model.embed                  float32 all-gather, as the one process reads it: the rows it
                                 looks up are then cast to the residual stream's dtype
                                 (Transformer.hidden), the same bits on every layout
    each block                   its attention, norms and router, over the world
    each block's experts         over the expert-dp group (its own unit when ep > 1)
    the root                     final norm + LM head, kept from the forward through the backward
                                 (the fused LM loss reads the head's weight without calling it)

Under bf16 the units are gathered in bf16 (the weight copies the forward multiplies by) and
their gradients reduce-scattered in ``reduce_dtype`` (the paper's runs: bf16) onto the float32
shards; a float32 run reduces in float32. Each block's forward prefetches its experts and the
next block; the backward prefetches in reverse order (FSDP2's default). Gradients are
reduce-scattered as each unit's backward ends, in every micro-batch, so the synchronisation runs
under the backward throughout. Gathered once a step instead (execution.weight_gathers
"per_step", the paper's granularity: optimus_core.train.sharded_adamw sets it per micro-batch),
the units stay gathered from the step's first forward to its last backward, which alone reduces
their gradients, accumulated whole until then, and frees them.

Gradient means: every rank's loss is the mean over its own tokens, and FSDP2 divides a unit's
summed gradient by its mesh's size. That is the world mean for dense units; an expert's
gradient already sums the contributions of its whole EP group (the exchange brings them
home), so its sum over the expert-dp group covers all W ranks once, and FSDP2's mean over the
W / ep ranks of that group is ep times the world mean: the optimizer divides the experts'
(sharded) gradients by ep (optimus_core.train.sharded_adamw). Not FSDP2's own divide factor: it
needs NCCL's PREMUL_SUM, which gloo lacks (and xccl is not known to have), or two more passes.
"""
from __future__ import annotations

import torch
from torch import nn

from ..model.init import init_parameter_
from ..model.moe import MoEFeedForward
from .layout import shares
from .mesh import Mesh

REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


OPTIMIZERS = ("ep_aware", "dp_sharded")


def shard_model(model: nn.Module, mesh: Mesh, *, dtype: str = "float32", optimizer: str = "ep_aware",
                reduce_dtype: str = "float32") -> nn.Module:
    """Apply FSDP2 in place (module doc) to an EP-parallelized Transformer of ``mesh.world_size``
    > 1 ranks; returns ``model``. ``dtype``: the plan's (bf16 gathers under "bfloat16");
    ``optimizer``: where the dense parameters live, parallel.optimizer (module doc)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"parallel.reduce_dtype = {reduce_dtype!r}: must be one of {', '.join(REDUCE_DTYPES)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"parallel.optimizer = {optimizer!r}: must be one of {', '.join(OPTIMIZERS)}")
    meshes = mesh.device_meshes()
    dense_mesh = meshes["dense"]
    if optimizer == "dp_sharded" and mesh.ep > 1:
        if mesh.replicas > 1:
            raise ValueError("parallel.optimizer = 'dp_sharded' shards over the data-parallel ranks: it needs "
                             "parallel.dp_shard = 0")
        dense_mesh = meshes["grid"]  # (ep, expert_dp): replicated over the first, sharded over the second
    expert_mesh = meshes["experts"]["replicate", "shard"] if mesh.replicas > 1 else meshes["grid"]["expert_dp"]
    # The units' inputs are left as they come (cast_forward_inputs=False): the residual stream
    # is in the dtype Transformer.hidden gives it, as on one process, and autocast casts what each
    # matmul reads. (Cast by FSDP2, an activation-checkpointed block would also recompute from
    # other inputs than it ran on: FSDP2 does not cast again in the backward.)
    # a float32 run's gradients are float32: rounding them to bf16 for the reduction saves traffic
    # the run did not ask to save (parallel.reduce_dtype is the reduction of a bf16 run's)
    reduce = REDUCE_DTYPES[reduce_dtype] if dtype == "bfloat16" else torch.float32
    if dtype == "bfloat16":
        gathered = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce, cast_forward_inputs=False)
    else:
        gathered = MixedPrecisionPolicy(reduce_dtype=reduce, cast_forward_inputs=False)
    as_stored = MixedPrecisionPolicy(reduce_dtype=reduce, cast_forward_inputs=False)
    blocks = list(model.blocks.values())
    expert_unit = {}  # block index -> its experts, where they are a unit of their own
    for i, block in enumerate(blocks):
        experts = block.ffn.experts if isinstance(block.ffn, MoEFeedForward) else None
        if experts is not None and mesh.ep > 1:  # its own unit on the expert-dp mesh
            fully_shard(experts, mesh=expert_mesh, mp_policy=gathered)
            expert_unit[i] = experts
        fully_shard(block, mesh=dense_mesh, mp_policy=gathered)
    if model.embed is not None:  # (a pipeline stage past the first has none)
        fully_shard(model.embed, mesh=dense_mesh, mp_policy=as_stored)
    fully_shard(model, mesh=dense_mesh, mp_policy=gathered, reshard_after_forward=False)
    for method in ("lm_loss", "hidden"):  # the training and evaluation entries besides forward
        register_fsdp_forward_method(model, method)
    for i, block in enumerate(blocks):  # each block's forward gathers its experts and the next block
        ahead = ([expert_unit[i]] if i in expert_unit else []) + blocks[i + 1:i + 2]
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)
    return model


@torch.no_grad()
def materialize(model: nn.Module, mesh: Mesh, device: torch.device | str, *, seed: int) -> nn.Module:
    """Allocate a meta-built (EP-parallelized, perhaps sharded) model's local shares on ``device``
    and fill them with the seeded init of the rows they hold (optimus_core.model.init): the
    whole weights gathered from any layout equal the one-process init of ``seed``, bit for bit.
    Then the buffers (Transformer.reset_buffers)."""
    model.to_empty(device=device)
    for name, share in shares(model, mesh).items():
        if share.local.numel() and not share.local.is_meta:
            init_parameter_(share.local, name, share.first_row, seed=seed, cfg=model.cfg)
    model.reset_buffers()
    return model

