"""The execution plan: every choice of how a run executes, resolved once, with its reason.

    plan = plan_execution(cfg, "cuda", world_size=1)   # probes the device's kernels (optimus_kernels.selfcheck)
    print(plan.describe())                             # one line per choice and why
    plan.dtype, plan.experts, plan.compile, plan.adamw, plan.lm_loss, plan.qk_norm_rope, ...
    plan_execution(cfg, "xpu", world_size=12288, probe=False)   # planned for a device not here

The config's execution section (optimus_core.config.ExecutionConfig) says what a user asked for;
this module alone turns it, with the device, the world size and the memory model
(optimus_core.memory), into what runs. Every rule of how the choices interact is here:

- dtype: bfloat16 on a GPU, float32 on a CPU; under bf16 the residual stream in bf16 too, unless
  fp32_residual asks for float32.
- experts: triton where its kernels passed their self-check on the device; else torch where
  torch._grouped_mm has its fast path (CUDA sm90+, bf16); else the loop. With triton, the
  expert GEMMs' kernel family is the fastest the device has (optimus_kernels.grouped_mm.family_on):
  warp-specialized on Hopper, TMA on other NVIDIA sm90+ GPUs, the tensor-descriptor kernels on
  Intel XPU, the pointer kernels elsewhere.
- compile: on for one process on CUDA, where it was measured faster (bench/NOTES.md); off
  elsewhere (on XPU and under FSDP2 it has not been measured yet).
- adamw, lm_loss, qk_norm_rope: the Triton kernel on a GPU where it passed its self-check, else
  torch (qk_norm_rope: torch for a model without QK-norm).
- the experts' bf16 weight copies, which the optimizer keeps current so the forward does not cast:
  one process under bf16 without recast_expert_weights (sharded units are gathered in bf16).
- the expert gradients in bf16 on those copies: with the copies, the Triton AdamW (which widens
  them as it reads) and one micro-batch per step (micro-batches would add up in bf16).
- the clip's gradient norm under the backward (a side stream): one process on CUDA with
  clipping; its expert terms from the dW kernel's sums of squares with the triton experts.
- the update beside the next forward: one process on CUDA with the Triton AdamW.
- the expert exchange (EP > 1): the paper's all-gather / reduce-scatter on XPU, where oneCCL's
  variable all-to-all fails with empty splits (ALCF's AuroraBugTracking #111), and for a run
  that asks for it; the all-to-all elsewhere, which moves fewer bytes (not measured against the
  other on a GPU yet), and wherever a capacity factor drops tokens (the paper's is dropless).
- activation checkpointing: "auto" is the least recomputation whose estimate fits the budget with
  the memory model's error to spare (optimus_core.memory.FIT_MARGIN), else the least that fits.
- weight gathers (several ranks): "auto" is once a step where a rank accumulates micro-batches and
  that estimate, with the whole gathered share and its accumulated gradients, fits the budget
  with the same margin; else in every micro-batch.

An explicit choice the device cannot run is one ExecutionError naming the choice and the reason;
under "auto" the next choice is taken and the plan's line says why.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..config import ConfigError, RunConfig
from ..memory import GIB, check_run, device_budget

GPU_TYPES = ("cuda", "xpu")


class ExecutionError(ConfigError):
    """An explicit execution choice this device cannot run; the message names both."""


@dataclass(frozen=True)
class ExecutionPlan:
    """What a run of one config executes with, on ``world_size`` ranks of ``device_type``."""

    device_type: str
    world_size: int
    dtype: str  # "float32" | "bfloat16" (autocast, float32 master weights)
    residual_dtype: str  # the blocks' inputs and outputs: "float32" | "bfloat16"
    experts: str | None  # "loop" | "torch" | "triton"; None: a dense model
    expert_gemms: str | None  # triton experts: their GEMMs' kernel family (optimus_kernels.grouped_mm.FAMILIES)
    compile: bool
    adamw: str  # "torch" | "triton"
    lm_loss: str  # "torch" | "triton"
    qk_norm_rope: str  # "torch" | "triton"
    recast_expert_weights: bool
    expert_copies: bool  # bf16 copies of the expert weights, written by the optimizer
    bf16_expert_grads: bool  # the expert gradients on those copies, in bf16
    grad_norm_under_backward: bool
    grad_norm_from_dw: bool
    update_beside_forward: bool
    expert_exchange: str | None = None  # EP > 1: "all_to_all" | "all_gather" (parallel.expert_parallel)
    weight_gathers: str | None = None  # several ranks: "per_micro_batch" | "per_step" (parallel.sharding)
    pipeline: str | None = None  # pipeline stages (parallel.pp > 1): stages, schedule, micro-batches
    checkpointing: tuple[str, int] = ("none", 1)  # (mode, every)
    memory: object | None = None  # optimus_core.memory.MemoryEstimate per rank
    budget_bytes: float | None = None
    why: dict = field(default_factory=dict)  # choice -> the reason it was made

    @property
    def warnings(self) -> list[str]:
        """Where "auto" left a Triton kernel out because it failed its self-check on this device:
        the run then computes with another kernel than the one planned for it (on Aurora, the
        paper's kernels would not be the ones measured), which is said, not swapped in silence."""
        chosen = {"experts": self.experts, "adamw": self.adamw, "lm_loss": self.lm_loss,
                  "qk_norm_rope": self.qk_norm_rope}
        return [f"{name}: the Triton kernel failed its self-check on this device, so this run uses {chosen[name]} "
                f"instead; it is not the experiment planned ({why.split('self-check on this device: ', 1)[-1]})"
                for name, why in self.why.items() if name in chosen and why.startswith("auto:")
                and "failed its self-check" in why]

    def describe(self) -> str:
        """The plan for people: one line per choice, with its reason."""
        mode, every = self.checkpointing
        rows = [("dtype", self.dtype), ("residual stream", self.residual_dtype),
                ("experts", self.experts or "none (dense)"),
                ("compile", "on" if self.compile else "off"), ("adamw", self.adamw), ("lm_loss", self.lm_loss),
                ("qk_norm_rope", self.qk_norm_rope),
                ("expert weights", "recast in each GEMM" if self.recast_expert_weights else
                 "bf16 copies kept by the optimizer" if self.expert_copies else "as they are"),
                ("expert gradients", "bf16 on the copies" if self.bf16_expert_grads else "float32"),
                ("clip norm", "under the backward" + (", experts' from the dW kernel" if self.grad_norm_from_dw
                                                      else "") if self.grad_norm_under_backward else "after the backward"),
                ("update", "beside the next forward" if self.update_beside_forward else "after the backward"),
                *((("expert exchange", self.expert_exchange.replace("_", "-")),) if self.expert_exchange else ()),
                *((("weight gathers", self.weight_gathers.replace("_", " ")),) if self.weight_gathers else ()),
                *((("pipeline", self.pipeline),) if self.pipeline else ()),
                ("activation checkpointing", mode + (f" (every {every})" if mode == "full" and every > 1 else ""))]
        if self.experts == "triton":
            family = (self.expert_gemms or "decided when the run starts").replace("_", "-")
            rows.insert(3, ("expert GEMMs", family))
        if self.memory is not None:
            budget = f" of {self.budget_bytes / GIB:.1f} GiB" if self.budget_bytes else " (no budget known)"
            rows.append(("memory per rank", self.memory.describe() + budget))
        rows += [("WARNING", w) for w in self.warnings]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" + (f"  ({self.why[name]})" if self.why.get(name) else "")
                         for name, value in rows)

    def to_dict(self) -> dict:
        """For meta.json and the results store: every choice and its reason, plain values."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("memory", "why")}
        out["checkpointing"] = list(self.checkpointing)
        out["memory_gib"] = self.memory.peak_gib if self.memory is not None else None
        out["why"] = dict(self.why)
        out["warnings"] = self.warnings
        return out


def _kernel_ok(kernel: str, device: torch.device, probe: bool) -> str | None:
    """None if the Triton ``kernel`` family may run on ``device``, else why not (probe: run its
    self-check now, optimus_kernels.selfcheck; else assume a GPU's kernels will pass at run time)."""
    from optimus_kernels._triton import INTERPRET, launchable_on

    if device.type not in GPU_TYPES and not INTERPRET:
        return (f"cannot run here: no Triton on {device.type} (it needs a CUDA or XPU device, or the Triton "
                f"interpreter: TRITON_INTERPRET=1 set before Python starts)")
    if not probe:
        return None
    if not launchable_on(device):
        return f"Triton cannot launch on {device.type} here (is the triton package installed?)"
    from optimus_kernels.selfcheck import failure

    why = failure(kernel, device)
    return f"failed its self-check on this device: {why}" if why else None


def _grouped_mm_ok(device: torch.device, dtype: str, probe: bool) -> str | None:
    """None if torch._grouped_mm has its fast path for a run in ``dtype`` on ``device``."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if device.type != "cuda":
        return f"torch._grouped_mm's fast path is CUDA only, not {device.type}"
    if dtype != "bfloat16":
        return "torch._grouped_mm's fast path needs bfloat16"
    if probe:
        if torch.version.cuda is None or not torch.cuda.is_available():
            return "no NVIDIA CUDA device here"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:
            return f"torch._grouped_mm's fast path needs compute capability 9.0+, got {major}.{minor}"
    return None


def _triton_or_torch(name: str, asked: str, kernel: str, device: torch.device, probe: bool,
                     why: dict) -> str:
    """An "auto" | "torch" | "triton" choice of a kernel with a torch fallback, resolved."""
    gpu = device.type in GPU_TYPES
    if asked == "torch":
        why[name] = "asked"
        return "torch"
    problem = _kernel_ok(kernel, device, probe) if (gpu or asked == "triton") else f"torch on {device.type}"
    if asked == "triton":
        if problem:
            raise ExecutionError(f"execution.{name} = 'triton': the Triton {kernel} kernel {problem}; "
                                 "use 'auto' or 'torch'")
        why[name] = "asked"
        return "triton"
    if problem:
        why[name] = f"auto: {problem}" if not gpu else f"auto: the Triton kernel {problem}"
        return "torch"
    why[name] = "auto: validated on this device" if probe else "auto: planned; checked when the run starts"
    return "triton"


def resolve_choices(cfg: RunConfig, device: torch.device | str, world_size: int = 1, *,
                    probe: bool = True, ranks_per_node: int | None = None) -> ExecutionPlan:
    """The plan of ``cfg`` without its memory part (checkpointing unresolved, no estimate).
    ``ranks_per_node``: where known (a launcher, a site), the plan says whether an EP group's
    exchange stays on a node. With pipeline stages (parallel.pp) every choice below is a stage's,
    made for the world_size / pp ranks it is built, sharded and updated on."""
    device = torch.device(device)
    if device.type == "meta":  # shapes only: plan as for the GPU they stand for
        device, probe = torch.device("cuda"), False
    ex, why = cfg.execution, {}
    gpu = device.type in GPU_TYPES
    stage_world = cfg.parallel.stage_world(world_size)
    one_process = stage_world == 1

    dtype = ex.dtype
    if dtype == "auto":
        dtype = "bfloat16" if gpu else "float32"
        why["dtype"] = "auto: bf16 autocast on a GPU, float32 master weights" if gpu else "auto: float32 on a CPU"
    else:
        why["dtype"] = "asked"

    residual = "float32" if dtype == "float32" or ex.fp32_residual else dtype
    if dtype != "float32":
        why["residual stream"] = ("asked (execution.fp32_residual)" if ex.fp32_residual else
                                  "the compute dtype, as OLMo-core's FSDP recipe for OLMoE keeps it")

    experts = None
    if cfg.model.moe is not None:
        if ex.experts == "triton":
            problem = _kernel_ok("experts", device, probe)
            if problem:
                others = "'auto', 'torch' or 'loop'" if device.type == "cuda" else "'auto' or 'loop'"
                raise ExecutionError(f"execution.experts = 'triton': the Triton experts kernel {problem}; "
                                     f"use {others}")
            experts, why["experts"] = "triton", "asked"
        elif ex.experts == "torch":
            problem = _grouped_mm_ok(device, dtype, probe)
            if problem:
                others = "'auto', 'triton' or 'loop'" if gpu else "'auto' or 'loop'"
                raise ExecutionError(f"execution.experts = 'torch': {problem}; use {others}")
            experts, why["experts"] = "torch", "asked"
        elif ex.experts == "loop":
            experts, why["experts"] = "loop", "asked"
        else:
            problem = _kernel_ok("experts", device, probe) if gpu else f"no Triton experts on {device.type}"
            if problem is None:
                experts = "triton"
                why["experts"] = ("auto: validated on this device" if probe
                                  else "auto: planned; checked when the run starts")
            elif _grouped_mm_ok(device, dtype, probe) is None:
                experts, why["experts"] = "torch", f"auto: the Triton experts {problem}" if gpu else f"auto: {problem}"
            else:
                experts, why["experts"] = "loop", (f"auto: the Triton experts {problem}" if gpu else f"auto: {problem}") \
                    + "; no torch._grouped_mm fast path"

    if ex.compile == "auto":
        compile_on = device.type == "cuda" and one_process
        why["compile"] = ("auto: measured faster on one CUDA GPU" if compile_on else
                          "auto: off on a CPU" if not gpu else
                          "auto: not measured on XPU yet" if device.type == "xpu" else
                          "auto: not measured under FSDP2 yet")
    else:
        compile_on, why["compile"] = bool(ex.compile), "asked"

    adamw = _triton_or_torch("adamw", ex.adamw, "adamw", device, probe, why)
    lm_loss = _triton_or_torch("lm_loss", ex.lm_loss, "cross_entropy", device, probe, why)
    if cfg.model.qk_norm:
        qk_norm_rope = _triton_or_torch("qk_norm_rope", ex.qk_norm_rope, "qk_norm_rope", device, probe, why)
    elif ex.qk_norm_rope == "triton":
        raise ExecutionError("execution.qk_norm_rope = 'triton': the model has no QK-norm (model.qk_norm = false), "
                             "which the kernel applies; use 'auto' or 'torch'")
    else:
        qk_norm_rope, why["qk_norm_rope"] = "torch", "the model has no QK-norm (RoPE alone, by torch ops)"

    gemms = _gemm_family(device, probe, why) if experts == "triton" else None
    bf16, moe = dtype == "bfloat16", cfg.model.moe is not None
    recast = bool(ex.recast_expert_weights and moe and bf16)
    if ex.recast_expert_weights and not recast:
        why["expert weights"] = "recast_expert_weights has no effect: " + ("a dense model" if not moe else "float32")
    copies = bf16 and moe and one_process and not recast
    if moe and bf16 and not one_process:
        why["expert weights"] = "sharded units are gathered in bf16"
    per_rank = cfg.train.global_batch // max(1, stage_world)
    one_micro_batch = cfg.train.micro_batch in (0, per_rank)
    bf16_grads = copies and adamw == "triton" and one_micro_batch
    if copies and not bf16_grads:
        why["expert gradients"] = ("torch's AdamW takes float32 gradients" if adamw != "triton"
                                   else "several micro-batches would add up in bf16")
    norm_under = device.type == "cuda" and one_process and cfg.optim.grad_clip is not None
    from_dw = norm_under and experts == "triton"
    beside = device.type == "cuda" and one_process and adamw == "triton"
    if not norm_under:
        why["clip norm"] = ("no clipping" if cfg.optim.grad_clip is None else
                            "the sharded optimizer's own pass" if not one_process else "needs a CUDA side stream")
    if not beside:
        why["update"] = ("the sharded optimizer's own step" if not one_process else
                         "needs the Triton AdamW" if adamw != "triton" else "needs a CUDA side stream")
    exchange = _expert_exchange(cfg, device, stage_world, ranks_per_node, why)
    gathers = None
    if stage_world > 1:  # "auto" is per_micro_batch until plan_execution finds per_step fits
        gathers = "per_micro_batch" if ex.weight_gathers == "auto" else ex.weight_gathers
        why["weight gathers"] = "asked" if ex.weight_gathers != "auto" else "auto: one micro-batch a step"
    return ExecutionPlan(device_type=device.type, world_size=world_size, dtype=dtype, residual_dtype=residual,
                         experts=experts, expert_gemms=gemms,
                         compile=compile_on, adamw=adamw, lm_loss=lm_loss, qk_norm_rope=qk_norm_rope,
                         recast_expert_weights=recast,
                         expert_copies=copies, bf16_expert_grads=bf16_grads, grad_norm_under_backward=norm_under,
                         grad_norm_from_dw=from_dw, update_beside_forward=beside, expert_exchange=exchange,
                         weight_gathers=gathers, pipeline=_pipeline(cfg, per_rank, why), why=why)


def _pipeline(cfg: RunConfig, per_rank: int, why: dict) -> str | None:
    """The pipeline line of the plan, with its bubble as the reason, or None without stages."""
    pp = cfg.parallel.pp
    if pp == 1:
        return None
    micro = cfg.train.micro_batch or per_rank
    m = max(1, per_rank // micro)
    chunks = cfg.parallel.pp_chunks
    cfg.parallel.check_micro_batches(m)
    layers = [stop - first for first, stop in cfg.parallel.stage_layers(cfg.model.n_layers)]
    cut = (f"{layers[0]} layer{'s' if layers[0] > 1 else ''} each" if len(set(layers)) == 1
           else "layers " + "+".join(map(str, layers)))
    # the bubble: pp - 1 of a rank's stage times, each 1 / chunks of its micro-batch time
    span = chunks * m + pp - 1
    why["pipeline"] = (f"idle {pp - 1}/{span} = {(pp - 1) / span:.0%} of the step (the bubble)"
                       + (": fewer micro-batches than stages" if m < pp else ""))
    stages = f"{pp} stages" if chunks == 1 else f"{pp} ranks x {chunks} stages"
    return (f"{stages} ({cut}), {cfg.parallel.pp_schedule}, {m} micro-batch{'es' if m > 1 else ''} of "
            f"{micro} sequence{'s' if micro > 1 else ''}")


def check_launch(cfg: RunConfig, world_size: int = 1) -> str:
    """What can be checked of how ``cfg`` executes before any rank starts or any model is built:
    train.device is visible to this process (optimus_core.device.DeviceUnavailableError, an
    environment problem), and every explicit choice can run on that device (ExecutionError, a
    configuration one; the kernels' self-checks wait for the run, which probes them). Returns the
    device type. The run resolves its plan again, whole (plan_execution); this only fails earlier."""
    from ..device import resolve_device_type

    device_type = resolve_device_type(cfg.train.device, field="train.device")
    resolve_choices(cfg, device_type, world_size, probe=False)
    return device_type


def plan_execution(cfg: RunConfig, device: torch.device | str, world_size: int = 1, *,
                   budget_bytes: float | None | str = "device", probe: bool = True,
                   run: str | None = None, ranks_per_node: int | None = None) -> ExecutionPlan:
    """The whole plan of ``cfg`` on ``world_size`` ranks of ``device`` (module doc), activation
    checkpointing resolved and the run checked against ``budget_bytes`` (default:
    execution.memory_budget_gib, else the usable share of the device's memory when ``probe``;
    None: unchecked); ``ranks_per_node`` as resolve_choices. MemoryBudgetError, naming the run,
    the GiB, the budget and what would help, before anything is allocated; ExecutionError for a
    choice the device cannot run."""
    plan = resolve_choices(cfg, device, world_size, probe=probe, ranks_per_node=ranks_per_node)
    if budget_bytes == "device":
        chosen = cfg.execution.memory_budget_gib
        if chosen is not None:
            budget_bytes = chosen * GIB
        else:
            budget_bytes = device_budget(device_memory_bytes(torch.device(device))) if probe else None
    checkpointing, est = check_run(cfg, world_size, plan, budget_bytes, run=run or cfg.preset or "this run")
    why = dict(plan.why)
    if cfg.execution.weight_gathers == "auto" and cfg.parallel.stage_world(world_size) > 1:
        plan, est, why["weight gathers"] = resolve_weight_gathers(cfg, world_size, plan, checkpointing, est,
                                                                  budget_bytes)
    asked = cfg.execution.activation_checkpointing
    why["activation checkpointing"] = ("asked" if asked != "auto" else
                                       "auto: the least recomputation that fits" if budget_bytes else
                                       "auto: no memory budget known")
    return dataclasses.replace(plan, checkpointing=checkpointing, memory=est, budget_bytes=budget_bytes, why=why)


def _expert_exchange(cfg: RunConfig, device: torch.device, world_size: int, ranks_per_node: int | None,
                     why: dict) -> str | None:
    """How tokens cross an EP group (module doc), or None where no EP group exchanges any."""
    ep, moe, asked = cfg.parallel.ep, cfg.model.moe, cfg.execution.expert_exchange
    if moe is None or ep == 1 or world_size == 1:
        return None
    if asked != "auto":
        exchange, reason = asked, "asked"
    elif moe.capacity_factor is not None:
        exchange, reason = "all_to_all", "auto: a capacity factor drops tokens; the paper's exchange is dropless"
    elif device.type == "xpu":
        exchange, reason = "all_gather", ("auto: the paper's; oneCCL's variable all-to-all fails with empty splits "
                                          "(ALCF's AuroraBugTracking #111)")
    else:
        exchange, reason = "all_to_all", ("auto: each token only to the ranks of its experts, fewer bytes than "
                                          "gathering every token on every rank; the two not measured here")
    if ranks_per_node:
        reason += (f"; one EP group of {ep} on a node of {ranks_per_node} ranks" if ep <= ranks_per_node else
                   f"; an EP group of {ep} spans {-(-ep // ranks_per_node)} nodes of {ranks_per_node} ranks: "
                   f"its exchange crosses the network")
    why["expert exchange"] = reason
    return exchange


def resolve_weight_gathers(cfg: RunConfig, world_size: int, plan: ExecutionPlan, checkpointing: tuple[str, int],
                           est, budget_bytes: float | None):
    """(plan, estimate, reason) of weight_gathers "auto": per_step where the rank accumulates
    several micro-batches and the memory model puts it within the budget with its error to
    spare (optimus_core.memory.FIT_MARGIN), else the plan as it is."""
    from ..memory import FIT_MARGIN, MemoryLayout, estimate, heaviest_stage

    layout = MemoryLayout.of_run(cfg, world_size, checkpointing, plan)
    if layout.accumulation == 1:
        return plan, est, "auto: one micro-batch a step"
    if not budget_bytes:
        return plan, est, "auto: no memory budget known to hold the gathered weights"
    per_step = dataclasses.replace(plan, weight_gathers="per_step")
    bigger = estimate(cfg.model, heaviest_stage(cfg.model, MemoryLayout.of_run(cfg, world_size, checkpointing,
                                                                              per_step)))
    if bigger.peak_bytes * (1 + FIT_MARGIN) > budget_bytes:
        return plan, est, (f"auto: the gathered weights would need {bigger.peak_gib:.1f} GiB of the "
                           f"{budget_bytes / GIB:.1f} GiB budget")
    return per_step, bigger, f"auto: {layout.accumulation} micro-batches a step, and it fits"


def _gemm_family(device: torch.device, probe: bool, why: dict) -> str | None:
    """The triton experts' GEMM kernel family on ``device`` (optimus_kernels.grouped_mm.family_on), or
    None for a CUDA GPU planned from its type alone (its compute capability decides)."""
    from optimus_kernels.grouped_mm import family_on

    if device.type == "cuda" and not probe:
        why["expert GEMMs"] = ("planned from the device type: warp-specialized on Hopper, TMA on other sm90+ "
                               "GPUs, the pointer kernels before sm90")
        return None
    family, why["expert GEMMs"] = family_on(device)
    return family


def device_memory_bytes(device: torch.device) -> float | None:
    """The device's total memory, or None where the allocator does not say (a CPU)."""
    if device.type in GPU_TYPES:
        return float(getattr(torch, device.type).get_device_properties(device).total_memory)
    return None
