"""The local launcher's restarts: a failed attempt is rerun (up to R times) and resumes; a stop
signal or a configuration error is final; `optimus pretrain --max-restarts` survives a kill -9."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from optimus_core.config import ConfigError
from optimus_core.train.restarts import ChildProcess, run_with_restarts
from optimus_core.store import open_store
from optimus_core.train import checkpoint as ckpt
from optimus_core.train.resilience import RESUBMIT_EXIT_CODE, Preempted, StopRequest


class Attempts:
    def __init__(self, statuses, stop_signal=None):
        self.statuses, self.calls, self.stop_signal = list(statuses), 0, stop_signal

    def __call__(self):
        self.calls += 1
        return self.statuses.pop(0)


def test_failed_attempts_are_rerun_until_one_succeeds():
    logged = []
    attempts = Attempts([137, RESUBMIT_EXIT_CODE, 0])
    assert run_with_restarts(attempts, 3, log=logged.append) == 0
    assert attempts.calls == 3
    assert logged[0].startswith("attempt 1 ended with status 137: restarting (1 of 3 restarts)")


def test_restarts_stop_when_used_up_or_pointless():
    attempts = Attempts([1, 1, 1, 1])
    assert run_with_restarts(attempts, 2, log=lambda m: None) == 1 and attempts.calls == 3
    attempts = Attempts([2, 0])
    assert run_with_restarts(attempts, 5, should_restart=lambda s: s != 2, log=lambda m: None) == 2
    assert attempts.calls == 1
    attempts = Attempts([RESUBMIT_EXIT_CODE, 0], stop_signal="SIGTERM")  # the scheduler wants us gone
    assert run_with_restarts(attempts, 5, log=lambda m: None) == RESUBMIT_EXIT_CODE and attempts.calls == 1
    with pytest.raises(ValueError, match="max_restarts = -1"):
        run_with_restarts(Attempts([0]), -1)


def _ok():
    pass


def _preempted():
    raise Preempted(4, "SIGUSR1")


def _bad_config():
    raise ConfigError("train.steps = 0: must be >= 1")


def _killed():
    os.kill(os.getpid(), signal.SIGKILL)


def _waits_for_stop(ready: str):
    with StopRequest() as stop:
        Path(ready).write_text("ready")
        while not stop.requested:
            time.sleep(0.01)
        raise Preempted(2, stop.signal_name)


def test_child_process_statuses():
    assert ChildProcess(_ok, start_method="fork")() == 0
    assert ChildProcess(_preempted, start_method="fork")() == RESUBMIT_EXIT_CODE
    assert ChildProcess(_bad_config, start_method="fork")() == 2
    assert ChildProcess(_killed, start_method="fork")() == 128 + signal.SIGKILL


def test_a_stop_signal_is_forwarded_to_the_attempt_and_ends_the_restarts(tmp_path):
    ready = tmp_path / "ready"
    attempt = ChildProcess(_waits_for_stop, (str(ready),), start_method="fork", poll_s=0.02)

    def signal_us():
        while not ready.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_us, daemon=True).start()
    assert run_with_restarts(attempt, 3, log=lambda m: None) == RESUBMIT_EXIT_CODE
    assert attempt.stop_signal == "SIGTERM"


SETS = ["train.eval_batches=1", "model.n_layers=1", "model.moe.n_experts=8", "model.moe.top_k=2",
        "train.global_batch=4", "data.seq_len=32", "train.device=cpu", "schedule.warmup_steps=2"]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(p) for p in f.read().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def test_cli_max_restarts_survives_a_kill_9_and_resumes_exactly(tokens_dir, tmp_path):
    # Both runs with the default threads (what a user gets): bit-exact resume must not need --threads 1.
    steps = 16

    def command(run_dir, store, *extra):
        cmd = [sys.executable, "-m", "workflow.cli", "pretrain", "--preset", "mula-7b-a1b@laptop", "--data",
               str(tokens_dir), "--out", str(run_dir), "--steps", str(steps), "--checkpoint-every", "2", "--quiet",
               "--store", str(store), *extra]
        for s in SETS:
            cmd += ["--set", s]
        return cmd

    subprocess.run(command(tmp_path / "straight", tmp_path / "straight.zarr"), check=True, capture_output=True)
    straight = open_store(tmp_path / "straight.zarr", mode="r").metrics("straight")
    run_dir, store = tmp_path / "run", tmp_path / "store.zarr"
    cmd = command(run_dir, store, "--max-restarts", "2")
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while ckpt.latest_valid(run_dir) is None or ckpt.latest_valid(run_dir).step < 6:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (attempt,) = _children(launcher.pid)
    os.kill(attempt, signal.SIGKILL)
    out, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, err[-3000:]
    assert "attempt 1 ended with status 137: restarting (1 of 2 restarts)" in err
    # the killed attempt left its run lock; the next one, on this host, found its pid dead and took it over
    assert f"{run_dir}: took over the stale lock of pid {attempt} on host " in err
    assert not (run_dir / "run.lock").exists()
    assert out.count(f"{steps} steps") == 1
    frame = open_store(store, mode="r").metrics(run_dir.name)
    assert list(zip(frame["step"].astype(int), frame["loss"])) == \
        list(zip(straight["step"].astype(int), straight["loss"]))  # bit for bit


def test_cli_max_restarts_is_checked(tokens_dir, tmp_path, monkeypatch, capsys):
    from workflow.cli import main

    argv = ["pretrain", "--preset", "mula-1b@laptop", "--data", str(tokens_dir), "--out", str(tmp_path / "r"),
            "--steps", "1"]
    assert main(argv + ["--max-restarts", "-1"]) == 2
    assert "--max-restarts = -1: must be >= 0" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(argv + ["--max-restarts", "1", "--nproc", "2"]) == 2
    assert ("--max-restarts = 1 under torchrun (world size 2): restart the whole job with that launcher"
            in capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("how, sig, status", [("group", "SIGTERM", 75), ("launcher", "SIGINT", 130)])
def test_a_stop_signal_to_a_two_rank_run_checkpoints_every_rank(tokens_dir, tmp_path, how, sig, status):
    """To the process group (a scheduler) or to the launcher alone (forwarded to its ranks): every
    rank checkpoints the same step, and the run exits with the stop status, saying how to resume."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "workflow.cli", "pretrain", "--preset", "mula-7b-a1b@laptop", "--data",
           str(tokens_dir), "--out", str(run_dir), "--steps", "100000", "--nproc", "2", "--quiet"]
    for s in SETS:
        cmd += ["--set", s]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while _children(launcher.pid) == [] or not (run_dir / "meta.json").is_file():
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(3)  # the ranks are in their step loop (rank 0 wrote meta.json just before it)
    signum = getattr(signal, sig)
    if how == "group":
        os.killpg(launcher.pid, signum)
    else:
        os.kill(launcher.pid, signum)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == status, err[-3000:]
    found = ckpt.latest_valid(run_dir)
    assert found is not None and found.meta["world_size"] == 2
    assert f"stopped by {sig} after step {found.step}; a checkpoint is saved, rerun the same command to resume" in err
