"""bench/distributed.py's summary: medians over repeated passes, and weak efficiency taken
within each pass (weak-1 and weak-2 launched one after the other)."""
import pytest

from bench.distributed import plan, parse_args, summarize


def _point(label, pass_, step, back_to_back):
    return {"label": label, "suite": "weak", "devices": int(label[5]), "pass": pass_, "step_s": step,
            "step_back_to_back_s": back_to_back, "tokens_per_s": 8192.0 / step}


def test_weak_efficiency_is_paired_within_passes():
    # pass 1 ran 10 % slower on both points: paired ratios stay 0.9, unpaired medians would not
    records = [_point("weak-1", 0, 0.90, 0.88), _point("weak-2", 0, 1.00, 0.95),
               _point("weak-1", 1, 0.99, 0.97), _point("weak-2", 1, 1.10, 1.045),
               _point("weak-1", 2, 0.90, 0.88), {"label": "weak-2", "pass": 2, "error": "OOM"}]
    out = summarize(records, "gpu-x")
    assert out["weak_efficiency"] == pytest.approx(0.9)
    assert out["weak_efficiency_passes"] == pytest.approx([0.9, 0.9])
    assert out["weak_efficiency_back_to_back"] == pytest.approx(0.88 / 0.95 * 0.5 + 0.97 / 1.045 * 0.5)
    assert "weak_efficiency_nooverlap" not in out


def test_one_pass_gives_the_plain_ratio_and_no_pass_list():
    out = summarize([_point("weak-1", 0, 0.9, 0.9), _point("weak-2", 0, 1.0, 1.0)], "gpu-x")
    assert out["weak_efficiency"] == pytest.approx(0.9) and "weak_efficiency_passes" not in out


def test_repeat_is_an_option_and_the_plan_is_per_pass():
    args = parse_args(["--suites", "weak", "--repeat", "3"])
    assert args.repeat == 3
    assert [p["label"] for p in plan(args, 2)] == ["weak-1", "weak-2"]


def test_the_exchange_suite_compares_all_gather_with_all_to_all_at_ep_2_and_8():
    labels = [p["label"] for p in plan(parse_args(["--suites", "exchange"]), 8)]
    assert labels == ["exchange-ep2-all_to_all", "exchange-ep2-all_gather",
                      "exchange-ep8-all_to_all", "exchange-ep8-all_gather"]
    assert [p["label"] for p in plan(parse_args(["--suites", "exchange"]), 4)] == labels[:2]  # no EP 8 on 4 GPUs
    point = plan(parse_args(["--suites", "exchange"]), 2)[1]
    assert point["overrides"] == {"execution.expert_exchange": "all_gather"} and point["ep"] == 2
    records = [{"label": "exchange-ep2-all_to_all", "tokens_per_s": 100.0},
               {"label": "exchange-ep2-all_gather", "tokens_per_s": 90.0}]
    out = summarize(records, "gpu-x")
    assert out["exchange_all_gather_over_all_to_all_ep2"] == pytest.approx(0.9)
    assert "exchange_all_gather_over_all_to_all_ep8" not in out
