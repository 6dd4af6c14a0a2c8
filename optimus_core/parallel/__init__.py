"""Parallelism: process groups (dp, ep, expert-dp), token dispatch, the EP-aware sharded optimizer.

    from optimus_core.parallel import init_distributed, parallelize, ShardedAdamW
    mesh = init_distributed(cfg.parallel, n_experts=cfg.model.moe.n_experts)
    model = parallelize(build_model(cfg), mesh)
    opt = ShardedAdamW(model, mesh, cfg.optim, mode=cfg.parallel.optimizer)

The trainer does all of this when it runs on more than one rank. Launching:

    optimus pretrain ... --nproc 4 --ep 2                               # 4 local ranks
    torchrun --nproc-per-node 4 -m workflow.cli pretrain ... --ep 2
    mpiexec -n 24 --ppn 12 optimus pretrain ... --ep 12    # in a PBS job: rank 0's host from
                                                           # $PBS_NODEFILE; else export MASTER_ADDR/PORT

Modules: mesh (launcher env, groups), dispatch (all-to-all), expert_parallel (parallelize),
optimizer (ShardedAdamW), launch (local ranks).
"""
from .expert_parallel import ExpertParallelExperts, expert_parameter_names, full_model_state, parallelize
from .mesh import LaunchEnv, Mesh, group_layout, init_distributed, read_launch_env, shutdown
from .optimizer import ShardedAdamW

__all__ = ["ExpertParallelExperts", "LaunchEnv", "Mesh", "ShardedAdamW", "expert_parameter_names",
           "full_model_state", "group_layout", "init_distributed", "parallelize", "read_launch_env", "shutdown"]
