"""Config validation: bad values name the field, the value and what is allowed."""
import json

import pytest

from optimus_core.config import (MOVED, RETIRED, ConfigError, ExecutionConfig, ModelConfig, MoEConfig, OptimConfig,
                                 RunConfig, TrainConfig, apply_overrides, from_dict, parse_value)


@pytest.mark.parametrize("build, message", [
    (lambda: ModelConfig(n_layers=-1), "model.n_layers = -1: must be >= 1"),
    (lambda: ModelConfig(d_model=100, n_heads=3), "model.n_heads = 3: must divide d_model (100)"),
    (lambda: MoEConfig(n_experts=4, top_k=8), "model.moe.top_k = 8: must be between 1 and n_experts (4)"),
    (lambda: TrainConfig(steps=-5), "train.steps = -5: must be >= 1"),
    (lambda: TrainConfig(steps="ten"), "train.steps = 'ten': must be an integer"),
    (lambda: ExecutionConfig(dtype="float16"), "execution.dtype = 'float16': must be one of 'auto', 'float32', 'bfloat16'"),
    (lambda: TrainConfig(global_batch=16, micro_batch=5), "train.micro_batch = 5: must divide global_batch (16)"),
    (lambda: ExecutionConfig(lm_loss="cuda"), "execution.lm_loss = 'cuda': must be one of 'auto', 'torch', 'triton'"),
    (lambda: ExecutionConfig(adamw="fused"), "execution.adamw = 'fused': must be one of 'auto', 'torch', 'triton'"),
    (lambda: ExecutionConfig(experts="grouped"),
     "execution.experts = 'grouped': must be one of 'auto', 'loop', 'torch', 'triton'"),
    (lambda: ExecutionConfig(compile="yes"), "execution.compile = 'yes': must be bool or one of 'auto'"),
    (lambda: ExecutionConfig(activation_checkpointing="selective"), "execution.activation_checkpointing = 'selective'"),
    (lambda: ExecutionConfig(activation_checkpointing_every=0), "execution.activation_checkpointing_every = 0: must be >= 1"),
    (lambda: ExecutionConfig(memory_budget_gib=0), "execution.memory_budget_gib = 0.0: must be null (the device's) or > 0"),
    (lambda: RunConfig(execution=ExecutionConfig(activation_checkpointing="moe")),
     "execution.activation_checkpointing = 'moe': recomputes the MoE block: it needs an MoE model"),
])
def test_bad_values_name_the_field(build, message):
    with pytest.raises(ConfigError) as err:
        build()
    assert message in str(err.value)


def test_unknown_field_is_rejected_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown field train\.stepz .*known fields: .*steps"):
        apply_overrides(RunConfig(), {"train.stepz": 3})
    with pytest.raises(ConfigError, match="unknown field colour"):
        from_dict(TrainConfig, {"colour": "red"})


def test_overrides_are_validated_and_nested():
    cfg = RunConfig(model=ModelConfig(moe=MoEConfig()))
    out = apply_overrides(cfg, {"train.steps": 7, "model.moe.top_k": 2, "optim.betas": [0.8, 0.9]})
    assert (out.train.steps, out.model.moe.top_k, out.optim.betas) == (7, 2, (0.8, 0.9))
    with pytest.raises(ConfigError, match=r"model\.moe\.top_k = 100"):
        apply_overrides(cfg, {"model.moe.top_k": 100})
    with pytest.raises(ConfigError, match="model.moe is null"):
        apply_overrides(RunConfig(), {"model.moe.top_k": 2})


def test_cross_field_rules():
    with pytest.raises(ConfigError, match=r"data\.seq_len = 8192: must be <= model\.max_seq_len \(4096\)"):
        apply_overrides(RunConfig(), {"data.seq_len": 8192})
    with pytest.raises(ConfigError, match=r"parallel\.ep = 3: must divide model\.moe\.n_experts \(64\)"):
        apply_overrides(RunConfig(model=ModelConfig(moe=MoEConfig())), {"parallel.ep": 3})


def test_json_round_trip():
    cfg = apply_overrides(RunConfig(model=ModelConfig(moe=MoEConfig(capacity_factor=1.25))),
                          {"train.steps": 3, "execution.dtype": "bfloat16", "execution.compile": False,
                           "execution.activation_checkpointing": "moe"})
    assert RunConfig.from_json(cfg.to_json()) == cfg


