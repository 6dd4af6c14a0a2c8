"""optimus_core.execution: the execution plan's rules (its module docstring), one test per rule,
and the former names of its choices, refused by name."""
import dataclasses
import re
import json

import pytest
import torch

import optimus_kernels._triton
import optimus_kernels.selfcheck
from optimus_core import presets
from optimus_core.config import (ConfigError, DataConfig, ExecutionConfig, ModelConfig, MoEConfig, OptimConfig,
                                 RunConfig, TrainConfig, apply_overrides)
from optimus_core.execution import ExecutionError, ExecutionPlan, plan_execution, resolve_choices
from optimus_core.memory import GIB, MemoryBudgetError

MOE = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, max_seq_len=64,
                  moe=MoEConfig(n_experts=4, top_k=2, d_expert=16))
DENSE = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)


def run(model=MOE, train=None, optim=None, **execution) -> RunConfig:
    return RunConfig(model=model, data=DataConfig(seq_len=64), train=train or TrainConfig(global_batch=8),
                     optim=optim or OptimConfig(), execution=ExecutionConfig(**execution))


def choices(plan: ExecutionPlan) -> dict:
    return {f: getattr(plan, f) for f in ("dtype", "experts", "compile", "adamw", "lm_loss", "qk_norm_rope",
                                          "recast_expert_weights",
                                          "expert_copies", "bf16_expert_grads", "grad_norm_under_backward",
                                          "grad_norm_from_dw", "update_beside_forward")}


# ----------------------------------------------------------------------------- auto

@pytest.mark.parametrize("interpret", [False, True], ids=["plain", "interpreter"])
def test_auto_on_a_cpu_is_the_plain_torch_path(monkeypatch, interpret):
    """float32, the loop, no compile, torch's AdamW and loss, no copies -- also under the
    interpreter, which is the tests' harness and never chosen by "auto"."""
    monkeypatch.setattr(optimus_kernels._triton, "INTERPRET", interpret)
    plan = resolve_choices(run(), "cpu")
    assert plan.device_type == "cpu" and plan.world_size == 1
    assert choices(plan) == dict(dtype="float32", experts="loop", compile=False, adamw="torch", lm_loss="torch",
                                 qk_norm_rope="torch", recast_expert_weights=False, expert_copies=False, bf16_expert_grads=False,
                                 grad_norm_under_backward=False, grad_norm_from_dw=False, update_beside_forward=False)
    for name in ("dtype", "experts", "compile", "adamw", "lm_loss", "qk_norm_rope"):
        assert plan.why[name].startswith("auto: "), name
    assert plan.why["dtype"] == "auto: float32 on a CPU"
    assert plan.why["compile"] == "auto: off on a CPU"
    assert plan.checkpointing == ("none", 1) and plan.memory is None  # resolve_choices: no memory part


def test_auto_on_one_cuda_gpu_is_the_fast_path():
    """Planned for a GPU not here (probe=False): bf16, the Triton experts, compile, the Triton
    AdamW and loss, the bf16 expert copies with their gradients on them, the clip's norm under the
    backward (its expert terms from the dW kernel) and the update beside the next forward."""
    plan = resolve_choices(run(), "cuda", probe=False)
    assert choices(plan) == dict(dtype="bfloat16", experts="triton", compile=True, adamw="triton", lm_loss="triton",
                                 qk_norm_rope="triton", recast_expert_weights=False, expert_copies=True, bf16_expert_grads=True,
                                 grad_norm_under_backward=True, grad_norm_from_dw=True, update_beside_forward=True)
    assert plan.why["experts"] == plan.why["adamw"] == "auto: planned; checked when the run starts"
    assert plan.why["compile"] == "auto: measured faster on one CUDA GPU"
    assert resolve_choices(run(), torch.device("cuda", 3), probe=False) == plan  # any index


