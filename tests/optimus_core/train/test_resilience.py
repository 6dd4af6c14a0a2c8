"""Faults handled while running: NaN and spiking losses, rollbacks, the scheduler's stop signal."""
import json
import math
import os
import signal

import pytest
import torch

from optimus_core import presets
from optimus_core.train import checkpoint as ckpt
from optimus_core.train import disk_space
from optimus_core.train import loop as loop_module
from optimus_core.train import step as step_module
from optimus_core.train.loop import Trainer
from optimus_core.train.resilience import RESUBMIT_EXIT_CODE, Diverged, LossGuard, Preempted, describe_event

from sinks import ListSink


def tiny(**overrides):
    base = {"train.steps": 12, "train.eval_batches": 1, "train.device": "cpu", "schedule.warmup_steps": 2,
            "model.n_layers": 1}
    return presets.get("mula-7b-a1b@laptop").run_config(**{**base, **overrides})


def poison_loss(monkeypatch, calls: set[int], how):
    """Make the micro-batch loss misbehave on the given (1-based) calls of this test."""
    real, n = step_module.micro_batch_loss, [0]

    def patched(*args, **kwargs):
        n[0] += 1
        loss = real(*args, **kwargs)
        return how(loss) if n[0] in calls else loss

    monkeypatch.setattr(step_module, "micro_batch_loss", patched)


def test_loss_guard_rules():
    guard = LossGuard(spike_factor=2.0, max_bad=2, warmup=3)
    assert not guard.accept(float("nan")) and guard.judge(float("inf")) == "nonfinite"
    assert guard.accept(10.0)  # no estimate yet: spikes are not judged before `warmup` good losses
    for loss in (4.0, 4.2):
        assert guard.accept(loss)
    assert guard.judge(8.5) == "spike" and guard.judge(8.0) is None  # median 4.2 x 2 = 8.4
    assert not guard.accept(9.0) and not guard.should_roll_back
    assert not guard.accept(float("nan")) and guard.should_roll_back
    assert guard.accept(4.1) and guard.consecutive_bad == 0


def test_nan_loss_is_skipped_and_never_reaches_a_checkpoint(tokens_dir, tmp_path, monkeypatch):
    poison_loss(monkeypatch, {5}, lambda loss: loss * float("nan"))
    sink = ListSink()
    trainer = Trainer(tiny(), tokens_dir, tmp_path / "run", writer=sink, progress=False)
    summary = trainer.fit()
    assert summary.steps == 12 and len(sink.rows["train"]) == 12
    assert trainer.events == [{"kind": "nonfinite", "step": 5, "loss": trainer.events[0]["loss"]}]
    assert math.isnan(trainer.events[0]["loss"])
    assert all(math.isfinite(r["loss"]) for r in sink.rows["train"])
    state = ckpt.latest_valid(tmp_path / "run").load_model_state()
    assert all(torch.isfinite(v).all() for v in state.values())


