"""Presets: the paper's models by the authors' tags, their exact sizes, analytic counts equal to the
real model's, and laptop proxies that keep the paper's ratios."""
import pytest
import torch

from optimus_core import presets
from optimus_core.config import ConfigError
from optimus_core.model.transformer import Transformer

# The authors' models (their README's tags), total and active parameters at vocab 50304, untied.
PAPER = {
    "mula-1b": ("olmo-1b", "", 1_279_787_008, 1_279_787_008),
    "mula-7b-a1b": ("olmoe-1b-7b", "", 6_919_161_856, 1_282_017_280),
    "mula-20b-a2b": ("olmoe-1b-7b", "SE1.5-L32", 20_076_824_576, 2_360_084_480),
    "mula-100b-a7b": ("olmoe-1b-7b", "SA1.5-SH1.5-SE2.25-SI1.5-L48", 99_987_557_376, 7_578_651_648),
    "mula-220b-a10b": ("olmoe-1b-7b", "SA1.5-SH1.5-SE3.75-SI1.5-L64", 220_205_681_664, 10_020_719_616),
}


@pytest.mark.parametrize("name", [*presets.names(), "olmoe-1b-7b--SE1.125", "olmo-1b--S0.5-L4"])
def test_num_params_equals_the_instantiated_model(name):
    cfg = presets.get(name).model
    with torch.device("meta"):
        model = Transformer(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    active = cfg.num_active_params()
    if cfg.moe is None:
        assert active == cfg.num_params()
    else:
        per_expert = 3 * cfg.d_model * cfg.moe.d_expert
        assert cfg.num_params() - active == cfg.n_layers * (cfg.moe.n_experts - cfg.moe.top_k) * per_expert


@pytest.mark.parametrize("name", PAPER)
def test_paper_models_are_the_authors(name):
    base, tag, total, active = PAPER[name]
    p = presets.get(name)
    assert (p.base, p.tag) == (base, tag)
    assert (p.model.num_params(), p.model.num_active_params()) == (total, active)
    assert p.model.padded_vocab_size == 50304 and p.model.pad_token_id == 1
    assert p.model.init_truncation is None  # transformers' init, N(0, 0.02) untruncated
    # the same model by its tagged name
    assert presets.get(f"{base}--{tag}" if tag else base).model == p.model


def test_mula_1b_is_olmo_1b():
    m = presets.get("mula-1b").model
    assert (m.norm, m.qk_norm, m.moe, m.d_ff) == ("nonparametric_layernorm", False, None, 8192)
    with torch.device("meta"):
        model = Transformer(m)
    assert not any("norm" in name for name, _ in model.named_parameters())


def test_paper_recipe():
    for name in PAPER:
        cfg = presets.get(name).run_config()
        assert (cfg.data.seq_len, cfg.train.global_batch, cfg.data.order, cfg.data.seed) == (2048, 3072, "file_windows", 42)
        assert cfg.tokens_per_step == 6_291_456
        s, o = cfg.schedule, cfg.optim
        assert (s.warmup_steps, s.warmup_from, s.decay_horizon, s.min_lr_ratio) == (2500, "min_lr", "epoch", 0.1)
        assert (o.lr, o.betas, o.eps, o.weight_decay, o.grad_clip) == (4e-4, (0.9, 0.95), 1e-8, 0.1, 1.0)
        assert o.clip_after_warmup and o.decay_norms and cfg.parallel.reduce_dtype == "bfloat16"
        if cfg.model.moe is not None:
            moe = cfg.model.moe
            assert (moe.lb_loss_coef, moe.lb_loss_form, moe.z_loss_coef, moe.top_k) == (0.01, "all_layers", 0.0, 8)


def test_laptop_proxies_keep_the_papers_ratios():
    base, tiny = presets.get("mula-7b-a1b").model, presets.get("mula-7b-a1b@laptop").model
    depth = tiny.n_layers / base.n_layers
    for name in ("mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b"):
        paper, laptop = presets.get(name).model, presets.get(f"{name}@laptop").model
        assert laptop.n_layers == paper.n_layers * depth
        assert laptop.d_model / tiny.d_model == paper.d_model / base.d_model
        assert laptop.moe.n_experts / tiny.moe.n_experts == paper.moe.n_experts / base.moe.n_experts
        assert laptop.moe.d_expert / tiny.moe.d_expert == paper.moe.d_expert / base.moe.d_expert
        assert laptop.moe.top_k / laptop.moe.n_experts * paper.moe.n_experts == paper.moe.top_k * (
            tiny.moe.top_k / tiny.moe.n_experts * base.moe.n_experts / base.moe.top_k)
        assert laptop.head_dim == tiny.head_dim
        assert presets.get(f"{name}@laptop").tag == presets.laptop_tag(presets.get(name).tag, "olmoe-1b-7b")
    # the paper's order, in total and in active parameters
    sizes = [presets.get(f"{n}@laptop").model for n in ("mula-7b-a1b", "mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b")]
    assert [m.num_params() for m in sizes] == sorted(m.num_params() for m in sizes)
    assert [m.num_active_params() for m in sizes] == sorted(m.num_active_params() for m in sizes)
    one = presets.get("mula-1b@laptop").model
    assert one.moe is None and one.norm == "nonparametric_layernorm" and not one.qk_norm
    assert presets.get("mula-1b@laptop").run_config().data.order == "file_windows"


def test_flops_per_token_convention():
    m = presets.get("mula-7b-a1b").model
    matmul = 16 * (4 * 2048 * 2048 + 2048 * 64 + 8 * 3 * 2048 * 1024) + 50304 * 2048
    assert m.flops_per_token(4096) == 6 * matmul + 12 * 16 * 2048 * 4096


def test_unknown_preset():
    with pytest.raises(ConfigError, match="preset = 'mula-3b': unknown; known presets: mula-1b"):
        presets.get("mula-3b")
    with pytest.raises(ConfigError, match="preset = 'gpt2--SE2': unknown; .* or a base"):
        presets.get("gpt2--SE2")
    with pytest.raises(ConfigError, match="unknown key 'SX'"):
        presets.get("olmoe-1b-7b--SX2")
    with pytest.raises(ConfigError, match="this base takes L, S"):
        presets.get("olmo-1b--SE2")
