"""bench/saved_activations.py: one block's saved tensors on fake tensors. With the routing
weights in the top-k combine, the combine keeps the experts' output rows (R x d_model, bf16)
for its backward; with them before the down projection it keeps nothing of that size."""
import json

import pytest

from bench.saved_activations import main, saved_tensors
from kernels import INTERPRET
from optimus_core import presets

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the triton ops' CPU checks need TRITON_INTERPRET=1")


def _activations(**moe):
    rows = saved_tensors("mula-7b-a1b@laptop", tokens=64, seq=32, backend="triton", moe_overrides=moe)
    return sum(r["bytes"] for r in rows if not r["weight"]), rows


def test_weights_before_down_drops_the_expert_outputs_from_the_saved_set():
    before, rows = _activations(weights_before_down=True)
    after, _ = _activations(weights_before_down=False)
    cfg = presets.get("mula-7b-a1b@laptop").model
    rows_R = 64 * cfg.moe.top_k  # tokens x top-k: every assignment's row
    assert after - before == rows_R * cfg.d_model * 2  # one bf16 (R, D) tensor
    assert any(r["weight"] for r in rows)  # the expert weight copies, listed apart


def test_the_command_prints_a_table_and_a_json_line(capsys):
    main(["--preset", "mula-7b-a1b@laptop", "--tokens", "64", "--seq", "32",
          "--set", "model.moe.weights_before_down=false"])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert summary["moe_overrides"] == {"weights_before_down": False} and summary["activations_gib"] > 0
    assert "saved by" in out[0]
