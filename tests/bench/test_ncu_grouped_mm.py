"""bench/ncu_grouped_mm.py on the CPU: its operands are a balanced routing, and ours and
torch._grouped_mm compute the same forward and dW (the interpreter's tiny float32 shape)."""
import os

import pytest
import torch

from bench import ncu_grouped_mm


def test_operands_are_a_balanced_routing():
    x, w, offsets = ncu_grouped_mm.operands("up", 32768, torch.device("cpu"))
    assert offsets.dtype == torch.int32 and offsets[-1] == x.shape[0] and w.shape[1] == x.shape[1]
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    assert (counts == counts[0]).all() and counts[0] > 0


@pytest.mark.parametrize("pass_", ["fwd", "dw"])
def test_both_products_agree_on_the_cpu(pass_, capsys):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels' CPU checks need TRITON_INTERPRET=1")
    ncu_grouped_mm.main(["--op", "down", "--pass", pass_])
    out = capsys.readouterr().out
    assert "on cpu" in out and float(out.split("largest difference ")[1].split()[0]) < 1e-4


def test_ws_configs_say_why_they_are_skipped_without_hopper(capsys):
    """--ws-configs on a machine without Hopper: a line saying why, and the run goes on."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels' CPU checks need TRITON_INTERPRET=1")
    ncu_grouped_mm.main(["--op", "down", "--ws-configs"])
    out = capsys.readouterr().out
    assert "--ws-configs: skipped" in out and ", ours: largest difference" in out
