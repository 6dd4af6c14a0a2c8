"""Config validation: bad values name the field, the value and what is allowed."""
import pytest

from optimus_core.config import (ConfigError, ModelConfig, MoEConfig, RunConfig, TrainConfig, apply_overrides,
                                 from_dict)


@pytest.mark.parametrize("build, message", [
    (lambda: ModelConfig(n_layers=-1), "model.n_layers = -1: must be >= 1"),
    (lambda: ModelConfig(d_model=100, n_heads=3), "model.n_heads = 3: must divide d_model (100)"),
    (lambda: MoEConfig(n_experts=4, top_k=8), "model.moe.top_k = 8: must be between 1 and n_experts (4)"),
    (lambda: TrainConfig(steps=-5), "train.steps = -5: must be >= 1"),
    (lambda: TrainConfig(steps="ten"), "train.steps = 'ten': must be an integer"),
    (lambda: TrainConfig(dtype="float16"), "train.dtype = 'float16': must be one of 'float32', 'bfloat16'"),
    (lambda: TrainConfig(global_batch=16, micro_batch=5), "train.micro_batch = 5: must divide global_batch (16)"),
    (lambda: TrainConfig(fused_lm_loss=False, lm_loss_softmax="triton"),
     "train.lm_loss_softmax = 'triton': 'triton' needs fused_lm_loss"),
    (lambda: TrainConfig(lm_loss_softmax="cuda"), "train.lm_loss_softmax = 'cuda'"),
    (lambda: TrainConfig(expert_grad_dtype="bfloat16"), "train.expert_grad_dtype = 'bfloat16': 'bfloat16' needs"),
    (lambda: TrainConfig(dtype="bfloat16", expert_grad_dtype="bfloat16", recast_expert_weights=True),
     "needs the experts' bf16 weight copies"),
    (lambda: TrainConfig(expert_grad_dtype="float16"), "train.expert_grad_dtype = 'float16'"),
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
    cfg = apply_overrides(RunConfig(model=ModelConfig(moe=MoEConfig(capacity_factor=1.25))), {"train.steps": 3})
    assert RunConfig.from_json(cfg.to_json()) == cfg
