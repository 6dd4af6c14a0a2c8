"""`optimus scaling`: a measured strong-scaling sweep on CPU ranks, its store rows and its errors."""
import json
import sys

import pytest

from optimus_core.config import ConfigError
from optimus_core.store import open_store
from stages.scaling import (PointLayout, ScalingConfig, ScalingOutputs, add_efficiency, best_point, loaded,
                            parse_setting, run_scaling)

TINY = {"model.n_layers": 1, "data.seq_len": 16}
PHASES = ("compute_s", "a2a_s", "grad_sync_s", "optimizer_s", "idle_s")


def test_held_out_design_measures_every_layout_interleaved_and_stores_roles(tmp_path):
    # one pass each, then one more over the layouts whose pass waited for a core longer than 1 us
    # (on Linux nearly every pass: the retry loop runs, over the ranks of both worlds)
    config = ScalingConfig(preset="mula-7b-a1b@laptop", devices=(2, 1), ep=("all", 1), global_batch=4,
                           holdout=((2, 0),), steps=1, warmup=1, rounds=1, retries=1, max_cpu_wait=1e-6,
                           overrides=TINY, run_id="scaling-test")
    result = run_scaling(config, ScalingOutputs(store=tmp_path / "store.zarr", jsonl=tmp_path / "points.jsonl"),
                         progress=False)
    points = result.points
    assert [(p["devices"], p["ep"], p["global_batch"], p["role"]) for p in points] == [
        (1, 1, 4, "fitted"), (2, 2, 4, "fitted"), (2, 1, 4, "fitted"),
        (1, 1, 2, "fitted"), (2, 2, 2, "held-out"), (2, 1, 2, "held-out")]  # a setting's base is fitted
    assert [p["setting"] for p in points] == ["batch 4"] * 3 + ["batch 2"] * 3
    one, ep2, ep1 = points[:3]
    assert one["optimizer"] == "local" and one["a2a_s"] == 0 and one["grad_sync_s"] == 0  # nothing to exchange
    assert ep2["a2a_s"] > 0 and ep2["grad_sync_s"] > 0  # experts split over 2 ranks
    assert ep1["a2a_s"] == 0 and ep1["grad_sync_s"] > 0  # every rank holds every expert: no all-to-all
    for p in points:
        assert p["steps"] == p["rounds"]  # passes of one timed step each
        if sys.platform == "linux":  # schedstat: how long the ranks waited for a core
            assert 0 <= p["cpu_wait"] < 1
            assert p["rounds"] == 2 or p["cpu_wait"] <= 1e-6  # a pass that waited longer was measured again
        assert p["step_s_spread"] >= 0  # the point is its fastest pass
        assert isinstance(p["devices"], int) and isinstance(p["ep"], int)
        assert sum(p[k] for k in PHASES) == pytest.approx(p["step_s"], rel=0.3)  # medians of parts vs of the whole
        assert p["tokens_per_s"] == pytest.approx(p["global_batch"] * 16 / p["step_s"], rel=0.3)
    # efficiency against the one-rank point of the same setting
    for base, multi in ((one, (ep2, ep1)), (points[3], points[4:])):
        assert base["efficiency"] == 1.0
        for p in multi:
            assert p["efficiency"] == pytest.approx(base["step_s"] / (2 * p["step_s"]))

    store = open_store(tmp_path / "store.zarr", mode="r")
    rows = store.metrics("scaling-test", "scaling")
    assert list(rows["step"]) == list(range(6)) and list(rows["ep"]) == [1, 2, 1, 1, 2, 1]
    assert rows["step_s"].tolist() == pytest.approx([p["step_s"] for p in points])
    attrs = store.attrs("scaling-test")
    assert attrs["preset"] == "mula-7b-a1b@laptop" and attrs["optimizers"] == {"1": "local", "2": "ep_aware"}
    assert attrs["roles"] == [p["role"] for p in points] and attrs["settings"] == [p["setting"] for p in points]
    lines = [json.loads(line) for line in (tmp_path / "points.jsonl").read_text().splitlines()]
    assert [(line["devices"], line["role"]) for line in lines] == [(p["devices"], p["role"]) for p in points]


def test_a_layout_is_loaded_when_the_pass_it_would_keep_waited_for_a_core():
    passes = [{"step_s": 2.0, "cpu_wait": 0.0}, {"step_s": 1.0, "cpu_wait": 0.3}]
    assert loaded(passes, 0.1) and not loaded(passes, 0.5)
    assert not loaded(passes + [{"step_s": 0.9, "cpu_wait": 0.05}], 0.1)  # a quiet, faster pass came
    assert not loaded([{"step_s": 1.0}], 0.1)  # not measured (no schedstat): never retried


def test_a_point_is_its_fastest_pass_whole():
    passes = [{"step_s": 2.0, "compute_s": 1.5, "steps": 1}, {"step_s": 1.0, "compute_s": 0.8, "steps": 1},
              {"step_s": 1.5, "compute_s": 1.0, "steps": 1}]
    assert best_point(passes) == {"step_s": 1.0, "compute_s": 0.8, "steps": 3, "rounds": 3, "step_s_spread": 1.0}


