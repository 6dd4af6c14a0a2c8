"""Who am I, and with whom do I talk: launcher environment, process groups (dp, pp, ep, expert-dp).

    mesh = init_distributed(cfg.parallel, n_experts=cfg.model.moe.n_experts)   # every rank
    mesh.rank, mesh.world_size, mesh.ep_rank, mesh.expert_dp_rank
    mesh.ep_group          # the ``ep`` consecutive ranks that split the experts between them
    mesh.expert_dp_group   # the world/ep ranks that hold the same experts (one per EP group)
    meshes = mesh.device_meshes()   # torch DeviceMeshes: "world", "grid" (ep, expert_dp), "dense", "experts"
    stage = mesh.stage     # pipeline stages (parallel.pp): the ranks of this rank's stage, a mesh of their own

Rank, world size and local rank come from torchrun (RANK, WORLD_SIZE, LOCAL_RANK), Open MPI
(OMPI_COMM_WORLD_*), or PMI / PALS (PMI_RANK, PMI_SIZE, PALS_LOCAL_RANKID or PMI_LOCAL_RANK) as
Aurora's mpiexec sets them; under mpiexec in a PBS job without MASTER_ADDR, rank 0's host is the
first line of $PBS_NODEFILE. With no launcher variables the process is a world of one and no
process group is created. Every check that can fail (layout, MASTER_ADDR) runs before the first collective, on
every rank, so a bad launch is an error everywhere instead of a hang.

Layout: EP groups are blocks of consecutive ranks, each on one node (the paper's rank order: an
EP group is one node's 12 tiles), where its token exchange stays off the network: a launch whose
EP groups would span nodes -- ep not dividing the ranks of a node, or a launcher that does not
place consecutive ranks together -- stops on every rank before training unless
parallel.ep_across_nodes asks for it. Expert-dp group ``j`` is the ranks ``j, j + ep, j + 2 ep, ...``.
Sharding (parallel.dp_shard = S, 0 = the whole world): the parameters are sharded over blocks of
S consecutive ranks and replicated over the W / S blocks (hybrid sharding, HSDP: a collective
per layer spans S ranks, not the world; one all-reduce per step over the replicas); within a
block, the S / ep ranks of one EP rank shard that rank's experts.

Pipeline stages (parallel.pp = P > 1): the rank order is the paper's, DP, PP, EP: rank
``(d P + s) ep + e`` is EP rank e of stage s of data-parallel replica d, so an EP group stays
consecutive (on one node) and a pipeline (the P ranks of one (d, e), ``pp_group``) spans nodes.
The mesh above is the whole world (who records, agreement on flags, checkpoints' RNG rows);
``mesh.stage`` is the mesh of this rank's stage: its W / P ranks numbered ``d ep + e``, with
their own EP, expert-dp and sharding groups as laid out above. A stage is built, sharded and
updated on its stage mesh exactly as a whole model is on a world of that size.
"""
from __future__ import annotations

import datetime
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..config import ConfigError, ParallelConfig
from ..device import (binding_index, collective_backend, import_vendor_extensions, resolve_device_type,
                      visible_devices)
from ..log import get_logger

_log = get_logger(__name__)


