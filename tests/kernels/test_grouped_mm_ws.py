"""The warp-specialized Gluon kernel (kernels/optimus_kernels/hopper/grouped_mm_ws.py): the grouped GEMM's forward and dx
(the SwiGLU epilogues of both: tests/kernels/test_expert_mlp.py).

Gluon has no interpreter, so on a CPU every config is compiled for sm90 (in a fresh process:
grouped_mm_ws.sm90_report) and ptxas's report is read: it must fit the H200's shared memory,
spill nothing, and keep its wgmmas pipelined (no C7514 warning: the reason the forward's epilogue
goes through shared memory). On a Hopper GPU each config runs against a float32 reference on odd
shapes: empty groups, partial row, column and K tiles, a tail of rows past offsets[-1] (must
come out zero: the output starts as NaN), a few programs with many items each (both consumers
taking turns, the ring's wrap-around) and the whole GPU's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import optimus_kernels.hopper.grouped_mm_tma as gm_tma
import optimus_kernels.hopper.grouped_mm_ws as ws
from optimus_kernels import grouped_mm_reference
from test_grouped_mm import make

ROOT = Path(__file__).resolve().parents[2]
needs_gluon = pytest.mark.skipif(ws.gluon is None, reason="this Triton has no Gluon Hopper language")
CONFIGS = pytest.mark.parametrize("config", [ws.config_dict(*c) for c in ws.CONFIGS],
                                  ids=[ws.config_name(c) for c in ws.CONFIGS])
TRANS = pytest.mark.parametrize("trans_w", [False, True], ids=["forward", "dx"])


@pytest.fixture(scope="module")
def sm90():
    """grouped_mm_ws.sm90_report() from a fresh process: an interpreted kernel run earlier in
    this one (any CPU kernel test) leaves state that breaks Gluon's compiler."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", "import json; from optimus_kernels.hopper.grouped_mm_ws import sm90_report; "
                          "print(json.dumps(sm90_report()))"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


KERNELS = [f"{name}/{ws.config_name(c)}" for c in ws.CONFIGS for name in ws.KERNELS]


@needs_gluon
@pytest.mark.parametrize("kernel", KERNELS)
def test_compiles_for_hopper_pipelined_within_shared_memory(kernel, sm90):
    """Each config of each kernel: its partitions survive to the TTGIR, it fits the H200's shared
    memory, spills nothing, and ptxas keeps its wgmmas pipelined (no C7514: serialized because
    another instruction reads their accumulator mid-pipeline, the reason the forward's epilogue
    goes through shared memory)."""
    report = sm90[kernel]
    assert report["warp_specialized"] and report["wgmma"]
    assert report["shared"] <= ws.SHARED_MEMORY_LIMIT
    assert "Used " in report["ptxas"], report["ptxas"]  # ptxas ran and reported
    assert "C7514" not in report["ptxas"] and "0 bytes spill stores" in report["ptxas"], report["ptxas"]


def test_says_why_it_cannot_run():
    x, w, y = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 32, dtype=torch.bfloat16), \
        torch.zeros(8, 32, dtype=torch.bfloat16)
    assert "GPU" in ws.ws_unsupported(x, w, y) or "Gluon" in ws.ws_unsupported(x, w, y)
    assert ws._shape_unsupported(x, w, y, False) is None
    assert "multiple of 64" in ws._shape_unsupported(x[:, :40], w[:, :40], y, False)
    assert ws._shape_unsupported(x[:, :40], w[:, :, :40].contiguous(), y, True) is None  # dx: TMA zero-fills K
    assert "16-bit" in ws._shape_unsupported(x.float(), w.float(), y.float(), False)
    assert "16-byte" in ws._shape_unsupported(x, w, torch.zeros(8, 33, dtype=torch.bfloat16)[:, :32], False)
    assert "K = 0" in ws._shape_unsupported(x[:, :0], w[:, :0], y, False)


def test_default_config_is_the_cooperative_tile_but_where_it_would_waste_half_a_tile():
    for n in (2048, 1024, 256, 392, 64):  # whole 256-column tiles, or partial ones either tile would have
        assert ws.default_config(n) == ws.config_dict(*ws.CONFIGS[0]) and ws.default_config(n)["COOP"] == 1
    for n in (1152, 128, 384):  # an odd multiple of 128: mula-220b-a10b's expert hidden size
        assert ws.default_config(n)["BLOCK_N"] == 128 and ws.default_config(n)["COOP"] == 0


@needs_gluon
def test_an_older_triton_with_gluon_is_not_taken(monkeypatch):
    """Gluon's API moved between releases: a Triton before 3.6 falls back to the TMA kernel
    instead of failing to compile this one."""
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(ws.triton, "__version__", "3.5.1")
    assert "3.6+" in ws.ws_device_unsupported(x.device)
    monkeypatch.setattr(ws.triton, "__version__", "3.10.0")
    assert "3.6+" not in ws.ws_device_unsupported(x.device)


# --------------------------------------------------------------------------- on a Hopper GPU
@pytest.mark.gpu
@TRANS
@CONFIGS
@pytest.mark.parametrize("programs", [3, None], ids=["3 programs", "one per SM"])
def test_matches_reference_on_hopper(config, trans_w, programs, gpu_device, rel_err, monkeypatch):
    sizes = [0, 3000, 1, 0, 5170, 640, 1290, 0, 77] if programs is None else [0, 300, 1, 0, 517, 64, 129, 0]
    x, w, offsets, dy = make(sizes, 7, 192, 392, gpu_device, torch.bfloat16)  # K = 3 blocks, N: partial tiles
    a, w = (dy if trans_w else x).detach(), w.detach()
    if (reason := ws.ws_unsupported(a, w, dy if not trans_w else x, trans_w)) is not None:
        pytest.skip(reason)
    if programs is not None:
        monkeypatch.setattr(gm_tma, "_num_programs", lambda device: programs)
    b = w.transpose(1, 2) if trans_w else w
    want = grouped_mm_reference(a.float(), b.float(), offsets)
    y = torch.full(tuple(want.shape), float("nan"), device=gpu_device, dtype=a.dtype)
    ws.launch_grouped_mm_ws(a, w, offsets, y, trans_w=trans_w, config=config)
    assert rel_err(y, want) < 5e-3
    assert not y[int(offsets[-1]):].any()  # the tail: zeros, not NaN


@pytest.mark.gpu
@TRANS
def test_non_finite_weights_of_an_empty_group_never_leak(trans_w, gpu_device):
    """dx reads w's rows past a group's N (here group 0's second column tile: 64 rows of group 1)
    into output columns >= N, which the stores drop; the forward never reads an empty group's
    weights."""
    x, w, offsets, dy = make([40, 0, 200, 0], 3, 192, 72, gpu_device, torch.bfloat16)
    w = w.detach().clone()
    w[[1, 3]] = float("inf")
    a = (dy if trans_w else x).detach()
    if (reason := ws.ws_unsupported(a, w, dy if not trans_w else x, trans_w)) is not None:
        pytest.skip(reason)
    out_cols = w.shape[1] if trans_w else w.shape[2]
    y = torch.full((a.shape[0], out_cols), float("nan"), device=gpu_device, dtype=a.dtype)
    ws.launch_grouped_mm_ws(a, w, offsets, y, trans_w=trans_w)
    assert torch.isfinite(y).all()