def test_auto_under_fsdp2_compiles_nothing_and_keeps_no_copies():
    plan = resolve_choices(run(), "cuda", world_size=2, probe=False)
    assert plan.world_size == 2
    assert choices(plan) == dict(dtype="bfloat16", experts="triton", compile=False, adamw="triton", lm_loss="triton",
                                 qk_norm_rope="triton", recast_expert_weights=False, expert_copies=False, bf16_expert_grads=False,
                                 grad_norm_under_backward=False, grad_norm_from_dw=False, update_beside_forward=False)
    assert plan.why["compile"] == "auto: not measured under FSDP2 yet"
    assert plan.why["expert weights"] == "sharded units are gathered in bf16"
    assert plan.why["clip norm"] == "the sharded optimizer's own pass"
    assert plan.why["update"] == "the sharded optimizer's own step"


def test_auto_on_xpu_compiles_nothing_and_has_no_side_streams():
    plan = resolve_choices(run(), "xpu", probe=False)
    assert choices(plan) == dict(dtype="bfloat16", experts="triton", compile=False, adamw="triton", lm_loss="triton",
                                 qk_norm_rope="triton", recast_expert_weights=False, expert_copies=True, bf16_expert_grads=True,
                                 grad_norm_under_backward=False, grad_norm_from_dw=False, update_beside_forward=False)
    assert plan.why["compile"] == "auto: not measured on XPU yet"
    assert plan.why["clip norm"] == plan.why["update"] == "needs a CUDA side stream"


def test_a_meta_device_is_planned_as_the_gpu_it_stands_for():
    assert choices(resolve_choices(run(), "meta")) == choices(resolve_choices(run(), "cuda", probe=False))


@pytest.mark.parametrize("micro_batch, bf16_grads", [(0, True), (8, True), (4, False), (1, False)])
def test_bf16_expert_gradients_need_one_micro_batch(micro_batch, bf16_grads):
    """Micro-batches would add up in bf16: the copies stay, their gradients go back to float32."""
    plan = resolve_choices(run(train=TrainConfig(global_batch=8, micro_batch=micro_batch)), "cuda", probe=False)
    assert plan.expert_copies and plan.bf16_expert_grads is bf16_grads
    assert ("expert gradients" in plan.why) is not bf16_grads
    if not bf16_grads:
        assert plan.why["expert gradients"] == "several micro-batches would add up in bf16"


def test_torchs_adamw_takes_float32_gradients_and_runs_after_the_backward():
    plan = resolve_choices(run(adamw="torch"), "cuda", probe=False)
    assert plan.adamw == "torch" and plan.why["adamw"] == "asked"
    assert plan.expert_copies and not plan.bf16_expert_grads and not plan.update_beside_forward
    assert plan.why["expert gradients"] == "torch's AdamW takes float32 gradients"
    assert plan.why["update"] == "needs the Triton AdamW"
    assert plan.grad_norm_under_backward  # the norm does not need the Triton AdamW


def test_the_norm_under_the_backward_needs_clipping_and_from_dw_the_triton_experts():
    plan = resolve_choices(run(optim=OptimConfig(grad_clip=None)), "cuda", probe=False)
    assert not plan.grad_norm_under_backward and not plan.grad_norm_from_dw
    assert plan.why["clip norm"] == "no clipping"
    plan = resolve_choices(run(experts="loop"), "cuda", probe=False)
    assert plan.grad_norm_under_backward and not plan.grad_norm_from_dw


def test_recast_expert_weights_turns_the_copies_off():
    plan = resolve_choices(run(recast_expert_weights=True), "cuda", probe=False)
    assert plan.recast_expert_weights and not plan.expert_copies and not plan.bf16_expert_grads
    # where nothing is cast it does nothing, and the plan says so
    plan = resolve_choices(run(recast_expert_weights=True), "cpu")
    assert not plan.recast_expert_weights and not plan.expert_copies
    assert plan.why["expert weights"] == "recast_expert_weights has no effect: float32"
    dense = resolve_choices(run(DENSE, recast_expert_weights=True), "cuda", probe=False)
    assert not dense.recast_expert_weights and dense.why["expert weights"] == "recast_expert_weights has no effect: a dense model"