@dataclass(frozen=True)
class LaunchEnv:
    """Rank facts read from the launcher's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str  # torchrun | ompi | pmi | none
    master_addr: str | None
    master_port: str | None
    local_world: int | None = None  # ranks on this node, where the launcher says


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment variable {name} = {env[name]!r}: must be an integer") from None


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Parse the launcher's variables (torchrun first, then Open MPI, then PMI / PALS).

    >>> read_launch_env({"PMI_RANK": "3", "PMI_SIZE": "24", "PALS_LOCAL_RANKID": "3",
    ...                  "MASTER_ADDR": "x1000c0s0b0n0", "MASTER_PORT": "29500"}).local_rank
    3
    """
    env = os.environ if env is None else env
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher, rank, world = "torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_names, size_names = ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher, rank, world = "ompi", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_names, size_names = ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)
    elif "PMI_RANK" in env:
        launcher, rank, world = "pmi", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_names = ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "MPI_LOCALRANKID")  # PALS, PMIx, Hydra
        size_names = ("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE", "MPI_LOCALNRANKS")
    else:
        return LaunchEnv(0, 1, 0, "none", addr, port, 1)
    # A launcher that does not say the local rank runs one rank per node as far as we can tell.
    local = next((_int(env, n) for n in local_names if n in env), 0)
    local_world = next((_int(env, n) for n in size_names if n in env), None)
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"{launcher} environment: rank {rank}, world size {world}: need 0 <= rank < world")
    if world > 1 and not addr:
        addr, port = pbs_rendezvous(env, port)
    return LaunchEnv(rank, world, local, launcher, addr, port, local_world)


def pbs_rendezvous(env: Mapping[str, str], port: str | None) -> tuple[str | None, str | None]:
    """Rank 0's host and a port for mpiexec inside a PBS job, which sets no MASTER_ADDR.

    mpiexec places ranks in node-file order, so global rank 0 runs on the first host of
    $PBS_NODEFILE, or of the hostfile the job started its ranks on ($OPTIMUS_HOSTFILE: its
    nodes less those named faulty, workflow/hostfile.py); every rank reads the same file, so
    all agree. The port, unless MASTER_PORT
    is set, is 29500 + a number from $PBS_JOBID: the same on every rank, and different for two
    jobs that share a first node. (None, port) outside PBS: check_rendezvous then says what to set.
    """
    nodefile = env.get("OPTIMUS_HOSTFILE") or env.get("PBS_NODEFILE")
    if not nodefile:
        return None, port
    try:
        hosts = [line.strip() for line in Path(nodefile).read_text().splitlines() if line.strip()]
    except OSError:
        return None, port
    if not hosts:
        return None, port
    job = env.get("PBS_JOBID", "")
    return hosts[0], port or str(29500 + zlib.crc32(job.encode()) % 1000)


def check_rendezvous(launch: LaunchEnv) -> None:
    """torchrun always sets MASTER_ADDR / MASTER_PORT; mpiexec does not, and without them every
    rank would wait forever in init_process_group. Say so instead."""
    if launch.world_size > 1 and not (launch.master_addr and launch.master_port):
        missing = [n for n, v in (("MASTER_ADDR", launch.master_addr), ("MASTER_PORT", launch.master_port)) if not v]
        raise ConfigError(
            f"{' and '.join(missing)} not set under {launch.launcher} with world size {launch.world_size} "
            f"(rank {launch.rank}) and no $PBS_NODEFILE to read rank 0's host from: export "
            f"MASTER_ADDR=<rank 0's hostname> and MASTER_PORT=<a free port> before mpiexec")


