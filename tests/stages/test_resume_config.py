"""A resume continues the same computation: settings outside RESUMABLE (optimus_core/train/
resumable.py) that differ from the run's are refused, all named with their old and new values,
and nothing is changed; the resumable ones that changed are recorded in meta.json's ``resumes``.
"""
import json
import shutil
from pathlib import Path

import pytest

from optimus_core import presets
from optimus_core.config import ConfigError
from optimus_core.train.resumable import RESUMABLE, config_changes, resumable, resume_changes
from tiny_runs import digest, pretrain







def meta(run: Path) -> dict:
    return json.loads((run / "meta.json").read_text())


# ----------------------------------------------------------------------------- the rule

def test_which_fields_a_resume_may_change():
    for field in ("train.steps", "train.checkpoint_every", "train.keep_checkpoints", "train.log_every",
                  "train.eval_every", "train.device", "data.path", "execution.compile", "execution.dtype",
                  "parallel.ep", "parallel.dp_shard"):
        assert resumable(field), field
    for field in ("model.d_model", "model.moe.n_experts", "optim.lr", "schedule.warmup_steps", "train.seed",
                  "train.global_batch", "train.eval_batches", "data.seq_len", "data.seed", "preset"):
        assert not resumable(field), field
    assert not resumable("train.steps_x") and not resumable("executions.dtype")  # whole names only
    assert all(why.strip() for why in RESUMABLE.values())


def test_a_refusal_names_every_field_that_may_not_change_and_only_those():
    old = presets.get("mula-1b@laptop").run_config(**{"train.steps": 10})
    new = old.replace(train=old.train.replace(steps=20, seed=3), optim=old.optim.replace(lr=old.optim.lr * 2),
                      execution=old.execution.replace(compile=False))
    assert config_changes(old.to_dict(), new) == {
        "execution.compile": ("auto", False), "optim.lr": (old.optim.lr, old.optim.lr * 2),
        "train.seed": (0, 3), "train.steps": (10, 20)}
    with pytest.raises(ConfigError) as refused:
        resume_changes(old.to_dict(), new, "runs/r")
    assert str(refused.value) == (
        f"runs/r holds checkpoints of a run with other settings, which a resume cannot change: optim.lr "
        f"{old.optim.lr!r} -> {old.optim.lr * 2!r}, train.seed 0 -> 3; use another --out for these settings, "
        f"or resume with the run's own")
    allowed = old.replace(train=old.train.replace(steps=20), execution=old.execution.replace(compile=False))
    assert resume_changes(old.to_dict(), allowed, "runs/r") == {"execution.compile": ("auto", False),
                                                                 "train.steps": (10, 20)}


def test_a_config_of_an_earlier_optimus_is_refused_naming_its_former_field():
    cfg = presets.get("mula-1b@laptop").run_config()
    saved = cfg.to_dict()
    saved["train"]["dtype"] = saved["execution"].pop("dtype")  # where an earlier Optimus kept it
    with pytest.raises(ConfigError, match=r"^train.dtype: a field of an earlier Optimus's config, which is "
                                          r"execution.dtype now"):
        config_changes(saved, cfg)

# ----------------------------------------------------------------------------- through `optimus pretrain`

def test_a_run_that_never_resumed_records_no_resumes(finished_run):
    assert meta(finished_run)["status"] == "completed" and "resumes" not in meta(finished_run)


@pytest.mark.parametrize("field", ["model.d_model", "train.seed"])
def test_a_resume_that_changes_what_the_run_computes_is_refused_untouched(small_tokens, run, field, capsys):
    section, name = field.split(".")
    old = meta(run)["config"][section][name]
    new = old * 2 if field == "model.d_model" else old + 1  # d_model: still a multiple of the heads
    before = digest(run)
    capsys.readouterr()
    assert pretrain(small_tokens, run, 2, f"{field}={new}", "train.log_every=2") == 2
    err = capsys.readouterr().err
    assert (f"optimus pretrain: configuration error: {run} holds checkpoints of a run with other settings, which a "
            f"resume cannot change: {field} {old} -> {new}; use another --out for these settings, or resume with "
            f"the run's own\n") in err  # train.log_every changed too, and is not named: it may
    assert digest(run) == before
    assert not (run / "run.lock").exists()


def test_a_resume_with_resumable_changes_trains_and_records_them(small_tokens, run, tmp_path):
    moved = tmp_path / "staged-tokens"  # the same tokens at another place
    shutil.copytree(small_tokens, moved)
    assert pretrain(moved, run, 2, "execution.compile=false", "train.log_every=2") == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    [first] = meta(run)["resumes"]
    assert first["step"] == 1 and first["at"]
    assert first["changed"] == {"data.path": [str(small_tokens.resolve()), str(moved.resolve())],
                                "execution.compile": ["auto", False], "train.log_every": [1, 2],
                                "train.steps": [1, 2]}
    assert meta(run)["config"]["execution"]["compile"] is False  # meta.json's config is the new one
    # the next resume compares with that: only the steps change now, and it is appended
    assert pretrain(moved, run, 3, "execution.compile=false", "train.log_every=2") == 0
    assert [r["changed"] for r in meta(run)["resumes"]] == [first["changed"], {"train.steps": [2, 3]}]
    # a resume that changes nothing (an interrupted run run again as it was) adds nothing
    (run / "summary.json").unlink()
    assert pretrain(moved, run, 3, "execution.compile=false", "train.log_every=2") == 0
    assert len(meta(run)["resumes"]) == 2 and meta(run)["status"] == "completed"


def test_a_run_without_checkpoints_starts_under_new_settings_freely(small_tokens, run):
    shutil.rmtree(run / "checkpoints")
    (run / "summary.json").unlink()
    assert pretrain(small_tokens, run, 1, "train.seed=5") == 0  # nothing to resume: nothing to refuse
    assert meta(run)["config"]["train"]["seed"] == 5 and "resumes" not in meta(run)
