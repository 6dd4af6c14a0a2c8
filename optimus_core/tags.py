"""The authors' model-scaling tags: a model is a base model rescaled by a tag.

    >>> apply_tag(olmoe_1b_7b, "SE1.5-L32")          # Mula-20B-A2B: 32 layers, 96 experts
    >>> parse_tag("SA1.5-SH1.5-SE2.25-SI1.5-L48")    # {"SA": 1.5, "SH": 1.5, "SE": 2.25, "SI": 1.5, "L": 48}

The grammar is the one the paper's code scales OLMoE-1B-7B-0924 with (GitHub IntelLabs/Optimus-LM,
``optimus/config_utils.py``; its README names the paper's models by their tags). A tag is tokens
joined by ``-``, each a key of capital letters and an optional number:

    L<n>     n layers
    SA<x>    attention heads x x (query and key/value heads alike; the head dim follows the width)
    SH<x>    hidden size (d_model) x x
    SE<x>    experts x x
    SC<x>    experts per token (top-k) x x
    SI<x>    expert hidden size x x
    SM<x>    SA and SH (not with either)
    S<x>     SA, SH, SE and SI (not with any of them)
    NAL      no auxiliary (load-balancing) loss
    SKIPQKNORM  no QK-norm

Each scaled size is ``int(x * base)``, the authors' rounding (truncation). A dense base (OLMo-1B)
takes the keys the authors' OLMo grammar has that our model can express: ``L`` and ``S`` (heads,
width and feed-forward hidden together). Anything else, and any scale that leaves the model
invalid (heads not dividing the width, top-k above the experts, a size of zero), is a ConfigError
naming the tag.
"""
from __future__ import annotations

import re

from .config import ConfigError, ModelConfig

MOE_KEYS = ("L", "SA", "SH", "SE", "SC", "SI", "SM", "S", "NAL", "SKIPQKNORM")
DENSE_KEYS = ("L", "S")
FLAGS = ("NAL", "SKIPQKNORM")
# the keys each union key stands for, which it cannot be given beside
UNIONS = {"S": ("SA", "SH", "SE", "SI"), "SM": ("SA", "SH")}
_TOKEN = re.compile(r"([A-Z]+)([0-9]*\.?[0-9]*)")


def parse_tag(tag: str, allowed: tuple[str, ...] = MOE_KEYS) -> dict[str, float | bool]:
    """``{key: value}`` of a tag (flags map to True); ConfigError for a malformed token, a key
    not in ``allowed``, a key given twice or beside a union key that covers it."""
    if not isinstance(tag, str) or not tag:
        raise ConfigError(f"tag = {tag!r}: must be tokens like L32 or SE1.5 joined by '-'")
    out: dict[str, float | bool] = {}
    for token in tag.split("-"):
        m = _TOKEN.fullmatch(token)
        if m is None or m.group(2) == ".":
            raise ConfigError(f"tag {tag!r}: token {token!r} is not a key of capital letters and a number "
                              f"(keys: {', '.join(allowed)})")
        key, number = m.groups()
        if key not in allowed:
            raise ConfigError(f"tag {tag!r}: unknown key {key!r} in {token!r}; this base takes {', '.join(allowed)}")
        if key in out:
            raise ConfigError(f"tag {tag!r}: {key} given twice")
        if key in FLAGS:
            if number:
                raise ConfigError(f"tag {tag!r}: {key} is a flag and takes no number ({token!r})")
            out[key] = True
            continue
        if not number:
            raise ConfigError(f"tag {tag!r}: {key} needs a number ({key}2, {key}1.5)")
        value = float(number)
        if key == "L" and not value.is_integer():
            raise ConfigError(f"tag {tag!r}: L sets the number of layers and must be a whole number, not {number}")
        if value <= 0:
            raise ConfigError(f"tag {tag!r}: {token!r} must be > 0")
        out[key] = value
    for union, covered in UNIONS.items():
        clash = [k for k in covered if k in out]
        if union in out and clash:
            raise ConfigError(f"tag {tag!r}: {union} scales {', '.join(covered)} together; "
                              f"it cannot be given with {', '.join(clash)}")
    return out


def _scales(parsed: dict[str, float | bool]) -> dict[str, float]:
    """Each elementary scale (SA, SH, SE, SC, SI) with the union keys expanded; 1 where unset."""
    scales = {k: 1.0 for k in ("SA", "SH", "SE", "SC", "SI")}
    for key, value in parsed.items():
        for target in UNIONS.get(key, (key,)):
            if target in scales:
                scales[target] = float(value)
    return scales


def apply_tag(base: ModelConfig, tag: str) -> ModelConfig:
    """``base`` rescaled by ``tag`` (module doc). An MoE base takes the OLMoE grammar, a dense one
    the OLMo keys L and S. The result is a validated ModelConfig; a scale that breaks it is a
    ConfigError naming the tag and what broke."""
    parsed = parse_tag(tag, MOE_KEYS if base.is_moe else DENSE_KEYS)
    s = _scales(parsed)
    sized = {
        "n_layers": int(parsed.get("L", base.n_layers)),
        "n_heads": int(s["SA"] * base.n_heads),
        "n_kv_heads": None if base.n_kv_heads is None else int(s["SA"] * base.n_kv_heads),
        "d_model": int(s["SH"] * base.d_model),
    }
    if base.is_moe:
        moe = base.moe
        sized_moe = {"n_experts": int(s["SE"] * moe.n_experts), "top_k": int(s["SC"] * moe.top_k),
                     "d_expert": int(s["SI"] * moe.d_expert)}
    else:  # OLMo's S scales the feed-forward hidden size with the width
        sized["d_ff"] = int(s["SH"] * base.d_ff)
        sized_moe = {}
    zero = [k for k, v in {**sized, **sized_moe}.items() if v is not None and v < 1]
    if zero:
        raise ConfigError(f"tag {tag!r}: leaves {', '.join(zero)} below 1 (each size is int(scale x base))")
    try:
        if base.is_moe:
            moe = base.moe.replace(**sized_moe)
            if parsed.get("NAL"):
                moe = moe.replace(lb_loss_coef=0.0)
            sized["moe"] = moe
        if parsed.get("SKIPQKNORM"):
            sized["qk_norm"] = False
        return base.replace(**sized)
    except ConfigError as e:
        raise ConfigError(f"tag {tag!r}: {e}") from None


def split_name(name: str) -> tuple[str, str]:
    """``"olmoe-1b-7b--SE1.125"`` -> ``("olmoe-1b-7b", "SE1.125")``; a name without ``--`` has
    the empty tag. The tag is what follows the last ``--``, as the authors split it."""
    base, sep, tag = name.rpartition("--")
    if not sep:
        return name, ""
    if not base or not tag:
        raise ConfigError(f"preset = {name!r}: a tagged name is BASE--TAG, e.g. olmoe-1b-7b--SE1.5-L32")
    return base, tag