def test_a_dense_model_has_no_experts_to_plan():
    plan = resolve_choices(run(DENSE), "cuda", probe=False)
    assert plan.experts is None and "experts" not in plan.why
    assert not plan.expert_copies and not plan.bf16_expert_grads and not plan.grad_norm_from_dw
    assert plan.grad_norm_under_backward and plan.update_beside_forward and plan.dtype == "bfloat16"
    assert resolve_choices(run(DENSE, experts="triton"), "cpu").experts is None  # nothing to ask for
    assert "none (dense)" in plan.describe()


def test_a_model_without_qk_norm_has_rope_alone_by_torch():
    """The kernel applies QK-norm and RoPE together: a model without QK-norm keeps torch's RoPE
    under auto, and an explicit 'triton' is an error naming the model field."""
    no_norm = MOE.replace(qk_norm=False)
    plan = resolve_choices(run(no_norm), "cuda", probe=False)
    assert plan.qk_norm_rope == "torch" and plan.why["qk_norm_rope"].startswith("the model has no QK-norm")
    with pytest.raises(ExecutionError, match=r"^execution\.qk_norm_rope = 'triton': the model has no QK-norm "
                                             r"\(model\.qk_norm = false\)"):
        resolve_choices(run(no_norm, qk_norm_rope="triton"), "cuda", probe=False)


# ----------------------------------------------------------------------------- explicit choices

def test_explicit_choices_win_and_are_marked_asked():
    asked = dict(dtype="float32", experts="loop", compile=False, adamw="torch", lm_loss="torch", qk_norm_rope="torch")
    plan = resolve_choices(run(**asked), "cuda", probe=False)
    assert {k: getattr(plan, k) for k in asked} == asked
    assert all(plan.why[k] == "asked" for k in asked)
    assert not plan.expert_copies  # float32: nothing to copy
    cpu = resolve_choices(run(dtype="bfloat16", compile=True), "cpu")
    assert (cpu.dtype, cpu.compile) == ("bfloat16", True) and cpu.why["dtype"] == cpu.why["compile"] == "asked"
    assert cpu.expert_copies and not cpu.bf16_expert_grads  # torch's AdamW on a CPU
    torch_experts = resolve_choices(run(experts="torch"), "cuda", probe=False)
    assert torch_experts.experts == "torch" and torch_experts.why["experts"] == "asked"


def test_torch_experts_in_float32_on_cuda_are_refused_naming_the_choice():
    with pytest.raises(ExecutionError, match=r"^execution\.experts = 'torch': .*use 'auto', 'triton' or 'loop'"):
        resolve_choices(run(experts="torch", dtype="float32"), "cuda", probe=False)
    with pytest.raises(ExecutionError, match=r"^execution\.experts = 'torch': .*CUDA only, not cpu"):
        resolve_choices(run(experts="torch", dtype="bfloat16"), "cpu")
    assert issubclass(ExecutionError, ConfigError)  # the CLI reports it as any bad config


@pytest.mark.parametrize("choice, kernel", [("adamw", "adamw"), ("lm_loss", "cross_entropy"), ("experts", "experts"),
                                           ("qk_norm_rope", "qk_norm_rope")])
def test_explicit_triton_on_a_cpu_needs_the_interpreter(monkeypatch, choice, kernel):
    monkeypatch.setattr(optimus_kernels._triton, "INTERPRET", False)
    with pytest.raises(ExecutionError, match=rf"^execution\.{choice} = 'triton': the Triton {kernel} kernel "
                                             r"cannot run here: no Triton on cpu \(it needs a CUDA or XPU device, or "
                                             r"the Triton interpreter: TRITON_INTERPRET=1 set before Python starts\); "
                                             + ("use 'auto' or 'loop'$" if choice == "experts" else "use 'auto' or 'torch'$")):
        resolve_choices(run(**{choice: "triton"}), "cpu")
    monkeypatch.setattr(optimus_kernels._triton, "INTERPRET", True)  # the tests' harness: allowed
    plan = resolve_choices(run(**{choice: "triton"}), "cpu", probe=False)
    assert getattr(plan, choice) == "triton" and plan.why[choice] == "asked"


