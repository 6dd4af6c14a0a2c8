"""Every Intel XPU config of every kernel here compiles as far as its options go: its grf_mode is
one that Intel's Triton accepts (optimus_kernels._triton.XPU_GRF_MODES: v3.6.0, the release of
torch 2.10 and of ALCF Aurora's frameworks/2025.3.1, raises "Unknown grf_mode" on any other,
e.g. 'large'). No GPU and no interpreter needed: the config lists are read as the XPU gets them
(every function registered in CONFIG_SOURCES, called for device type "xpu", with the module's
INTERPRET switch off), and the package's source is read for grf_mode values spelled anywhere else.
"""

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import optimus_kernels
from optimus_kernels import _triton

pytestmark = pytest.mark.skipif(_triton.triton is None, reason="triton is not installed")

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def import_every_module():
    """Every module of the package imported, so that each registers its config functions."""
    for module in pkgutil.walk_packages(optimus_kernels.__path__, "optimus_kernels."):
        importlib.import_module(module.name)


def xpu_configs(monkeypatch) -> dict[str, list]:
    """{"module.function[dtype]": its configs for device type "xpu"} for every registered source,
    each read as on an XPU (its module's INTERPRET off, whatever this process runs under)."""
    import_every_module()
    found = {}
    for name, configs_for in _triton.CONFIG_SOURCES.items():
        if "INTERPRET" in configs_for.__globals__:
            monkeypatch.setitem(configs_for.__globals__, "INTERPRET", False)
        if len(inspect.signature(configs_for).parameters) == 1:
            found[name] = list(configs_for("xpu"))
        else:
            for dtype in DTYPES:
                found[f"{name}[{dtype}]"] = list(configs_for("xpu", dtype))
    return found


def test_every_xpu_config_sets_a_grf_mode_intels_triton_accepts(monkeypatch):
    found = xpu_configs(monkeypatch)
    refused = [f"{name}: {config}: {why}" for name, configs in found.items() for config in configs
               if (why := _triton.config_grf_unsupported(config)) is not None]
    assert not refused, "\n".join(refused)
    # the enumeration reaches every kernel family with XPU configs, and the GEMMs' big tiles are
    # read with their grf_mode (so the check above had something to refuse)
    sources = {name.split("[")[0].rsplit(".", 1)[1] for name in found}
    assert {"_mm_configs", "_dw_configs", "_tma_configs", "_dw_tma_configs", "row_configs",
            "stream_configs"} <= sources
    modes = {name: {c.kwargs.get("grf_mode") for c in configs if hasattr(c, "kwargs")} for name, configs in found.items()}
    for gemm in ("grouped_mm._mm_configs", "grouped_mm._dw_configs", "grouped_mm_tma._tma_configs",
                 "grouped_mm_tma._dw_tma_configs"):
        assert modes[f"optimus_kernels.{'hopper.' if 'tma' in gemm else ''}{gemm}[{torch.bfloat16}]"] == {"256"}, gemm


def test_the_descriptor_familys_pvc_configs_are_intels_tiles(monkeypatch):
    """The XPU descriptor kernels' primary config is Intel's PVC GEMM tile, 256 x 256 x 32 with
    32 warps of 256 registers, and every other config a smaller tile with the same warps."""
    import optimus_kernels.hopper.grouped_mm_tma as gm_tma

    monkeypatch.setattr(gm_tma, "INTERPRET", False)
    forward = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.kwargs["grf_mode"])
               for c in gm_tma._tma_configs("xpu", torch.bfloat16)]
    dw = [(c.kwargs["BLOCK_K"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_R"], c.num_warps, c.kwargs["grf_mode"],
           c.kwargs["SPLIT_N"]) for c in gm_tma._dw_tma_configs("xpu", torch.bfloat16)]
    assert forward[0] == (256, 256, 32, 32, "256") and dw[0] == (256, 256, 32, 32, "256", 1)
    for m, n, k, warps, mode in forward[1:]:
        assert m * n < 256 * 256 and k == 32 and warps == 32 and mode == "256"
    assert all(split == 1 and warps == 32 for *_, warps, _, split in dw)


@pytest.mark.parametrize("mode", ["large", "small", "512", 256, "", None])
def test_the_check_refuses_what_intels_triton_3_6_refuses(mode):
    """'large' / 'small' are the names before v3.6.0, '512' arrived in v3.7.2; the values are
    strings. A config or a tile list with such a mode is refused, and so is it in a launch's
    options."""
    why = _triton.grf_mode_unsupported(mode)
    assert why is not None and "'128', '256', 'auto', 'default'" in why
    config = _triton.triton.Config({"BLOCK_M": 256, "grf_mode": mode}, num_warps=32)
    assert _triton.config_grf_unsupported(config) == why
    assert _triton.config_grf_unsupported({"grf_mode": mode, "num_warps": 32}) == why
    with pytest.raises(ValueError, match="tile_configs: grf_mode"):
        _triton.tile_configs([(256, 256, 32, 32, 2)], grf_mode=mode)


def test_the_check_accepts_intels_values_and_limits_256_to_32_warps():
    for mode in ("128", "256", "auto", "default"):
        assert _triton.grf_mode_unsupported(mode, 32) is None
    assert _triton.grf_mode_unsupported("128", 64) is None
    assert "at most 32 warps" in _triton.grf_mode_unsupported("256", 64)
    assert _triton.config_grf_unsupported(_triton.triton.Config({"BLOCK_M": 64}, num_warps=4)) is None
    assert _triton.config_grf_unsupported((2048, 16)) is None  # a launcher's (BLOCK, warps): no options


GRF_LITERAL = re.compile(r"""grf_mode["']?\s*[=:]\s*["']([^"']*)["']""")


def test_no_source_spells_a_grf_mode_intels_triton_refuses():
    """A grf_mode spelled as a literal anywhere in the package (a config, a launch's keyword)
    is one of XPU_GRF_MODES: the configs above are not the only way to pass one."""
    root = Path(optimus_kernels.__file__).parent
    spelled = {(path.relative_to(root).as_posix(), value) for path in root.rglob("*.py")
               for value in GRF_LITERAL.findall(path.read_text())}
    assert all(value in _triton.XPU_GRF_MODES for _, value in spelled), sorted(spelled)
    assert GRF_LITERAL.findall('tile_configs(shapes, grf_mode="large")') == ["large"]  # what it would catch
    assert GRF_LITERAL.findall("{'BLOCK_M': 256, 'grf_mode': 'large'}") == ["large"]