def test_execution_defaults_are_all_auto():
    ex = RunConfig().execution
    assert (ex.dtype, ex.experts, ex.compile, ex.adamw, ex.lm_loss, ex.activation_checkpointing) == ("auto",) * 6
    assert (ex.activation_checkpointing_every, ex.memory_budget_gib, ex.recast_expert_weights) == (1, None, False)
    with pytest.raises(ConfigError, match="execution.activation_checkpointing = True: must be one of"):
        ExecutionConfig(activation_checkpointing=True)  # a mode, not a bool


@pytest.mark.parametrize("old, new, value", [
    ("train.dtype", "execution.dtype", "bfloat16"),
    ("train.compile", "execution.compile", True),
    ("model.moe.experts_backend", "execution.experts", "triton"),
    ("optim.implementation", "execution.adamw", "triton"),
    ("train.lm_loss_softmax", "execution.lm_loss", "torch"),
    ("train.activation_checkpointing", "execution.activation_checkpointing", "full"),
    ("train.activation_checkpointing_every", "execution.activation_checkpointing_every", 2),
    ("train.memory_budget_gib", "execution.memory_budget_gib", 8.0),
    ("train.recast_expert_weights", "execution.recast_expert_weights", True),
])
def test_setting_a_moved_field_names_its_new_place(old, new, value):
    assert MOVED[old] == new
    cfg = RunConfig(model=ModelConfig(moe=MoEConfig()))
    with pytest.raises(ConfigError, match=rf"^{old} is now {new} "):
        apply_overrides(cfg, {old: value})
    section, leaf = new.split(".")
    assert getattr(getattr(apply_overrides(cfg, {new: value}), section), leaf) == value  # the new name works


@pytest.mark.parametrize("old", ["model.moe.weights_before_down", "optim.grad_norm_under_backward",
                                 "optim.grad_norm_from_dw", "optim.update_beside_forward", "train.compile_mode",
                                 "train.expert_weight_casts", "train.expert_grad_dtype", "train.fused_lm_loss"])
def test_setting_a_removed_choice_is_an_error_saying_what_runs_now(old):
    with pytest.raises(ConfigError, match=rf"^{old} is no longer a choice: {RETIRED[old]}"):
        apply_overrides(RunConfig(model=ModelConfig(moe=MoEConfig())), {old: True})


def test_the_tp_placeholder_is_gone():
    with pytest.raises(ConfigError, match=r"unknown field parallel.tp \(in parallel\)"):
        apply_overrides(RunConfig(), {"parallel.tp": 1})


@pytest.mark.parametrize("section, old, value, says", [
    ("train", "dtype", "bfloat16", "is execution.dtype now"),
    ("model.moe", "experts_backend", "triton", "is execution.experts now"),
    ("optim", "implementation", "triton", "is execution.adamw now"),
    ("train", "fused_lm_loss", True, "is no longer a choice (the LM loss is always fused with the head)"),
    ("parallel", "overlap_grad_sync", True, "is no longer a choice"),
])
def test_a_stored_config_of_an_earlier_optimus_is_refused_in_one_line_naming_the_field(section, old, value, says):
    """meta.json and checkpoints hold the config that wrote them: one with a former field is not
    read as today's (it would run with other choices than it names), but refused, saying where the
    choice is now."""
    stored = RunConfig(model=ModelConfig(moe=MoEConfig())).to_dict()
    node = stored
    for key in section.split("."):
        node = node[key]
    node[old] = value
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_json(json.dumps(stored))
    line = str(refused.value)
    assert line.startswith(f"{section}.{old}: a field of an earlier Optimus's config, which {says}")
    assert "\n" not in line
    assert RunConfig.from_json(RunConfig().to_json()) == RunConfig()  # today's reads as it is


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_number_that_is_not_finite_is_refused(value):
    with pytest.raises(ConfigError, match="optim.lr = .*: must be a finite number"):
        OptimConfig(lr=value)
    with pytest.raises(ConfigError, match="must be a finite number"):
        apply_overrides(RunConfig(), {"optim.lr": value})


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("3", 3), ("2.5E2", 250.0), ("[0.9, 0.95]", [0.9, 0.95]),
                                         ("true", True), ("null", None), ("auto", "auto"), ("inf", "inf")])
def test_set_values_are_read_as_a_user_writes_them(text, value):
    """YAML 1.1 reads 1e-3 (no dot) as a string: --set reads it as the number it is."""
    assert parse_value(text) == value and type(parse_value(text)) is type(value)
