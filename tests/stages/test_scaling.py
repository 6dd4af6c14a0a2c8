"""`optimus scaling`: a measured strong-scaling sweep on CPU ranks, its store rows and its errors."""
import json

import pytest

from optimus_core.config import ConfigError
from optimus_core.store import open_store
from stages.scaling import ScalingConfig, ScalingOutputs, add_efficiency, run_scaling

TINY = {"model.n_layers": 1, "data.seq_len": 16}


def test_sweep_on_one_and_two_cpu_ranks_writes_phases_to_the_store(tmp_path):
    config = ScalingConfig(preset="mula-7b-a1b@laptop", devices=(2, 1), global_batch=4, steps=2, warmup=1,
                           overrides=TINY, run_id="scaling-test")
    result = run_scaling(config, ScalingOutputs(store=tmp_path / "store.zarr", jsonl=tmp_path / "points.jsonl"),
                         progress=False)
    one, two = result.points
    assert (one["devices"], one["ep"], one["optimizer"]) == (1, 1, "local")
    assert (two["devices"], two["ep"], two["optimizer"]) == (2, 2, "ep_aware")
    assert one["a2a_s"] == 0 and one["grad_sync_s"] == 0  # one rank: nothing to exchange
    assert two["a2a_s"] > 0 and two["grad_sync_s"] > 0  # experts split over 2 ranks
    for p in result.points:
        phases = sum(p[k] for k in ("compute_s", "a2a_s", "grad_sync_s", "optimizer_s", "idle_s"))
        assert phases == pytest.approx(p["step_s"], rel=0.25)  # medians of parts vs median of the whole
        assert p["tokens_per_s"] == pytest.approx(4 * 16 / p["step_s"])
        assert p["global_batch"] == 4 and p["seq_len"] == 16
    assert one["efficiency"] == 1.0
    assert two["efficiency"] == pytest.approx(one["step_s"] / (2 * two["step_s"]))

    store = open_store(tmp_path / "store.zarr", mode="r")
    rows = store.metrics("scaling-test", "scaling")
    assert list(rows["step"]) == [1, 2] and list(rows["ep"]) == [1, 2]
    assert rows["step_s"].tolist() == pytest.approx([one["step_s"], two["step_s"]])
    attrs = store.attrs("scaling-test")
    assert attrs["preset"] == "mula-7b-a1b@laptop" and attrs["optimizers"] == {"1": "local", "2": "ep_aware"}
    lines = [json.loads(line) for line in (tmp_path / "points.jsonl").read_text().splitlines()]
    assert [line["devices"] for line in lines] == [1, 2]


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
])
def test_bad_sweeps_fail_before_any_rank_starts(kwargs, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        config = ScalingConfig(preset="mula-7b-a1b@laptop", **kwargs)
        run_scaling(config, ScalingOutputs(store=tmp_path / "s.zarr"), progress=False)
    assert not (tmp_path / "s.zarr").exists()
