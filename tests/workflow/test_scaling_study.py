"""The scaling study (`optimus perfmodel`): sweeps from store runs and bench files, calibration on
the smaller device counts with the held-out error at the largest, and the store round trip the
figures and the report read."""
import json
from dataclasses import replace

import pytest

from optimus_core.store import open_store
from stages.scaling import ScalingOutputs, write_points
from stages.scaling_figure import read_scaling
from workflow import perfmodel as pm
from workflow import scaling_study as study

PRESET = "mula-7b-a1b@laptop"


def _truth() -> pm.Machine:
    """The machine the synthetic points are 'measured' on: h200 with knobs moved off the file's."""
    h200 = pm.load_machine("h200")
    return pm._apply(replace(h200, microbatch_overhead=2e-3, step_overhead=1e-3),
                     {"compute_efficiency": 0.2, "a2a_bandwidth": 0.3, "sync_bandwidth": 0.5})


def _point(devices: int, ep: int, machine: pm.Machine, **extra) -> dict:
    p = {"suite": "strong", "label": f"strong-ep{'all' if ep == devices else ep}-{devices}", "preset": PRESET,
         "overrides": {}, "device": "nvidia-h200", "devices": devices, "ep": ep,
         "optimizer": "ep_aware" if devices > 1 else "local", "global_batch": 8, "micro_batch": 2,
         "seq_len": 128, "dtype": "float32", **extra}
    return {**p, **pm.predict_point(p, machine).as_dict()}


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory):
    truth = _truth()
    points = [_point(1, 1, truth), _point(2, 2, truth), _point(4, 4, truth), _point(2, 1, truth),
              _point(4, 1, truth)]
    lines = points + [{"label": "weak-2", "suite": "weak", "devices": 2}, {"bench": "distributed_summary"}]
    path = tmp_path_factory.mktemp("bench") / "distributed-strong-nvidia-h200.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_sweeps_split_by_ep_rule_and_share_the_one_device_base(bench_file):
    sw = study.sweeps(study.file_points(bench_file))  # the weak record and the summary are not points
    assert list(sw) == [f"{PRESET} nvidia-h200 EP=1", f"{PRESET} nvidia-h200 EP=n"]
    for name, rule in zip(sw, ("EP=1", "EP=n")):
        assert [p["devices"] for p in sw[name]] == [1, 2, 4]
        assert {p["run_id"] for p in sw[name]} == {rule} and {p["sweep"] for p in sw[name]} == {name}
    assert [p["ep"] for p in sw[f"{PRESET} nvidia-h200 EP=n"]] == [1, 2, 4]
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a strong-scaling record without preset"):
        bad = bench_file.parent / "bad.jsonl"
        bad.write_text(json.dumps({"suite": "strong", "devices": 2}) + "\n")
        study.file_points(bad)


def test_held_out_points_are_predicted_from_the_smaller_ones(bench_file, tmp_path):
    result = study.run_study(None, [bench_file], out_json=tmp_path / "pm.json")
    assert json.loads((tmp_path / "pm.json").read_text()) == result
    holdout = result["holdout"]
    assert [(h["sweep"].split()[-1], h["devices"], h["fit_devices"]) for h in holdout] == [
        ("EP=1", 4, "1 2"), ("EP=n", 4, "1 2")]
    for h in holdout:  # points made by the model itself: the fit on 1 and 2 devices predicts 4
        assert abs(h["rel_error"]) < 0.05 and h["fitted_on"] == 2
    roles = {(m["run_id"], m["devices"]): m["role"] for m in result["measured"]}
    assert roles == {(r, n): "held-out" if n == 4 else "fitted" for r in ("EP=1", "EP=n") for n in (1, 2, 4)}
    model = [r for r in result["predicted"] if r.get("run_id")]
    assert sorted((r["run_id"], r["devices"]) for r in model) == sorted(roles)
    paper = [r for r in result["predicted"] if r["preset"] == "mula-220b-a10b"]
    assert [r["devices"] for r in paper if "scenario" not in r] == [384, 768, 1536, 3072, 6144, 12288]
    assert {r["scenario"] for r in paper if "scenario" in r} == {"overlap grad_sync", "design zero3-blocks"}
    assert result["paper"]["efficiency"][-1] == pytest.approx(paper[5]["efficiency"])
    # the what-if hides collectives: every step at most as long as the plain sweep's
    whatif = [r for r in paper if r.get("scenario") == "overlap grad_sync"]
    assert all(w["step_s"] <= p["step_s"] for w, p in zip(whatif, paper[:6]))
    assert len(result["paper"]["efficiency_overlap_grad_sync"]) == 6
    ours = [r for r in paper if r.get("scenario") == "design zero3-blocks"]
    assert [r["efficiency"] for r in ours] == result["paper"]["efficiency_zero3_blocks"]
    assert {r["pp"] for r in paper[:6]} == {8} and {r["pp"] for r in ours} == {1}