def group_layout(world_size: int, ep: int, n_experts: int | None,
                 dp_shard: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(ep_groups, expert_dp_groups) as rank lists; validates the layout (pure logic).

    >>> group_layout(4, 2, 8)
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    if ep < 1 or world_size % ep:
        raise ConfigError(f"parallel.ep = {ep}: must divide the world size ({world_size} ranks)")
    if n_experts is not None and ep > n_experts:
        raise ConfigError(f"parallel.ep = {ep}: more expert-parallel ranks than experts ({n_experts})")
    if n_experts is not None and n_experts % ep:
        raise ConfigError(f"parallel.ep = {ep}: must divide model.moe.n_experts ({n_experts})")
    shard = dp_shard or world_size
    if shard < 1 or world_size % shard or shard % ep:
        raise ConfigError(f"parallel.dp_shard = {dp_shard}: must divide the world size ({world_size} ranks) and be "
                          f"a multiple of parallel.ep ({ep}), or 0 (shard over the whole world)")
    ep_groups = [list(range(start, start + ep)) for start in range(0, world_size, ep)]
    expert_dp_groups = [list(range(j, world_size, ep)) for j in range(ep)]
    return ep_groups, expert_dp_groups


def sharding_layout(world_size: int, ep: int, dp_shard: int = 0) -> dict[str, list[list[int]]]:
    """The sharding groups as rank lists (module doc): ``shard`` (blocks of S consecutive ranks),
    ``replicate`` (the same place in every block: dense units and experts alike) and
    ``expert_shard`` (a block's ranks of one EP rank).

    >>> sharding_layout(8, 2, 4)["expert_shard"]
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    """
    S = dp_shard or world_size
    blocks = world_size // S
    return {
        "shard": [list(range(b * S, (b + 1) * S)) for b in range(blocks)],
        "replicate": [list(range(i, world_size, S)) for i in range(S)],
        "expert_shard": [list(range(b * S + i, (b + 1) * S, ep)) for b in range(blocks) for i in range(ep)],
    }


def pipeline_layout(world_size: int, pp: int, ep: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """(stages, pipelines) as global rank lists (module doc): ``stages[s]`` the ranks of stage s
    in their stage numbering, ``pipelines`` the P ranks of each (replica, EP rank), stage order.

    >>> pipeline_layout(8, 2, 2)
    ([[0, 1, 4, 5], [2, 3, 6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]])
    """
    if pp < 1 or world_size % (pp * ep):
        raise ConfigError(f"parallel.pp = {pp} x parallel.ep = {ep}: must divide the world size ({world_size} ranks)")
    replicas = world_size // (pp * ep)
    stages = [[(d * pp + s) * ep + e for d in range(replicas) for e in range(ep)] for s in range(pp)]
    pipelines = [[(d * pp + s) * ep + e for s in range(pp)] for d in range(replicas) for e in range(ep)]
    return stages, pipelines


@dataclass
class Mesh:
    """One rank's view of the layout. Groups are None in a world of one (no collectives run).
    A stage mesh (module doc: ``Mesh.stage``) numbers its ranks within the stage: ``group`` is
    its world's process group and ``global_ranks`` its ranks' numbers in the whole world."""

    rank: int
    world_size: int
    local_rank: int
    ep: int
    device: torch.device
    backend: str
    ep_group: Any = None
    expert_dp_group: Any = None
    ep_ranks: tuple[int, ...] = (0,)
    expert_dp_ranks: tuple[int, ...] = (0,)
    dp_shard: int = 0  # ranks a parameter is sharded over (parallel.dp_shard; 0 = the world)
    local_world: int | None = None  # ranks on this node, where the launcher says
    groups: dict = field(default_factory=dict, repr=False)  # this rank's sharding groups (sharding_layout)
    owns_process_group: bool = False  # init_distributed created it, so shutdown destroys it
    group: Any = None  # this mesh's world as a process group (None: the default group, the whole world)
    global_ranks: tuple[int, ...] | None = None  # each rank's number in the whole world (None: the same)
    pp: int = 1  # pipeline stages (parallel.pp)
    pp_rank: int = 0  # this rank's stage
    pp_group: Any = None  # this rank's pipeline: one rank of each stage holding the same data and experts
    pp_ranks: tuple[int, ...] = ()  # its global ranks, stage order
    _stage: "Mesh | None" = field(default=None, repr=False, compare=False)
    _device_meshes: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "Mesh":
        """A world of one: what a plain single-process run uses."""
        # No backend: a world of one runs no collective (and an xpu box without xccl still trains).
        return cls(0, 1, 0, 1, torch.device(device), "none")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def stage(self) -> "Mesh":
        """The mesh a model is built, sharded and updated on: this rank's pipeline stage (module
        doc), or this mesh itself without pipeline stages."""
        return self._stage or self

    @property
    def data_rank(self) -> int:
        """Which share of the global batch this rank reads: its rank within its stage (every
        stage of a pipeline reads the same sequences)."""
        return self.stage.rank

    @property
    def data_world(self) -> int:
        """Ranks that read distinct shares of the global batch: the world over the stages."""
        return self.stage.world_size

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def expert_dp_size(self) -> int:
        return self.world_size // self.ep

    @property
    def expert_dp_rank(self) -> int:
        return self.rank // self.ep

    @property
    def shard_size(self) -> int:
        """Ranks one parameter's rows are sharded over (S of the module doc)."""
        return self.dp_shard or self.world_size

    @property
    def replicas(self) -> int:
        """Blocks of ``shard_size`` ranks that each hold the whole (sharded) model."""
        return self.world_size // self.shard_size

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In place over this mesh's world (a stage mesh: its stage); a no-op in a world of one."""
        if self.distributed:
            dist.all_reduce(t, group=self.group)
        return t

    def all_reduce_pipeline_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In place over this rank's pipeline (one rank per stage: the stages' disjoint parts of
        one model); a no-op without pipeline stages."""
        if self.pp > 1:
            dist.all_reduce(t, group=self.pp_group)
        return t

    def all_max(self, values: list[float]) -> list[float]:
        """The element-wise maximum of ``values`` over this mesh's world (a collective; one small
        all-reduce on this rank's device): how the ranks agree on a flag or a step."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def device_meshes(self):
        """{"world", "grid", "dense", "experts"}: torch DeviceMeshes over the same ranks as this
        mesh's groups, made once (collective: every rank calls it, in the same order). ``world``
        is 1-D over every rank; ``grid`` is (ep, expert_dp) with ``grid[i, j]`` = rank ``j * ep +
        i``, so ``grid["ep"]`` is this rank's EP group and ``grid["expert_dp"]`` its expert-dp
        group. ``dense`` and ``experts`` are what the dense and the expert parameters are sharded
        on: ``world`` and ``grid`` when one block shards over every rank; with HSDP replicas
        (parallel.dp_shard) ``dense`` is (replicate, shard) and ``experts`` (ep, replicate,
        shard), as sharding_layout lays the ranks out. Placements (Shard(0), Shard(0)) on
        ``grid`` cut dim 0 into EP blocks first, then each block over expert-dp: how an expert
        weight's rows are laid out (optimus_core.parallel.layout)."""
        if self._device_meshes is None:
            from torch.distributed.device_mesh import DeviceMesh

            W, S, ep = self.world_size, self.shard_size, self.ep
            ranks = torch.tensor(self.global_ranks) if self.global_ranks is not None else torch.arange(W)
            world = DeviceMesh.from_group(self.group or dist.group.WORLD, self.device.type,
                                          mesh=ranks if self.global_ranks is not None else None,
                                          mesh_dim_names=("world",))
            if self.pp > 1 and self._stage is not None:  # the whole world of a pipeline: no groups of its own
                self._device_meshes = {"world": world}
                return self._device_meshes
            grid = DeviceMesh.from_group([self.ep_group, self.expert_dp_group], self.device.type,
                                         mesh=ranks.reshape(W // ep, ep).T.contiguous(),
                                         mesh_dim_names=("ep", "expert_dp"))
            meshes = {"world": world, "grid": grid}
            if self.replicas > 1:  # hybrid: (replicate, shard) for the dense units, (ep, replicate, shard) for experts
                g = self.groups
                meshes["dense"] = DeviceMesh.from_group([g["replicate"], g["shard"]], self.device.type,
                                                        mesh=ranks.reshape(W // S, S),
                                                        mesh_dim_names=("replicate", "shard"))
                meshes["experts"] = DeviceMesh.from_group(
                    [self.ep_group, g["replicate"], g["expert_shard"]], self.device.type,
                    mesh=ranks.reshape(W // S, S // ep, ep).permute(2, 0, 1).contiguous(),
                    mesh_dim_names=("ep", "replicate", "shard"))
            else:
                meshes["dense"], meshes["experts"] = world, grid
            self._device_meshes = meshes
        return self._device_meshes


def init_distributed(parallel: ParallelConfig, n_experts: int | None = None, device: str = "auto",
                     env: Mapping[str, str] | None = None, intel_extension: bool = False) -> Mesh:
    """Read the launcher, validate, join the world and build the groups (every rank, same order).
    ``intel_extension``: the run's execution.intel_extension (optimus_core.device), one rank or many."""
    launch = read_launch_env(env)
    pipeline_layout(launch.world_size, parallel.pp, parallel.ep)  # these raise on every rank, before any collective
    group_layout(launch.world_size // parallel.pp, parallel.ep, n_experts, parallel.dp_shard)
    check_rendezvous(launch)
    dev = bind_device(device, launch, env)
    device_type = dev.type
    if launch.world_size == 1:
        import_vendor_extensions(device_type, "none", intel_extension)
        return Mesh.single(dev)
    backend = collective_backend(device_type)
    import_vendor_extensions(device_type, backend, intel_extension)
    mesh = Mesh(launch.rank, launch.world_size, launch.local_rank, parallel.ep, dev, backend, dp_shard=parallel.dp_shard,
                local_world=launch.local_world, pp=parallel.pp)
    timeout = datetime.timedelta(seconds=parallel.collective_timeout_s)
    if not dist.is_initialized():
        mesh.owns_process_group = True
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", launch.master_port)
        # A collective that waits longer than parallel.collective_timeout_s for a dead or stuck
        # rank raises on the ranks that wait, instead of hanging the job until its walltime.
        dist.init_process_group(backend, init_method="env://", rank=launch.rank, world_size=launch.world_size,
                                device_id=dev if device_type != "cpu" else None,
                                timeout=timeout)
    if not parallel.ep_across_nodes:
        check_node_local(mesh)
    return build_groups(mesh, timeout)


def node_local_problem(ep: int, rank: int, local_rank: int, local_world: int | None) -> str | None:
    """Why this rank's EP group (consecutive ranks) would not sit on its node, or None (also
    where the launcher does not say how many ranks a node has: nothing to check)."""
    if ep == 1 or not local_world:
        return None
    if local_world % ep:
        spans = -(-ep // local_world) if ep > local_world else 2
        return f"an EP group of {ep} consecutive ranks spans {spans} nodes of {local_world} ranks"
    if rank % local_world != local_rank:
        return (f"the launcher placed rank {rank} as local rank {local_rank} of {local_world}: consecutive ranks "
                f"are not on one node (the launcher must place ranks in blocks of a node's), so EP groups would "
                f"span nodes")
    return None


def check_node_local(mesh: Mesh) -> None:
    """ConfigError on every rank where any rank's EP group would span nodes (node_local_problem;
    one small all-reduce over the world, before any group is built)."""
    problem = node_local_problem(mesh.ep, mesh.rank, mesh.local_rank, mesh.local_world)
    if mesh.all_max([float(problem is not None)])[0]:
        where = problem or "another rank's EP group spans nodes"
        raise ConfigError(f"parallel.ep = {mesh.ep}: {where}; its expert exchange would cross the network. Choose an "
                          f"ep that divides the ranks of a node, or set parallel.ep_across_nodes=true to run it so")


def bind_device(requested: str, launch: LaunchEnv, env: Mapping[str, str] | None = None) -> torch.device:
    """This rank's device: the CPU, or its own accelerator of the node (optimus_core.device
    binding_index: one visible device, else the one at its local rank), made current.

    A rank that does not see the device it should -- an explicit ``cuda`` / ``xpu`` that this
    process cannot see, or too few devices for the ranks of its node -- stops with a
    DeviceBindingError naming its host, rank, visibility variables and devices, before any
    collective. ``auto`` with several ranks and no accelerator trains on the CPU and says so
    (rank 0, one line): a site that has accelerators names its device type (site.device), so
    that its jobs never fall back to the CPU."""
    env = os.environ if env is None else env
    try:
        device_type = resolve_device_type(requested)
    except RuntimeError:  # an explicit cuda / xpu this process cannot see: say where and what it sees
        binding_index(requested, launch.local_rank, launch.local_world, [], rank=launch.rank, env=env)
        raise
    if device_type == "cpu":
        if requested == "auto" and launch.world_size > 1:
            _log.info("device auto: no cuda or xpu device visible; %d ranks train on the CPU (gloo)",
                      launch.world_size)
        return torch.device("cpu")
    names = visible_devices(device_type)
    index = binding_index(device_type, launch.local_rank, launch.local_world, names, rank=launch.rank, env=env)
    dev = torch.device(device_type, index)
    getattr(torch, device_type).set_device(dev)
    return dev


def build_groups(mesh: Mesh, timeout: datetime.timedelta | None = None) -> Mesh:
    """Create every EP, expert-dp and (with replicas) sharding group on every rank, in one order
    (new_group is collective); with pipeline stages, every stage's groups and the pipelines, and
    this rank's stage mesh (``mesh.stage``). Returns ``mesh``.

    ``timeout``: of every collective in these groups (a subgroup does not inherit the world's:
    without it torch uses its own default)."""
    if mesh.pp == 1:
        _stage_groups(mesh, list(range(mesh.world_size)), mesh.rank, mesh.ep, mesh.dp_shard, timeout)
        return mesh
    stages, pipelines = pipeline_layout(mesh.world_size, mesh.pp, mesh.ep)
    for s, ranks in enumerate(stages):
        group = dist.new_group(ranks, timeout=timeout)
        mine = mesh.rank in ranks
        stage = Mesh(ranks.index(mesh.rank) if mine else 0, len(ranks), mesh.local_rank, mesh.ep, mesh.device,
                     mesh.backend, dp_shard=mesh.dp_shard, local_world=mesh.local_world, group=group,
                     global_ranks=tuple(ranks), pp=mesh.pp, pp_rank=s)
        _stage_groups(stage if mine else None, ranks, mesh.rank, mesh.ep, mesh.dp_shard, timeout)
        if mine:
            mesh._stage, mesh.pp_rank = stage, s
    for ranks in pipelines:
        group = dist.new_group(ranks, timeout=timeout)
        if mesh.rank in ranks:
            mesh.pp_group = mesh._stage.pp_group = group
            mesh.pp_ranks = mesh._stage.pp_ranks = tuple(ranks)
    return mesh


def _stage_groups(mesh: Mesh | None, ranks: list[int], me: int, ep: int, dp_shard: int,
                  timeout: datetime.timedelta | None) -> None:
    """The EP, expert-dp and sharding groups of the world ``ranks`` (global numbers; a stage's,
    or the whole world), made on every rank; kept in ``mesh`` where this rank ``me`` is one of
    them (``mesh``: its mesh, None elsewhere)."""
    ep_groups, expert_dp_groups = group_layout(len(ranks), ep, None, dp_shard)
    layouts = [("ep", ep_groups), ("expert_dp", expert_dp_groups)]
    if (dp_shard or len(ranks)) < len(ranks):  # replicas: the sharding blocks' groups
        layouts += list(sharding_layout(len(ranks), ep, dp_shard).items())
    for kind, layout in layouts:
        for local in layout:
            members = [ranks[i] for i in local]
            group = dist.new_group(members, timeout=timeout)
            if mesh is None or me not in members:
                continue
            if kind == "ep":
                mesh.ep_group, mesh.ep_ranks = group, tuple(members)
            elif kind == "expert_dp":
                mesh.expert_dp_group, mesh.expert_dp_ranks = group, tuple(members)
            else:
                mesh.groups[kind] = group


def shutdown(mesh: Mesh) -> None:
    if mesh.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
