"""The `optimus` command: bad input stops before any work, with the field named."""
import json

import pytest

from optimus_core import presets
from workflow.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_presets_table_lists_every_preset(capsys):
    code, out, _ = run(capsys, "presets")
    assert code == 0
    for name in presets.names():
        assert name in out
    assert "6.92B" in out and "1.28B" in out  # mula-7b-a1b total and active


@pytest.mark.parametrize("args, message", [
    (["--set", "train.stepz=3"], "unknown field train.stepz"),
    (["--set", "model.moe.top_k=100"], "model.moe.top_k = 100: must be between 1 and n_experts (16)"),
    (["--steps", "-5"], "train.steps = -5: must be >= 1"),
    (["--set", "train.steps=ten"], "train.steps = 'ten': must be an integer"),
    (["--set", "steps"], "expected key=value"),
    (["--ep", "3"], "parallel.ep = 3: must divide model.moe.n_experts (16)"),
])
def test_bad_config_stops_before_any_work(capsys, tmp_path, args, message):
    out_dir = tmp_path / "run"
    code, _, err = run(capsys, "pretrain", "--preset", "mula-7b-a1b@laptop", "--data", str(tmp_path / "none"),
                       "--out", str(out_dir), *args)
    assert code == 2
    assert message in err
    assert not out_dir.exists()


def test_an_error_is_one_line_unless_debug(capsys, tmp_path):
    argv = ["pretrain", "--preset", "mula-7b-a1b@laptop", "--data", "x", "--out", str(tmp_path / "r"),
            "--set", "train.steps=ten"]
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.splitlines() == [
        "optimus pretrain: configuration error: train.steps = 'ten': must be an integer"]
    code, _, err = run(capsys, *argv, "--debug")
    assert code == 2 and err.startswith("Traceback") and "ConfigError" in err
    assert err.splitlines()[-1] == "optimus pretrain: configuration error: train.steps = 'ten': must be an integer"


def test_json_is_the_summary_for_programs(capsys, monkeypatch):
    code, out, _ = run(capsys, "presets", "--json")
    rows = {row["preset"]: row for row in json.loads(out)["presets"]}
    assert code == 0 and rows.keys() == set(presets.names())
    model = presets.get("mula-7b-a1b").model
    assert rows["mula-7b-a1b"]["params"] == model.num_params() and rows["mula-7b-a1b"]["experts"] == 64
    monkeypatch.setenv("OPTIMUS_ACCOUNT", "TestProj")
    code, out, _ = run(capsys, "plan", "--site", "aurora", "--json", "pretrain-mula-1b")
    job = json.loads(out)["jobs"][0]
    assert code == 0 and job["run"] == "pretrain-mula-1b" and job["nodes"] >= 1 and job["pbs"]


def test_unknown_preset_and_experiment(capsys, tmp_path):
    code, _, err = run(capsys, "pretrain", "--preset", "mula-3b", "--data", "x", "--out", str(tmp_path / "r"))
    assert code == 2 and "unknown; known presets" in err
    code, _, err = run(capsys, "pretrain", "--experiment", "nope", "--data", "x", "--out", str(tmp_path / "r"))
    assert code == 2 and "experiment = 'nope': unknown" in err


def test_pretrain_evaluate_figures_report(capsys, tmp_path, tokens_dir):
    store, run_dir = tmp_path / "store.zarr", tmp_path / "runs" / "smoke"
    code, out, err = run(capsys, "pretrain", "--preset", "mula-7b-a1b@laptop", "--data", str(tokens_dir),
                         "--out", str(run_dir), "--steps", "3", "--store", str(store), "--quiet",
                         "--set", "train.eval_batches=1")
    assert code == 0, err
    assert "smoke: 3 steps" in out
    assert (run_dir / "summary.json").is_file() and (run_dir / "meta.json").is_file()
    code, out, err = run(capsys, "evaluate", "--run", str(run_dir), "--store", str(store), "--max-batches", "2",
                         "--json")
    assert code == 0, err
    doc = json.loads(out)  # the whole of stdout is one JSON object
    assert doc["run_id"] == "smoke" and doc["step"] == 3 and doc["loss"] > 0
    assert doc["eval_json"] == str(run_dir / "eval.json")
    assert run(capsys, "figures", "--store", str(store), "--out", str(tmp_path / "figures"))[0] == 0
    assert run(capsys, "report", "--store", str(store), "--figures", str(tmp_path / "figures"),
               "--out", str(tmp_path / "report.md"))[0] == 0
    from optimus_core.store import open_store
    s = open_store(store, mode="r")
    assert s.runs().set_index("run_id").loc["smoke", "status"] == "completed"
    assert list(s.metrics("smoke")["step"]) == [1, 2, 3]
    assert len(s.metrics("smoke", "heldout")) == 1
    assert "smoke" in (tmp_path / "report.md").read_text()


def test_a_run_directory_belongs_to_one_run(capsys, tmp_path, tokens_dir):
    run_dir = tmp_path / "run"
    base = ["pretrain", "--preset", "mula-1b@laptop", "--data", str(tokens_dir), "--out", str(run_dir),
            "--steps", "1", "--quiet", "--set", "train.eval_batches=1"]
    assert run(capsys, *base, "--run-id", "a")[0] == 0
    code, _, err = run(capsys, *base, "--run-id", "b")
    assert code == 1 and "holds run 'a', not 'b'" in err


def test_execution_prints_the_plan_of_a_device_not_here_with_its_reasons(capsys):
    """`optimus execution`: which kernel runs on a PVC tile, and why, from any machine."""
    assert main(["execution", "--preset", "mula-7b-a1b", "--device", "xpu", "--world", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["device"], out["world"], out["probed"]) == ("xpu", 12, False)
    plan = out["plan"]
    assert plan["experts"] == "triton" and plan["expert_gemms"] == "descriptor" and plan["compile"] is False
    assert "NVIDIA" in plan["why"]["expert GEMMs"]
    assert main(["execution", "--experiment", "pretrain-mula-220b-a10b", "--device", "cuda"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("mula-220b-a10b on 3072 rank(s) of cuda (not on this machine") and "expert GEMMs" in text


@pytest.mark.parametrize("argv, message", [
    (["--preset", "mula-1b", "--experiment", "pretrain-mula-1b"], "needs --preset NAME or --experiment NAME"),
    (["--preset", "mula-1b", "--world", "0"], "--world = 0: must be >= 1"),
    (["--preset", "mula-1b", "--device", "tpu"], "--device tpu: must be auto, cpu, cuda or xpu"),
])
def test_execution_refuses_what_it_cannot_plan_in_one_line(argv, message, capsys):
    assert main(["execution", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_experiments_list_each_run_in_lines_a_terminal_holds(capsys):
    assert main(["experiments"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "pretrain-mula-1b (pretrain)" and lines[1].lstrip().startswith("paper ")
    assert max(map(len, lines)) <= 100