def test_repeated_spikes_roll_back_to_the_checkpoint_and_skip_the_window(tokens_dir, tmp_path, monkeypatch):
    # 10x the loss on calls 24-26: the guard has 20+ good losses by then, 3 bad in a row roll back.
    poison_loss(monkeypatch, {24, 25, 26}, lambda loss: loss * 10)
    cfg = tiny(**{"train.steps": 30, "train.checkpoint_every": 10, "train.max_bad_steps": 3})
    trainer = Trainer(cfg, tokens_dir, tmp_path / "run", writer=ListSink(), progress=False)
    summary = trainer.fit()
    kinds = [e["kind"] for e in trainer.events]
    assert kinds == ["spike", "spike", "spike", "rollback"], trainer.events
    assert trainer.events[-1]["step"] == 23 and trainer.events[-1]["to_step"] == 20
    assert summary.steps == 30
    # the 3 rejected batches and the 3 of steps 21-23 are not drawn again: 26 + 10 batches in all
    state = trainer.loader.state_dict()
    assert state["epoch"] * (state["examples"] // 16 * 16) + state["position"] == 36 * cfg.train.global_batch


def test_no_checkpoint_to_roll_back_to_is_a_clear_error(tokens_dir, tmp_path, monkeypatch):
    poison_loss(monkeypatch, {3, 4}, lambda loss: loss * float("nan"))
    cfg = tiny(**{"train.max_bad_steps": 2})
    with pytest.raises(Diverged, match="2 bad losses in a row at step 2 and no checkpoint"):
        Trainer(cfg, tokens_dir, tmp_path / "run", progress=False).fit()


def test_a_rollback_that_leads_back_to_the_same_failure_stops_in_one_line(tokens_dir, tmp_path, monkeypatch):
    """Bad losses from step 5 on, whatever the batch: the first rollback (to step 4's checkpoint)
    is tried; the second, to the same checkpoint with no step gained, stops the run."""
    poison_loss(monkeypatch, set(range(5, 100)), lambda loss: loss * float("nan"))
    cfg = tiny(**{"train.checkpoint_every": 4, "train.max_bad_steps": 2})
    trainer = Trainer(cfg, tokens_dir, tmp_path / "run", progress=False)
    with pytest.raises(Diverged) as stopped:
        trainer.fit()
    assert [e["kind"] for e in trainer.events] == ["nonfinite", "nonfinite", "rollback", "nonfinite", "nonfinite"]
    line = str(stopped.value)
    assert "\n" not in line and "again after a rollback to the checkpoint of step 4" in line


def test_weights_that_are_not_finite_are_never_checkpointed(tokens_dir, tmp_path):
    """A save of non-finite weights writes nothing (a rollback to it would fail again): the
    previous checkpoint stays the newest, and the event says why."""
    trainer = Trainer(tiny(**{"train.steps": 2}), tokens_dir, tmp_path / "run", writer=ListSink(), progress=False)
    trainer.fit()
    assert ckpt.latest_valid(tmp_path / "run").step == 2
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("inf")
    trainer.step = 3
    assert trainer._save() is None
    assert ckpt.latest_valid(tmp_path / "run").step == 2
    assert trainer.events[-1] == {"kind": "nonfinite_state", "step": 3}
    assert "no checkpoint written" in describe_event(trainer.events[-1])


def test_fault_events_are_said_in_sentences():
    assert describe_event({"kind": "nonfinite", "step": 2, "loss": float("nan")}) == (
        "step 2: the loss is not finite (nan): batch skipped, no update")
    assert describe_event({"kind": "rollback", "step": 9, "to_step": 8, "bad_steps": 3}) == (
        "step 9: 3 bad losses in a row: rolled back to the checkpoint of step 8, the data since skipped")


def sigterm_at_call(monkeypatch, call: int):
    real, n = loop_module.train_step, [0]

    def patched(*args, **kwargs):
        n[0] += 1
        if n[0] == call:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered mid-step; handled after it
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_step", patched)
    return real


def test_sigterm_checkpoints_then_resume_continues_exactly(tokens_dir, tmp_path, monkeypatch):
    cfg = tiny(**{"train.steps": 8})
    straight = ListSink()
    Trainer(cfg, tokens_dir, tmp_path / "straight", writer=straight, progress=False).fit()

    real = sigterm_at_call(monkeypatch, 3)
    with pytest.raises(Preempted, match="stopped by SIGTERM after step 3"):
        Trainer(cfg, tokens_dir, tmp_path / "run", progress=False).fit()
    assert ckpt.latest_valid(tmp_path / "run").step == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    monkeypatch.setattr(loop_module, "train_step", real)
    resumed = ListSink()
    Trainer(cfg, tokens_dir, tmp_path / "run", writer=resumed, progress=False).fit()
    assert resumed.losses() == straight.losses()[3:]


def test_cli_exits_with_the_resubmit_status(tokens_dir, tmp_path, monkeypatch, capsys):
    from workflow.cli import main
    sigterm_at_call(monkeypatch, 2)
    run_dir = tmp_path / "run"
    code = main(["pretrain", "--preset", "mula-1b@laptop", "--data", str(tokens_dir), "--out", str(run_dir),
                 "--steps", "5", "--quiet", "--set", "train.eval_batches=1", "--set", "model.n_layers=1"])
    assert code == RESUBMIT_EXIT_CODE
    assert "rerun the same command to resume" in capsys.readouterr().err
    assert json.loads((run_dir / "meta.json").read_text())["status"] == "interrupted"
    assert not (run_dir / "summary.json").exists()
    assert not (run_dir / "run.lock").exists()  # the run directory's lock is given back on a stop too


def test_a_resumed_run_judges_a_spike_as_the_uninterrupted_run_does(tokens_dir, tmp_path, monkeypatch):
    """The loss guard's window is in the checkpoint: stopped at step 22 and resumed, the run skips
    the spike of step 24 (the guard judges spikes after 20 good losses) as the uninterrupted run
    does, with the same losses; tokens seen count the skipped batch."""
    cfg = tiny(**{"train.steps": 26})
    spike = lambda loss: loss * 10  # noqa: E731
    with monkeypatch.context() as m:
        poison_loss(m, {24}, spike)
        straight = ListSink()
        uninterrupted = Trainer(cfg, tokens_dir, tmp_path / "straight", writer=straight, progress=False)
        summary = uninterrupted.fit()
    assert [(e["kind"], e["step"]) for e in uninterrupted.events] == [("spike", 24)]
    assert summary.tokens == 27 * cfg.tokens_per_step  # 26 updates and the skipped batch
    with monkeypatch.context() as m:
        poison_loss(m, {24}, spike)  # one count over both parts of the interrupted run
        real = sigterm_at_call(m, 22)
        with pytest.raises(Preempted, match="after step 22"):
            Trainer(cfg, tokens_dir, tmp_path / "run", progress=False).fit()
        m.setattr(loop_module, "train_step", real)
        resumed = ListSink()
        again = Trainer(cfg, tokens_dir, tmp_path / "run", writer=resumed, progress=False)
        again.fit()
    assert [(e["kind"], e["step"]) for e in again.events] == [("spike", 24)]
    assert resumed.losses() == straight.losses()[22:]


def steps(run_dir):
    return [int(p.name.split("_")[1]) for p in ckpt.list_step_dirs(run_dir)]


def _every_step():
    return tiny(**{"train.steps": 3, "train.checkpoint_every": 1, "train.keep_checkpoints": 5})


def test_a_checkpoint_with_no_room_is_refused_before_writing_and_says_so(tokens_dir, tmp_path, monkeypatch):
    real, calls = disk_space.free_bytes, []

    def free(path):
        calls.append(path)
        return real(path) if len(calls) < 2 else 10 * 2**20  # room for step 1 only: 10 MiB free after

    monkeypatch.setattr(disk_space, "free_bytes", free)
    with pytest.raises(disk_space.DiskFullError) as e:
        Trainer(_every_step(), tokens_dir, tmp_path / "run", progress=False).fit()
    text = str(e.value)
    assert "rank 0: no room for checkpoint step 2 in " in text and str(tmp_path / "run" / "checkpoints") in text
    assert "0.01 GiB are free (disk full)" in text and "GiB, " in text and "previous checkpoints are intact" in text
    assert steps(tmp_path / "run") == [1] and ckpt.latest_valid(tmp_path / "run").step == 1


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"),
                                     RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos "
                                                  "11028955648 vs 11028955548")])
