"""Parallelism: process groups and device meshes (dp, ep, expert-dp), token dispatch, expert
parallelism, full sharding (FSDP2, EP-aware) and where each rank's share of a parameter lies.

    from optimus_core.parallel import expert_parallel, init_distributed
    from optimus_core.parallel.sharding import shard_model, materialize
    mesh = init_distributed(cfg.parallel, n_experts=cfg.model.moe.n_experts)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    shard_model(expert_parallel(model, mesh), mesh, dtype="bfloat16")
    materialize(model, mesh, mesh.device, seed=0)

The trainer does all of this through optimus_core.train.build when it runs on more than one
rank; the optimizer over the shares is optimus_core.train.sharded_adamw. Launching:

    optimus pretrain ... --nproc 4 --ep 2                               # 4 local ranks
    torchrun --nproc-per-node 4 -m workflow.cli pretrain ... --ep 2
    mpiexec -n 24 --ppn 12 optimus pretrain ... --ep 12    # in a PBS job: rank 0's host from
                                                           # $PBS_NODEFILE; else export MASTER_ADDR/PORT

Modules: mesh (launcher env, groups, device meshes), dispatch (all-to-all), expert_parallel
(expert_parallel), sharding (FSDP2 units, materialize), layout (each rank's rows), launch (local ranks).
"""
from .expert_parallel import ExpertParallelExperts, expert_parameter_names, expert_parallel
from .mesh import LaunchEnv, Mesh, group_layout, init_distributed, read_launch_env, shutdown

__all__ = ["ExpertParallelExperts", "LaunchEnv", "Mesh", "expert_parameter_names", "group_layout",
           "expert_parallel", "init_distributed", "read_launch_env", "shutdown"]
