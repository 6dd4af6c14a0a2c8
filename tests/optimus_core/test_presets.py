"""Presets: analytic counts equal the real model's, and the Mula names are honest."""
import pytest
import torch

from optimus_core import presets
from optimus_core.config import ConfigError
from optimus_core.model.transformer import Transformer

# (name in billions): total within 10% of the name, active within 0.8x - 1.5x of the name.
NAMED = {"mula-20b-a2b": (20, 2), "mula-100b-a7b": (100, 7), "mula-220b-a10b": (220, 10)}


@pytest.mark.parametrize("name", presets.names())
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


def test_mula_sizes_meet_their_names(capsys):
    from workflow.cli import presets_table
    print(presets_table())
    m = presets.get("mula-7b-a1b").model
    assert abs(m.num_params() / 6.9e9 - 1) < 0.03
    assert abs(m.num_active_params() / 1.3e9 - 1) < 0.05
    assert m.padded_vocab_size == 50304
    for name, (total_b, active_b) in NAMED.items():
        m = presets.get(name).model
        assert abs(m.num_params() / (total_b * 1e9) - 1) <= 0.10, name
        assert 0.8 <= m.num_active_params() / (active_b * 1e9) <= 1.5, name


def test_laptop_proxies_keep_the_family():
    for name in ("mula-7b-a1b", "mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b"):
        paper, laptop = presets.get(name).model, presets.get(f"{name}@laptop").model
        assert (laptop.moe.n_experts, laptop.moe.top_k) == (paper.moe.n_experts, paper.moe.top_k)
    assert presets.get("mula-1b@laptop").model.moe is None


def test_flops_per_token_convention():
    m = presets.get("mula-7b-a1b").model
    matmul = 16 * (4 * 2048 * 2048 + 2048 * 64 + 8 * 3 * 2048 * 1024) + 50304 * 2048
    assert m.flops_per_token(4096) == 6 * matmul + 12 * 16 * 2048 * 4096


def test_unknown_preset():
    with pytest.raises(ConfigError, match="preset = 'mula-3b': unknown; known presets: mula-1b"):
        presets.get("mula-3b")