def test_store_round_trip_and_rerun_replace(bench_file, tmp_path):
    store_path = tmp_path / "store.zarr"
    cpu = [{**_point(n, n, pm.load_machine("cpu")), "device": "cpu"} for n in (1, 2)]
    for p in cpu:
        p.pop("suite"), p.pop("label")
    write_points("scaling-laptop-cpu", cpu, ScalingOutputs(store=store_path), attrs={"preset": PRESET})
    tpu = [{**_point(n, n, _truth()), "device": "tpu-v9"} for n in (1, 2)]
    (tmp_path / "tpu.jsonl").write_text("".join(json.dumps(p) + "\n" for p in tpu))

    result = study.run_study(store_path, [bench_file, tmp_path / "tpu.jsonl"])
    assert [s["name"] for s in result["sweeps"]] == [f"{PRESET} cpu EP=n", f"{PRESET} nvidia-h200 EP=1",
                                                     f"{PRESET} nvidia-h200 EP=n"]
    assert result["skipped"] == {f"{PRESET} tpu-v9 EP=n": "no machine file for device 'tpu-v9' (known: cpu, nvidia-h200)"}
    cpu_hold = [h for h in result["holdout"] if h["device"] == "cpu"]
    assert [(h["devices"], h["fit_devices"]) for h in cpu_hold] == [(2, "1")]

    measured, predicted, holdout = read_scaling(open_store(store_path, mode="r"))
    assert measured == [{k: v for k, v in m.items() if v is not None} for m in result["measured"]]
    assert predicted == result["predicted"] and holdout == result["holdout"]
    assert open_store(store_path, mode="r").attrs("perfmodel")["status"] == "completed"

    # a rerun with fewer sweeps replaces the tables: nothing of the first run is left over
    again = study.run_study(store_path, [])
    measured, predicted, holdout = read_scaling(open_store(store_path, mode="r"))
    assert len(measured) == 2 and holdout == again["holdout"] and len(holdout) == 1
    assert predicted == again["predicted"]


