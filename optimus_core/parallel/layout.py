"""Where each parameter's local share lies in the whole, layout-free parameter.

    for name, share in shares(model, mesh).items():
        share.local          # the plain tensor this rank holds (rows [first_row, first_row + len))
        share.first_row      # where those rows begin in the whole parameter
        share.global_shape   # the whole parameter's shape: the same for every layout
        share.dtensor()      # the share as a DTensor of the whole shape (checkpoints)

Every parameter is sharded along its rows only (dim 0; optimus_core.model.experts stores the
experts' weights as rows for this), so a rank's share is always one contiguous range of rows:

    dense (every layout of several ranks)   rows split over the world, or a block of dp_shard
                                            ranks and replicated over the blocks, or (the
                                            paper's baseline) over the expert-dp group and
                                            replicated over the EP group (FSDP2)
    expert                                  the EP rank's experts, a block of rows, split
                                            again over its expert-dp group, or its block's
                                            share of that group (FSDP2 on that mesh)
    one process                             everything, whole

The same description serves the seeded init (each rank draws exactly its rows:
optimus_core.model.init) and the checkpoints (each rank writes and reads exactly its rows under
keys that name whole parameters: optimus_core.train.checkpoint), so neither depends on the
layout, and nothing is ever gathered.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model.experts import Experts
from .expert_parallel import ExpertParallelExperts
from .mesh import Mesh


@dataclass
class Share:
    """One parameter's local share (module doc)."""

    name: str
    local: torch.Tensor  # plain tensor; a view of the parameter's storage
    first_row: int
    global_shape: tuple[int, ...]
    device_mesh: Any = None  # None: a plain, whole tensor (one process)
    placements: tuple = ()

    def dtensor(self):
        """The share as a DTensor over the whole shape, or the plain tensor where it is whole. A
        view: what fills it (a checkpoint load) fills the parameter."""
        if self.device_mesh is None:
            return self.local
        from torch.distributed.tensor import DTensor

        shape = torch.Size(self.global_shape)
        return DTensor.from_local(self.local, self.device_mesh, self.placements, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def like(self, local: torch.Tensor) -> "Share":
        """The same layout for another tensor of the local shape (an optimizer moment)."""
        return Share(self.name, local, self.first_row, self.global_shape, self.device_mesh, self.placements)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor a rank holds of ``t`` (a DTensor's local part, a view; else ``t``)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def _fsdp_first_row(p: torch.Tensor) -> int:
    """Where an FSDP2-sharded parameter's local rows begin in the parameter FSDP was given."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return 0
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]) if offset else 0


def shares(model: nn.Module, mesh: Mesh) -> dict[str, Share]:
    """Every parameter's share on this rank, by parameter name (module doc)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    experts = {f"{mod_name}.{p_name}": module for mod_name, module in model.named_modules()
               if isinstance(module, Experts) for p_name, _ in module.named_parameters(recurse=False)}
    meshes = mesh.device_meshes() if mesh.distributed else {}
    out = {}
    for name, p in model.named_parameters():
        local, first = local_tensor(p), _fsdp_first_row(p)
        owner = experts.get(name)
        if isinstance(owner, ExpertParallelExperts):  # EP: this rank's experts' rows, then FSDP's within
            p_name = name.rsplit(".", 1)[1]
            rows = p.shape[0] // owner.n_local  # per expert (D for w_up, F for w_down); DTensor: its global rows
            shape = (owner.n_experts * rows, *p.shape[1:])
            first += owner.first_row(p_name)
            # EP blocks of rows first, then FSDP2's placements within (its mesh's dims after "ep")
            within = tuple(p.placements) if isinstance(p, DTensor) else (Replicate(),) * (meshes["experts"].ndim - 1)
            out[name] = Share(name, local, first, shape, meshes["experts"], (Shard(0), *within))
        elif mesh.distributed:  # FSDP2's own layout is whole-shaped (dense, or experts at ep 1)
            out[name] = Share(name, local, first, tuple(p.shape), p.device_mesh, tuple(p.placements))
        else:
            out[name] = Share(name, local, 0, tuple(p.shape))
    return out