def test_check_launch_refuses_a_missing_device_and_an_explicit_kernel_it_cannot_run(monkeypatch):
    """Before any rank or model: train.device must be here (an environment error) and every
    explicit choice must run on it (a configuration error); the kernels' self-checks wait."""
    from optimus_core.device import DeviceUnavailableError
    from optimus_core.execution import check_launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(optimus_kernels._triton, "INTERPRET", False)
    monkeypatch.setattr(optimus_kernels.selfcheck, "failure", lambda kernel, device: pytest.fail("no self-check here"))
    with pytest.raises(DeviceUnavailableError, match=r"^train\.device = cuda but no CUDA device is visible"):
        check_launch(run(train=TrainConfig(global_batch=8, device="cuda")))
    with pytest.raises(ExecutionError, match=r"^execution\.experts = 'triton': .*TRITON_INTERPRET=1"):
        check_launch(run(train=TrainConfig(global_batch=8, device="cpu"), experts="triton"), world_size=2)
    assert check_launch(run(train=TrainConfig(global_batch=8, device="auto"))) == "cpu"  # auto: never triton here


# ----------------------------------------------------------------------------- self-checks

@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device whose Triton launches, without torch._grouped_mm's fast path, and whose
    self-check fails for the kernel families in the returned set."""
    failing = set()
    monkeypatch.setattr(optimus_kernels._triton, "INTERPRET", False)
    monkeypatch.setattr(optimus_kernels._triton, "launchable_on", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(optimus_kernels.selfcheck, "failure",
                        lambda kernel, device: f"AssertionError: {kernel} off by 0.5" if kernel in failing else None)
    return failing


def test_kernels_that_pass_their_self_check_are_validated(fake_cuda):
    plan = resolve_choices(run(), "cuda")
    assert (plan.experts, plan.adamw, plan.lm_loss, plan.qk_norm_rope) == ("triton",) * 4
    assert plan.why["experts"] == plan.why["adamw"] == plan.why["lm_loss"] == plan.why["qk_norm_rope"] \
        == "auto: validated on this device"


def test_a_failed_self_check_under_auto_takes_the_next_choice_and_says_why(fake_cuda):
    fake_cuda.update({"experts", "adamw", "cross_entropy", "qk_norm_rope"})
    plan = resolve_choices(run(), "cuda")
    assert (plan.experts, plan.adamw, plan.lm_loss, plan.qk_norm_rope) == ("loop", "torch", "torch", "torch")
    assert "AssertionError: qk_norm_rope off by 0.5" in plan.why["qk_norm_rope"]
    assert "failed its self-check on this device: AssertionError: experts off by 0.5" in plan.why["experts"]
    assert "no torch._grouped_mm fast path" in plan.why["experts"]
    assert "AssertionError: adamw off by 0.5" in plan.why["adamw"]
    assert "AssertionError: cross_entropy off by 0.5" in plan.why["lm_loss"]
    # what follows from torch's AdamW follows
    assert plan.expert_copies and not plan.bf16_expert_grads and not plan.update_beside_forward
    adamw_line = next(line for line in plan.describe().splitlines() if line.strip().startswith("adamw"))
    assert adamw_line.strip().startswith("adamw") and "torch  (auto: the Triton kernel failed its self-check" in adamw_line


def test_only_the_failing_family_falls_back(fake_cuda):
    fake_cuda.add("adamw")
    plan = resolve_choices(run(), "cuda")
    assert (plan.experts, plan.adamw, plan.lm_loss, plan.qk_norm_rope) == ("triton", "torch", "triton", "triton")
    assert plan.grad_norm_from_dw and not plan.update_beside_forward


@pytest.mark.parametrize("choice, kernel", [("adamw", "adamw"), ("lm_loss", "cross_entropy"), ("experts", "experts"),
                                           ("qk_norm_rope", "qk_norm_rope")])
def test_a_failed_self_check_under_explicit_triton_is_an_error(fake_cuda, choice, kernel):
    fake_cuda.add(kernel)
    with pytest.raises(ExecutionError, match=rf"^execution\.{choice} = 'triton': the Triton {kernel} kernel failed its "
                                             rf"self-check on this device: AssertionError: {kernel} off by 0\.5"):
        resolve_choices(run(**{choice: "triton"}), "cuda")


def test_triton_that_cannot_launch_falls_back_under_auto(monkeypatch):
    monkeypatch.setattr(optimus_kernels._triton, "launchable_on", lambda device: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = resolve_choices(run(), "cuda")
    assert (plan.experts, plan.adamw, plan.lm_loss, plan.qk_norm_rope) == ("loop", "torch", "torch", "torch")
    assert "Triton cannot launch on cuda" in plan.why["adamw"]
    with pytest.raises(ExecutionError, match="Triton cannot launch on cuda"):
        resolve_choices(run(adamw="triton"), "cuda")


# ----------------------------------------------------------------------------- the whole plan

ROWS = ["dtype", "residual stream", "experts", "compile", "adamw", "lm_loss", "qk_norm_rope", "expert weights", "expert gradients", "clip norm",
        "update", "activation checkpointing"]


def test_describe_has_one_line_per_choice_with_its_reason():
    plan = resolve_choices(run(adamw="torch"), "cuda", probe=False)
    lines = plan.describe().splitlines()
    rows = ROWS[:3] + ["expert GEMMs"] + ROWS[3:]  # the triton experts' kernel family after them
    assert [line.strip().split("  ")[0] for line in lines] == rows  # "  name<pad>  value  (why)"
    by_name = dict(zip(rows, lines))
    assert "bfloat16" in by_name["dtype"] and "(auto: bf16 autocast" in by_name["dtype"]
    assert by_name["adamw"].rstrip().endswith("torch  (asked)")
    assert "bf16 copies kept by the optimizer" in by_name["expert weights"]
    assert "float32  (torch's AdamW takes float32 gradients)" in by_name["expert gradients"]
    assert "under the backward, experts' from the dW kernel" in by_name["clip norm"]
    whole = plan_execution(run(), "cpu", budget_bytes=None)  # the loop experts: no GEMM family
    lines = whole.describe().splitlines()
    assert len(lines) == len(ROWS) + 1 and "memory per rank" in lines[-1] and "(no budget known)" in lines[-1]


@pytest.mark.parametrize("device, world", [("cpu", 1), ("cuda", 1), ("cuda", 8), ("xpu", 1)])
def test_to_dict_is_plain_json(device, world):
    plan = plan_execution(run(), device, world, budget_bytes=64 * GIB, probe=False)
    out = json.loads(json.dumps(plan.to_dict()))
    assert out["device_type"] == device and out["world_size"] == world
    assert out["checkpointing"] == list(plan.checkpointing) and out["budget_bytes"] == 64 * GIB
    assert out["memory_gib"] == pytest.approx(plan.memory.peak_gib) and out["memory_gib"] > 0
    assert out["why"] == plan.why and out["experts"] == plan.experts and out["compile"] is plan.compile
    assert {f.name for f in dataclasses.fields(ExecutionPlan)} - {"memory"} <= set(out)


def test_plan_execution_resolves_checkpointing_against_the_budget():
    cfg = presets.get("mula-7b-a1b@laptop").run_config(**{"train.global_batch": 4})
    roomy = plan_execution(cfg, "cuda", budget_bytes=None, probe=False)
    assert roomy.checkpointing == ("none", 1) and roomy.budget_bytes is None
    assert roomy.why["activation checkpointing"] == "auto: no memory budget known"
    assert choices(roomy) == choices(resolve_choices(cfg, "cuda", probe=False))  # the same choices
    peak = roomy.memory.peak_bytes
    tight = plan_execution(cfg, "cuda", budget_bytes=peak - 1, probe=False)
    assert tight.checkpointing != ("none", 1) and tight.memory.peak_bytes <= peak - 1
    assert tight.why["activation checkpointing"] == "auto: the least recomputation that fits"
    with pytest.raises(MemoryBudgetError):
        plan_execution(cfg, "cuda", budget_bytes=1.0, probe=False)
    asked = plan_execution(cfg.replace(execution=ExecutionConfig(activation_checkpointing="full",
                                                                 activation_checkpointing_every=2)),
                           "cuda", budget_bytes=None, probe=False)
    assert asked.checkpointing == ("full", 2) and asked.why["activation checkpointing"] == "asked"


def test_plan_execution_takes_the_configured_budget():
    cfg = run(memory_budget_gib=32.0)
    plan = plan_execution(cfg, "cpu")
    assert plan.budget_bytes == 32 * GIB
    assert plan_execution(run(), "cpu").budget_bytes is None  # a CPU's memory is not known
    assert plan_execution(cfg, "cpu", budget_bytes=None).budget_bytes is None  # None: unchecked


# ----------------------------------------------------------------------------- former names

@pytest.mark.parametrize("old, new, value", [
    ("train.dtype", "execution.dtype", "bfloat16"),
    ("train.compile", "execution.compile", False),
    ("model.moe.experts_backend", "execution.experts", "loop"),
    ("optim.implementation", "execution.adamw", "torch"),
    ("train.lm_loss_softmax", "execution.lm_loss", "torch"),
    ("train.recast_expert_weights", "execution.recast_expert_weights", True),
    ("parallel.dispatch", "execution.expert_exchange", "all_gather"),
])
def test_overriding_an_old_name_is_an_error_naming_the_new_one(old, new, value):
    cfg = run()
    with pytest.raises(ConfigError, match=rf"^{old} is now {new} "):
        apply_overrides(cfg, {old: value})
    section, leaf = new.split(".")
    assert getattr(getattr(apply_overrides(cfg, {new: value}), section), leaf) == value


@pytest.mark.parametrize("old", ["train.fused_lm_loss", "train.expert_grad_dtype", "model.moe.weights_before_down"])
def test_overriding_a_removed_choice_is_an_error(old):
    with pytest.raises(ConfigError, match=rf"^{old} is no longer a choice: "):
        apply_overrides(run(), {old: False})


def test_the_residual_stream_follows_the_compute_dtype_unless_asked_for_float32():
    assert resolve_choices(run(), "cuda", probe=False).residual_dtype == "bfloat16"
    assert resolve_choices(run(), "cpu", probe=False).residual_dtype == "float32"  # a float32 run
    asked = resolve_choices(run(fp32_residual=True), "cuda", probe=False)
    assert asked.residual_dtype == "float32" and asked.why["residual stream"].startswith("asked")
    from optimus_core.train.build import build_model

    for fp32 in (False, True):
        plan = resolve_choices(run(fp32_residual=fp32), "cuda", probe=False)
        assert build_model(run(fp32_residual=fp32), device="meta", plan=plan).fp32_residual is fp32


def test_the_expert_gemms_kernel_family_is_the_devices_and_says_why():
    """With the triton experts the plan names their GEMMs' kernel family (optimus_kernels.grouped_mm.
    family_on): an Intel GPU's are the tensor-descriptor kernels; a CUDA GPU planned from its type alone is
    decided when the run starts; without the triton experts there is none."""
    from optimus_core import presets

    cfg = presets.get("mula-7b-a1b").run_config()
    xpu = resolve_choices(cfg, "xpu", probe=False)
    assert xpu.experts == "triton" and xpu.expert_gemms == "descriptor" and "NVIDIA" in xpu.why["expert GEMMs"]
    assert "expert GEMMs" in xpu.describe() and xpu.to_dict()["expert_gemms"] == "descriptor"
    cuda = resolve_choices(cfg, "cuda", probe=False)
    assert cuda.expert_gemms is None and "decided when the run starts" in cuda.describe()
    cpu = resolve_choices(cfg, "cpu")
    assert cpu.experts == "loop" and cpu.expert_gemms is None and "expert GEMMs" not in cpu.describe()


# ----------------------------------------------------------------------------- the expert exchange

def ep_run(ep=2, capacity=None, **execution) -> RunConfig:
    cfg = run(**execution)
    moe = cfg.model.moe.replace(capacity_factor=capacity)
    return cfg.replace(model=cfg.model.replace(moe=moe), parallel=cfg.parallel.replace(ep=ep))


def test_the_paper_exchange_on_xpu_the_all_to_all_elsewhere_and_none_without_an_ep_group():
    xpu = resolve_choices(ep_run(), "xpu", world_size=4, probe=False)
    assert xpu.expert_exchange == "all_gather" and "AuroraBugTracking #111" in xpu.why["expert exchange"]
    assert re.search(r"expert exchange +all-gather", xpu.describe())
    cuda = resolve_choices(ep_run(), "cuda", world_size=4, probe=False)
    assert cuda.expert_exchange == "all_to_all" and "not measured" in cuda.why["expert exchange"]
    assert resolve_choices(ep_run(ep=1), "xpu", world_size=4, probe=False).expert_exchange is None
    assert resolve_choices(run(model=DENSE), "xpu", world_size=4, probe=False).expert_exchange is None
    assert "expert exchange" not in resolve_choices(ep_run(ep=1), "cuda", world_size=4, probe=False).describe()


def test_a_dropping_capacity_keeps_the_all_to_all_and_refuses_the_paper_exchange_by_name():
    plan = resolve_choices(ep_run(capacity=1.25), "xpu", world_size=4, probe=False)
    assert plan.expert_exchange == "all_to_all" and "dropless" in plan.why["expert exchange"]
    with pytest.raises(ConfigError, match=r"^execution.expert_exchange = 'all_gather': .*capacity_factor = null"):
        ep_run(capacity=1.25, expert_exchange="all_gather")
    asked = resolve_choices(ep_run(expert_exchange="all_gather"), "cuda", world_size=4, probe=False)
    assert asked.expert_exchange == "all_gather" and asked.why["expert exchange"] == "asked"


def test_the_plan_says_whether_an_ep_group_stays_on_its_node():
    on_node = resolve_choices(ep_run(ep=2), "xpu", world_size=8, probe=False, ranks_per_node=4)
    assert on_node.why["expert exchange"].endswith("one EP group of 2 on a node of 4 ranks")
    across = resolve_choices(ep_run(ep=4), "xpu", world_size=8, probe=False, ranks_per_node=2)
    assert across.why["expert exchange"].endswith("an EP group of 4 spans 2 nodes of 2 ranks: its exchange "
                                                  "crosses the network")


# ----------------------------------------------------------------------------- weight gathers

def test_weights_are_gathered_once_a_step_where_a_rank_accumulates_and_it_fits():
    cfg = run(train=TrainConfig(global_batch=8, micro_batch=1))  # 4 micro-batches a rank on 2 ranks
    plan = plan_execution(cfg, "cuda", 2, budget_bytes=64 * GIB, probe=False)
    assert plan.weight_gathers == "per_step" and plan.why["weight gathers"].startswith("auto: 4 micro-batches")
    assert re.search(r"weight gathers +per step", plan.describe())
    tight = plan_execution(cfg, "cuda", 2, budget_bytes=plan.memory.peak_bytes * 1.05, probe=False)
    assert tight.weight_gathers == "per_micro_batch" and "would need" in tight.why["weight gathers"]
    unknown = plan_execution(cfg, "cuda", 2, budget_bytes=None, probe=False)
    assert unknown.weight_gathers == "per_micro_batch" and "no memory budget" in unknown.why["weight gathers"]
    one = plan_execution(run(train=TrainConfig(global_batch=2, micro_batch=1)), "cuda", 2, budget_bytes=64 * GIB,
                         probe=False)
    assert one.weight_gathers == "per_micro_batch" and one.why["weight gathers"] == "auto: one micro-batch a step"
    assert plan_execution(cfg, "cuda", 1, budget_bytes=64 * GIB, probe=False).weight_gathers is None
    asked = run(train=TrainConfig(global_batch=8, micro_batch=1), weight_gathers="per_step")
    assert resolve_choices(asked, "cuda", 2, probe=False).weight_gathers == "per_step"


def test_pipeline_stages_gather_once_a_step_where_their_heaviest_stage_fits():
    """Under stages the choice is the heaviest stage's: per step where its estimate (the stage's
    gathered weights and their gradients accumulated whole) fits with the margin, per micro-batch
    where only a lighter stage's would."""
    from optimus_core.config import ParallelConfig
    from optimus_core.memory import FIT_MARGIN, MemoryLayout, estimate, heaviest_stage

    cfg = run(train=TrainConfig(global_batch=8, micro_batch=1)).replace(parallel=ParallelConfig(pp=2))
    plan = plan_execution(cfg, "cuda", 4, budget_bytes=64 * GIB, probe=False)  # 2 stages of 2 ranks, 4 micro-batches
    assert plan.weight_gathers == "per_step" and plan.why["weight gathers"] == "auto: 4 micro-batches a step, and it fits"
    layouts = MemoryLayout.of_run(cfg, 4, plan.checkpointing, plan).stage_layouts()
    peaks = [estimate(cfg.model, L).peak_bytes for L in layouts]
    assert plan.memory.peak_bytes == max(peaks) == estimate(cfg.model, heaviest_stage(cfg.model, layouts[0])).peak_bytes
    assert peaks[0] != peaks[1]  # (the first stage's embedding and the last's head weigh differently)
    per_mb = [estimate(cfg.model, dataclasses.replace(L, gathers="per_micro_batch")).peak_bytes for L in layouts]
    # a budget the lighter stage's per-step estimate fits, the heavier's not
    budget = (min(peaks) + max(peaks)) / 2 * (1 + FIT_MARGIN)
    assert max(per_mb) * (1 + FIT_MARGIN) < budget
    tight = plan_execution(cfg, "cuda", 4, budget_bytes=budget, probe=False)
    assert tight.weight_gathers == "per_micro_batch" and "would need" in tight.why["weight gathers"]