def test_cli_prints_the_held_out_errors_and_refuses_a_missing_file(bench_file, tmp_path, capsys):
    from workflow.cli import main

    out = tmp_path / "pm.json"
    assert main(["perfmodel", "--measured", str(bench_file), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"held out: {PRESET} nvidia-h200 EP=n at 4 devices: measured" in text
    assert "paper sweep on aurora: efficiency at 12288 tiles" in text and out.is_file()
    assert main(["perfmodel", "--measured", str(tmp_path / "nope.jsonl")]) == 1  # a missing input file: exit 1
    assert "--measured" in capsys.readouterr().err


def _cpu_design(truth: pm.Machine, settings=((16, 0, "fitted"), (8, 0, "held-out"))) -> list[dict]:
    """A held-out design as `optimus scaling` records it: settings (batch, micro-batch, role) x
    (1 rank, 2 ranks EP=2 / EP=1)."""
    points = []
    for gb, mb, role in settings:
        for n, ep in ((1, 1), (2, 2), (2, 1)):
            p = {"preset": PRESET, "overrides": {}, "device": "cpu", "devices": n, "ep": ep,
                 "optimizer": "ep_aware" if n > 1 else "local", "global_batch": gb, "micro_batch": mb or gb // n,
                 "seq_len": 128, "dtype": "float32", "experts_backend": "loop", "overlap_grad_sync": True,
                 "grad_sync_chunk_mb": 128.0, "setting": f"batch {gb}" + (f" micro {mb}" if mb else ""),
                 "role": role if n > 1 else "fitted", "cpu_wait": 0.01 * n}
            points.append({**p, **pm.predict_point(p, truth).as_dict()})
    return points


def test_a_held_out_design_is_fitted_on_its_fitted_points_and_tested_on_the_rest(tmp_path):
    cpu = pm.load_machine("cpu")
    truth = pm._apply(replace(cpu, rank_skew=0.1, dispatch_passes=20.0),
                      {"compute_efficiency": 0.3, "latency": 20.0, "compute_slots": 1.7, "microbatch_overhead": 0.02})
    write_points("scaling-laptop-cpu", _cpu_design(truth), ScalingOutputs(store=tmp_path / "store.zarr"),
                 attrs={"preset": PRESET})
    result = study.run_study(tmp_path / "store.zarr", [])
    (sweep,) = result["sweeps"]
    assert sweep["name"] == f"{PRESET} cpu" and sweep["design"] == "role" and sweep["fitted_on"] == 4
    assert sweep["fit_points"] == "1 batch 16, 2 EP=1 batch 16, 2 EP=n batch 16, 1 batch 8"  # sweep order
    holdout = result["holdout"]
    assert [(h["run_id"], h["devices"], h["ep"]) for h in holdout] == [("EP=1 batch 8", 2, 1), ("EP=n batch 8", 2, 2)]
    for h in holdout:  # points made by the model itself: the fit on the batch-16 layouts predicts batch 8
        assert abs(h["rel_error"]) < 0.03 and h["fit_points"] == sweep["fit_points"] and h["fit_devices"] == "1 2"
        assert h["predicted_a2a_s"] > 0 if h["ep"] == 2 else h["predicted_a2a_s"] == 0
    roles = {(m["run_id"], m["devices"]): m["role"] for m in result["measured"]}
    assert roles == {(f"EP={r} batch {gb}", n): "held-out" if gb == 8 and n == 2 else "fitted"
                     for r in ("1", "n") for gb in (8, 16) for n in (1, 2)}  # each setting's base in both EP sweeps
    model = {(r["run_id"], r["devices"]) for r in result["predicted"] if r.get("run_id")}
    assert model == set(roles)
    measured, predicted, stored = read_scaling(open_store(tmp_path / "store.zarr", mode="r"))
    assert stored == result["holdout"] and {m["role"] for m in measured} == {"fitted", "held-out"}


def test_a_second_fitted_setting_is_fitted_and_every_design_point_is_reported(tmp_path):
    from stages.scaling_figure import scaling_report_markdown

    cpu = pm.load_machine("cpu")
    truth = pm._apply(replace(cpu, rank_skew=0.1, dispatch_passes=20.0),
                      {"compute_efficiency": 0.3, "latency": 12.0, "a2a_bandwidth": 0.3, "compute_slots": 1.7})
    design = ((16, 0, "fitted"), (16, 2, "fitted"), (8, 0, "held-out"), (8, 2, "held-out"))
    write_points("scaling-laptop-cpu", _cpu_design(truth, design), ScalingOutputs(store=tmp_path / "store.zarr"),
                 attrs={"preset": PRESET})
    result = study.run_study(tmp_path / "store.zarr", [])
    (sweep,) = result["sweeps"]
    assert sweep["fitted_on"] == 8 and "2 EP=n batch 16 micro 2" in sweep["fit_points"]
    assert sweep["knobs"]["latency"] == pytest.approx(12.0, rel=0.02)  # per call and per byte told apart
    assert sweep["knobs"]["a2a_bandwidth"] == pytest.approx(0.3, rel=0.05)
    assert sorted((h["devices"], h["ep"], h["setting"]) for h in result["holdout"]) == [
        (2, 1, "batch 8"), (2, 1, "batch 8 micro 2"), (2, 2, "batch 8"), (2, 2, "batch 8 micro 2")]
    assert all(abs(h["rel_error"]) < 0.01 for h in result["holdout"])

    measured, predicted, holdout = read_scaling(open_store(tmp_path / "store.zarr", mode="r"))
    text = scaling_report_markdown(measured, predicted, holdout)
    table = text.split("Every measured point of *mula-7b-a1b@laptop on cpu*, fitted or held out", 1)[1]
    assert "a rank waited for a core for at most 2.0% of its pass" in table
    rows = [line for line in table.splitlines() if line.startswith("| 1 rank") or line.startswith("| 2 ranks")]
    assert len(rows) == 12  # every point once: the one-rank bases are not repeated per EP sweep
    assert "| 2 ranks EP=n batch 16 micro 2 | fitted |" in table and "| 2 ranks EP=1 batch 8 | held-out |" in table
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert float(cells[3]) == pytest.approx(float(cells[2]), rel=0.01)  # the model made the points: fits all
        assert abs(float(cells[4].rstrip("%"))) < 1 and cells[6] in ("1.0%", "2.0%")  # error; cpu_wait


def test_store_points_keep_the_executed_plans_dtype_and_experts(tmp_path):
    """stages/scaling records the dtype and experts backend each point's execution plan ran; the
    study reads them back and the model prices that backend (the loop's per-expert host time)."""
    machine = replace(pm.load_machine("h200"), expert_overhead=1e-3)
    points = []
    for n in (1, 2):
        p = {"preset": PRESET, "overrides": {}, "device": "nvidia-h200", "devices": n, "ep": n,
             "optimizer": "ep_aware" if n > 1 else "local", "global_batch": 8, "micro_batch": 2, "seq_len": 128,
             "dtype": "bfloat16", "experts_backend": "triton"}
        points.append({**p, **pm.predict_point(p, machine).as_dict()})
    write_points("scaling-h200", points, ScalingOutputs(store=tmp_path / "store.zarr"), attrs={"preset": PRESET})
    read = study.store_points(tmp_path / "store.zarr")
    assert [(p["devices"], p["dtype"], p["experts_backend"]) for p in read] == [(1, "bfloat16", "triton"),
                                                                                (2, "bfloat16", "triton")]
    for p, want in zip(read, points):
        layout = pm.point_layout(p)
        assert (layout.dtype, layout.experts) == ("bfloat16", "triton")
        assert pm.predict_point(p, machine).step_s == pytest.approx(want["step_s"])
        as_loop = pm.predict_point({**p, "experts_backend": "loop"}, machine)
        assert as_loop.compute_s > pm.predict_point(p, machine).compute_s
