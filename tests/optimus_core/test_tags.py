"""The authors' scaling tags: their keys, unions, rounding, and one clear error per bad tag."""
import pytest

from optimus_core import presets
from optimus_core.config import ConfigError
from optimus_core.tags import apply_tag, parse_tag, split_name

OLMOE = presets.BASES["olmoe-1b-7b"]


def test_each_key_scales_its_size():
    m = apply_tag(OLMOE, "SA1.5-SH1.5-SE2.25-SC0.5-SI1.5-L48")
    assert (m.n_layers, m.n_heads, m.d_model, m.moe.n_experts, m.moe.top_k, m.moe.d_expert) == (48, 24, 3072, 144, 4, 1536)
    assert m.head_dim == 128


def test_unions_and_rounding():
    # S scales heads, width, experts and expert hidden; SM heads and width; sizes are int(x * base)
    s = apply_tag(OLMOE, "S1.25")
    assert (s.n_heads, s.d_model, s.moe.n_experts, s.moe.d_expert, s.moe.top_k) == (20, 2560, 80, 1280, 8)
    assert apply_tag(OLMOE, "SE1.01").moe.n_experts == 64  # int(64.64): truncated, as the authors round
    sm = apply_tag(OLMOE, "SM2")
    assert (sm.n_heads, sm.d_model, sm.moe.n_experts) == (32, 4096, 64)
    assert apply_tag(OLMOE, "SE1.125").moe.n_experts == 72  # the authors' kernel A/B model


def test_flags():
    m = apply_tag(OLMOE, "NAL-SKIPQKNORM")
    assert m.moe.lb_loss_coef == 0 and not m.qk_norm
    assert parse_tag("L8-NAL") == {"L": 8.0, "NAL": True}


def test_dense_base_takes_L_and_S():
    m = apply_tag(presets.BASES["olmo-1b"], "S0.5-L4")
    assert (m.n_layers, m.n_heads, m.d_model, m.d_ff) == (4, 8, 1024, 4096)


def test_split_name():
    assert split_name("olmoe-1b-7b--SE1.125") == ("olmoe-1b-7b", "SE1.125")
    assert split_name("mula-7b-a1b") == ("mula-7b-a1b", "")
    assert split_name("olmoe-1b-7b@laptop--SE1.5-L8") == ("olmoe-1b-7b@laptop", "SE1.5-L8")


@pytest.mark.parametrize("tag, message", [
    ("SX2", "unknown key 'SX'"),
    ("se1.5", "is not a key of capital letters"),
    ("SE", "SE needs a number"),
    ("L3.5", "L sets the number of layers and must be a whole number"),
    ("SE0", "must be > 0"),
    ("S2-SE1.5", "S scales SA, SH, SE, SI together; it cannot be given with SE"),
    ("SM2-SA1.5", "SM scales SA, SH together"),
    ("SE2-SE3", "SE given twice"),
    ("NAL1", "NAL is a flag"),
    ("SE0.01", "leaves n_experts below 1"),
    ("SA1.1", "n_heads"),                 # 17 heads do not divide 2048
    ("SC9", "top_k"),                     # 72 experts per token of 64
    ("", "must be tokens like L32"),
])
def test_bad_tags_name_the_tag(tag, message):
    with pytest.raises(ConfigError, match=message):
        apply_tag(OLMOE, tag)


def test_bad_tag_on_the_command_line_names_it():
    with pytest.raises(ConfigError, match=r"tag 'SA1.1': model.n_heads = 17: must divide d_model \(2048\)"):
        presets.get("olmoe-1b-7b--SA1.1")
    with pytest.raises(ConfigError, match="a tagged name is BASE--TAG"):
        presets.get("olmoe-1b-7b--")


def test_ep_must_divide_the_tags_experts():
    with pytest.raises(ConfigError, match=r"parallel.ep = 32: must divide model.moe.n_experts \(240\)"):
        presets.get("mula-220b-a10b").run_config(**{"parallel.ep": 32})