def test_layouts_without_a_design_carry_no_role():
    config = ScalingConfig(preset="mula-7b-a1b@laptop", devices=(1, 2, 4), ep=("all", 2))
    assert config.layouts() == [PointLayout(1, 1, 0, 0), PointLayout(2, 2, 0, 0), PointLayout(4, 4, 0, 0),
                                PointLayout(4, 2, 0, 0)]  # EP rules that coincide are measured once
    assert parse_setting("8") == (8, 0) and parse_setting("16:2") == (16, 2)
    with pytest.raises(ConfigError, match=r"scaling.holdout = 'x:2': must be GLOBAL_BATCH or GLOBAL_BATCH:MICRO_BATCH"):
        parse_setting("x:2")


def test_extra_fitted_settings_are_fitted_at_every_device_count():
    # the CPU design: batch 16 and its micro-batches of 2 fitted (4x the all-to-alls, each 1/4),
    # batch 8 held out; the one-rank point of every setting is fitted (the base of its efficiency)
    config = ScalingConfig(preset="mula-7b-a1b@laptop", devices=(1, 2), ep=("all", 1), global_batch=16,
                           fitted=((16, 2),), holdout=((8, 0),))
    assert [(lay.global_batch, lay.micro_batch, lay.devices, lay.ep, lay.role) for lay in config.layouts()] == [
        (16, 0, 1, 1, "fitted"), (16, 0, 2, 2, "fitted"), (16, 0, 2, 1, "fitted"),
        (16, 2, 1, 1, "fitted"), (16, 2, 2, 2, "fitted"), (16, 2, 2, 1, "fitted"),
        (8, 0, 1, 1, "fitted"), (8, 0, 2, 2, "held-out"), (8, 0, 2, 1, "held-out")]
    assert parse_setting("16:2", "fitted") == (16, 2)
    with pytest.raises(ConfigError, match=r"scaling.fitted = '16:x': must be GLOBAL_BATCH or"):
        parse_setting("16:x", "fitted")


def test_cli_passes_the_fitted_and_held_out_settings(capsys):
    from workflow.cli import main

    base = ["scaling", "--preset", "mula-7b-a1b@laptop", "--global-batch", "16", "--steps", "1"]
    assert main([*base, "--fitted", "16:2", "8", "--holdout", "8"]) == 2  # refused before any rank starts
    assert "scaling.holdout: (8, 0): is already in scaling.fitted" in capsys.readouterr().err
    assert main([*base, "--fitted", "16:2"]) == 2
    assert "scaling.fitted = [(16, 2)]: extra fitted settings belong to a held-out design" in capsys.readouterr().err


def test_efficiency_is_against_the_smallest_device_count():
    points = add_efficiency([{"devices": 4, "step_s": 1.0}, {"devices": 2, "step_s": 1.5}])
    assert [p["efficiency"] for p in points] == [pytest.approx(0.75), 1.0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices=(1, 3)), "parallel.ep = 3: must divide model.moe.n_experts"),
    (dict(devices=(1, 2), ep=4), "parallel.ep = 4: must divide the world size"),
    (dict(devices=(1, 4), global_batch=6), "global_batch = 6 sequences: must split evenly over 4 ranks"),
    (dict(devices=(0,)), "need device counts >= 1"),
    (dict(ep="some"), "must be 'all' or an integer"),
    (dict(steps=0), "scaling.steps = 0"),
    (dict(rounds=0), "scaling.rounds = 0"),
    (dict(retries=-1), "scaling.retries = -1: must be >= 0"),
    (dict(max_cpu_wait=1.0), r"scaling.max_cpu_wait = 1.0: must be in \(0, 1\)"),
    (dict(ep=("all", 0)), "scaling.ep = 0: must be 'all' or an integer"),
    (dict(holdout=((8,),)), r"scaling.holdout: \(8,\): must be a \(global_batch, micro_batch\) pair"),
    (dict(global_batch=8, holdout=((8, 0),)), r"scaling.holdout: \(8, 0\): is the main \(fitted\) setting"),
    (dict(global_batch=8, fitted=((8, 0),), holdout=((4, 0),)), r"scaling.fitted: \(8, 0\): is the main"),
    (dict(fitted=((8, True),), holdout=((4, 0),)), r"scaling.fitted: \(8, True\): must be a \(global_batch"),
    (dict(devices=(1, 2), fitted=((16, 3),), holdout=((8, 0),)), r"train.micro_batch = 3: must divide global_batch"),
    (dict(devices=(1, 2), holdout=((3, 0),)), "global_batch = 3 sequences: must split evenly over 2 ranks"),
])
def test_bad_sweeps_fail_before_any_rank_starts(kwargs, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        config = ScalingConfig(preset="mula-7b-a1b@laptop", **kwargs)
        run_scaling(config, ScalingOutputs(store=tmp_path / "s.zarr"), progress=False)
    assert not (tmp_path / "s.zarr").exists()