def test_a_kernel_that_fails_its_self_check_under_auto_is_a_warning_not_a_silent_swap(monkeypatch):
    """On a device where the experts' Triton kernels fail their self-check (as on an XPU whose
    Triton rejects a compile option), "auto" falls back, and the plan says the experiment changed:
    in its description, in to_dict (meta.json and the store) and nowhere for kernels that pass."""
    monkeypatch.setattr(optimus_kernels._triton, "INTERPRET", True)
    monkeypatch.setattr(optimus_kernels.selfcheck, "failure",
                        lambda kernel, device: "Unknown grf_mode" if kernel == "experts" else None)
    cfg = presets.get("mula-7b-a1b@laptop").run_config()
    plan = resolve_choices(cfg, "cuda", probe=True)
    assert plan.experts == "loop" and plan.adamw == "triton"
    [warning] = plan.warnings
    assert warning.startswith("experts: the Triton kernel failed its self-check") and "Unknown grf_mode" in warning
    assert "uses loop instead" in warning
    assert json.loads(json.dumps(plan.to_dict()))["warnings"] == [warning]
    assert "WARNING" in plan.describe()
    monkeypatch.setattr(optimus_kernels.selfcheck, "failure", lambda kernel, device: None)
    assert resolve_choices(cfg, "cuda", probe=True).warnings == []
    # an explicit choice that fails is an error, as before, not a warning
    with pytest.raises(ExecutionError, match="self-check"):
        monkeypatch.setattr(optimus_kernels.selfcheck, "failure", lambda kernel, device: "boom")
        resolve_choices(cfg.replace(execution=cfg.execution.replace(experts="triton")), "cuda", probe=True)