def test_a_write_that_runs_out_of_space_names_the_disk_and_keeps_the_previous(tokens_dir, tmp_path, monkeypatch, failure):
    real_save, n = torch.save, [0]

    def save(obj, f, *args, **kwargs):
        n[0] += str(f).endswith("state.pt")
        if str(f).endswith("state.pt") and n[0] == 2:  # the second checkpoint's: the disk fills mid-write
            raise failure
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)
    with pytest.raises(disk_space.DiskFullError, match=r"writing checkpoint step 2 to .*step_000002 failed: the disk is "
                                                 r"full \(.* GiB free now; .*\)\. The previous checkpoints are intact"):
        Trainer(_every_step(), tokens_dir, tmp_path / "run", progress=False).fit()
    assert steps(tmp_path / "run") == [1] and ckpt.latest_valid(tmp_path / "run").step == 1
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name != "step_000001"]  # no temp left


def _corrupt(step_dir):
    with open(next(step_dir.glob("*.distcp")), "r+b") as f:
        f.seek(100)
        f.write(b"garbage")


def test_a_checkpoint_found_invalid_is_set_aside_so_pruning_keeps_the_valid_ones(tokens_dir, tmp_path):
    run = tmp_path / "run"
    cfg = tiny(**{"train.steps": 3, "train.checkpoint_every": 2, "train.keep_checkpoints": 2})
    Trainer(cfg, tokens_dir, run, progress=False).fit()  # step 2, and the last step, 3
    _corrupt(ckpt.checkpoints_dir(run) / "step_000003")
    longer = cfg.replace(train=cfg.train.replace(steps=5))
    with pytest.warns(UserWarning, match="step_000003: .* fails its sha256"):
        trainer = Trainer(longer, tokens_dir, run, progress=False)
    assert trainer.resumed_from == 2
    assert (ckpt.checkpoints_dir(run) / ckpt.INVALID / "step_000003").is_dir()  # kept aside, not deleted
    trainer.fit()  # saves 4 and 5; keeps two: before, the corrupt 3 was one of them and 2 went
    assert steps(run) == [4, 5]
    _corrupt(ckpt.checkpoints_dir(run) / "step_000005")
    with pytest.warns(UserWarning, match="fails its sha256"):
        assert ckpt.latest_valid(run).step == 4


def test_checkpoints_that_are_all_invalid_stop_the_run_unless_told_to_start_over(tokens_dir, tmp_path):
    run = tmp_path / "run"
    cfg = tiny(**{"train.steps": 2})
    Trainer(cfg, tokens_dir, run, progress=False).fit()
    _corrupt(ckpt.checkpoints_dir(run) / "step_000002")
    with pytest.warns(UserWarning, match="fails its sha256"), \
            pytest.raises(ValueError, match=r"checkpoints holds checkpoints up to step 2 and none is valid .*"
                                            r"pass --start-over"):
        Trainer(cfg, tokens_dir, run, progress=False)
    assert steps(run) == [2]  # nothing moved, nothing trained
    with pytest.warns(UserWarning, match="fails its sha256"):
        trainer = Trainer(cfg, tokens_dir, run, progress=False, start_over=True)
    assert trainer.resumed_from is None and steps(run) == []
    assert (ckpt.checkpoints_dir(run) / ckpt.INVALID / "step_000002").is_dir()
    trainer.fit()
    assert steps(run) == [2] and ckpt.latest_valid(run).step == 2
