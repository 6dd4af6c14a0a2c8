"""How a run executes: resolved once into a plan, applied to the plain model from outside.

    plan = plan_execution(cfg, "cuda", world_size=1)       # plan.py: every choice and its reason
    model = parallelize(model, plan, mesh, cfg.parallel)   # apply.py: kernels, precision,
                                                           # recomputation, EP, sharding, compile
    keep_expert_copies(model, torch.bfloat16)              # weight_copies.py: the optimizer keeps them

Modules: plan (the choices), apply (the one function that applies them), weight_copies (the
experts' bf16 weight copies and where their gradients are).
"""
from .apply import compile_blocks, parallelize, recompute, use_kernels
from .plan import (ExecutionError, ExecutionPlan, check_launch, device_memory_bytes, plan_execution, resolve_choices,
                   resolve_weight_gathers)

__all__ = ["ExecutionError", "ExecutionPlan", "check_launch", "compile_blocks", "device_memory_bytes", "parallelize",
           "plan_execution", "recompute", "resolve_choices", "resolve_weight_gathers", "use_kernels"]
