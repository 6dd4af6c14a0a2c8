"""bench/saved_activations.py: one block's saved tensors on fake tensors. The routing weights
scale the SwiGLU output, before the down projection: the backward keeps nothing of the experts'
output rows, which weighting them in the top-k combine instead would keep (R x d_model, bf16)."""
import json

import pytest

from bench.saved_activations import main, saved_tensors
from optimus_kernels import INTERPRET
from optimus_core import presets
from optimus_core.model.experts import Experts

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the triton ops' CPU checks need TRITON_INTERPRET=1")


def _activations(**moe):
    rows = saved_tensors("mula-7b-a1b@laptop", tokens=64, seq=32, backend="triton", moe_overrides=moe)
    return sum(r["bytes"] for r in rows if not r["weight"]), rows


def _weighted_combine(self, x_sorted_MD, offsets_E, sorted_idx, topk_weight_TK):
    """The other order, for comparison: the experts unweighted, their outputs weighted in the combine."""
    return self.unpermute(self(x_sorted_MD, offsets_E), sorted_idx, topk_weight_TK)


def test_weights_on_the_swiglu_output_keep_no_expert_outputs(monkeypatch):
    ours, rows = _activations()
    monkeypatch.setattr(Experts, "combine_sorted", _weighted_combine)
    weighted, _ = _activations()
    cfg = presets.get("mula-7b-a1b@laptop").model
    rows_R = 64 * cfg.moe.top_k  # tokens x top-k: every assignment's row
    assert weighted - ours == rows_R * cfg.d_model * 2  # one bf16 (R, D) tensor
    assert any(r["weight"] for r in rows)  # the expert weight copies, listed apart


def test_the_command_prints_a_table_and_a_json_line(capsys):
    main(["--preset", "mula-7b-a1b@laptop", "--tokens", "64", "--seq", "32",
          "--set", "model.moe.norm_topk_probs=true"])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert summary["moe_overrides"] == {"norm_topk_probs": True} and summary["activations_gib"] > 0
    assert "saved by" in out[0]


def test_both_qk_norm_paths_keep_q_and_k_as_they_are():
    """The QK-norm, by the kernel or by the model's RMSNorm, keeps its input (the bf16 q and k
    projections) rather than float32 copies; torch's path keeps each norm's float32 rsqrt per
    token besides: 8 bytes per token."""
    kept = {}
    for path in ("torch", "triton"):
        rows = saved_tensors("mula-7b-a1b@laptop", tokens=64, seq=32, backend="triton", moe_overrides={},
                             qk_norm_rope=path)
        kept[path] = sum(r["bytes"] for r in rows if not r["weight"])
    assert kept["torch"] - kept["triton"] == 8 * 64


def test_a_float32_residual_stream_keeps_more(capsys):
    """The block's input and the residual after attention in float32 (4 bytes, not 2), the two
    norms' float32 normalised values (torch's ops, for a float32 input), and the q, k and v
    projections' three bf16 casts of the float32 normed input instead of one."""
    cfg = presets.get("mula-7b-a1b@laptop").model
    kept = {}
    for residual in ("bfloat16", "float32"):
        main(["--preset", "mula-7b-a1b@laptop", "--tokens", "64", "--seq", "32", "--residual", residual])
        kept[residual] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["activations_gib"] * 2 ** 30
    assert kept["float32"] - kept["bfloat16"] == pytest.approx((2 * 2 + 2 * 4 + 2 * 2) * cfg.d_model * 64)
