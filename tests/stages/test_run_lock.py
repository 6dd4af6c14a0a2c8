"""A run directory is trained by one process at a time: the run lock (optimus_core/train/run_lock.py).

The lock itself first (no training: milliseconds), then through `optimus pretrain` on a tiny run:
a live lock refuses with one sentence and changes nothing, a stale one is taken over, the lock
is gone after the run whatever its end, and a no-op re-run of a finished run never touches it.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from optimus_core.train import run_lock
from optimus_core.train.run_lock import RunDirBusy, RunLock
from tiny_runs import digest, pretrain

HOST = socket.gethostname()
REFUSAL_END = "wait for it to finish or stop it; a lock whose heartbeat stops is taken over after 300 s"


def write_lock(run_dir: Path, *, host: str = HOST, pid: int | None = None, age_s: float = 0.0,
               run_id: str = "r") -> bytes:
    """A lock as another holder leaves it: its heartbeat ``age_s`` seconds ago."""
    beat = time.time() - age_s
    raw = json.dumps({"host": host, "pid": os.getpid() if pid is None else pid, "run_id": run_id,
                      "token": "someone-else", "started": beat - 60, "heartbeat": beat}).encode()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.lock").write_bytes(raw)
    return raw


def dead_pid() -> int:
    """The pid of a process of this host that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def holder(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.lock").read_text())


@pytest.fixture
def lock_log():
    """The run lock's log records (the optimus loggers may not propagate to pytest's caplog)."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("optimus.train.run_lock")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


# ----------------------------------------------------------------------------- the lock alone

def test_a_lock_holds_who_trains_and_is_gone_after_the_block(tmp_path):
    with RunLock(tmp_path, "r1") as lock:
        held = holder(tmp_path)
        assert (held["host"], held["pid"], held["run_id"], held["token"]) == (HOST, os.getpid(), "r1", lock.token)
        assert held["heartbeat"] >= held["started"] > time.time() - 60
    assert not (tmp_path / "run.lock").exists()
    with pytest.raises(RuntimeError, match="boom"):
        with RunLock(tmp_path, "r1"):
            assert (tmp_path / "run.lock").is_file()
            raise RuntimeError("boom")
    assert not (tmp_path / "run.lock").exists()


def test_a_live_lock_of_this_host_refuses_and_is_left_as_it_was(tmp_path):
    with RunLock(tmp_path, "first"):
        before = (tmp_path / "run.lock").read_bytes()
        with pytest.raises(RunDirBusy) as refused:
            RunLock(tmp_path, "second").acquire()
        assert (tmp_path / "run.lock").read_bytes() == before
    message = str(refused.value)
    assert message.startswith(f"{tmp_path} is being trained by pid {os.getpid()} on host {HOST} (heartbeat ")
    assert message.endswith(f"s ago, run first): {REFUSAL_END}")
    assert isinstance(refused.value, FileExistsError)  # the CLI's one-line, exit-1 error


def test_a_fresh_lock_of_another_host_refuses(tmp_path):
    raw = write_lock(tmp_path, host="login-7.elsewhere", pid=dead_pid(), age_s=12)  # its pid means nothing here
    with pytest.raises(RunDirBusy, match=r"is being trained by pid \d+ on host login-7.elsewhere \(heartbeat 12 s "
                                         r"ago, run r\)"):
        RunLock(tmp_path, "r").acquire()
    assert (tmp_path / "run.lock").read_bytes() == raw


def test_the_lock_of_a_dead_process_of_this_host_is_taken_over_with_a_warning(tmp_path, lock_log):
    pid = dead_pid()
    write_lock(tmp_path, pid=pid, age_s=1)  # a fresh heartbeat: the pid alone says it is dead
    with RunLock(tmp_path, "r") as lock:
        assert holder(tmp_path)["token"] == lock.token and holder(tmp_path)["pid"] == os.getpid()
        assert lock.took_over["pid"] == pid and "no longer running on this host" in lock.took_over["why"]
    warned = [r.getMessage() for r in lock_log if r.levelname == "WARNING"]
    assert warned == [f"{tmp_path}: took over the stale lock of pid {pid} on host {HOST} (heartbeat 1 s ago, "
                      f"run r) (pid {pid} is no longer running on this host)"]
    assert not (tmp_path / "run.lock").exists()


def test_the_lock_of_another_host_whose_heartbeat_stopped_is_taken_over(tmp_path):
    write_lock(tmp_path, host="x1921c0s3b0n0", pid=12345, age_s=301)  # a PBS job killed on another node
    with RunLock(tmp_path, "r") as lock:
        assert holder(tmp_path)["token"] == lock.token
        assert lock.took_over["host"] == "x1921c0s3b0n0"
        assert lock.took_over["why"].startswith("its heartbeat is 301 s old (limit 300 s)")


def test_a_half_written_lock_refuses_while_young_and_is_taken_over_when_old(tmp_path):
    (tmp_path / "run.lock").write_bytes(b'{"host": "h", "pi')  # a taker between its create and its write
    with pytest.raises(RunDirBusy, match="an unknown process"):
        RunLock(tmp_path, "r").acquire()
    old = time.time() - 400
    os.utime(tmp_path / "run.lock", (old, old))  # ... or one killed there, long ago
    with RunLock(tmp_path, "r") as lock:
        assert holder(tmp_path)["token"] == lock.token


def test_the_heartbeat_is_refreshed_while_the_lock_is_held(tmp_path):
    with RunLock(tmp_path, "r", heartbeat_s=0.05, stale_after_s=5) as lock:
        first = holder(tmp_path)
        time.sleep(0.4)
        later = holder(tmp_path)
        assert later["heartbeat"] >= first["heartbeat"] + 0.2  # several beats, not one at the end
        assert later["token"] == first["token"] == lock.token and later["started"] == first["started"]
        (tmp_path / "run.lock").unlink()  # removed by hand while the run trains: the next beat puts it back
        time.sleep(0.3)
        assert holder(tmp_path)["token"] == lock.token and not lock.lost
    assert not (tmp_path / "run.lock").exists()


def test_a_holder_whose_lock_was_taken_over_stops_and_leaves_the_new_lock(tmp_path, lock_log):
    lock = RunLock(tmp_path, "r", heartbeat_s=0.05, stale_after_s=5).acquire()
    raw = write_lock(tmp_path, host="other-node", pid=4242)  # taken over meanwhile
    deadline = time.time() + 5
    while not lock.lost and time.time() < deadline:
        time.sleep(0.02)
    assert lock.lost
    lock.release()
    assert (tmp_path / "run.lock").read_bytes() == raw  # the new holder's, untouched
    assert any("taken over by pid 4242 on host other-node" in r.getMessage() for r in lock_log)


def test_a_taker_that_judged_a_lock_stale_does_not_replace_the_one_taken_over_meanwhile(tmp_path, monkeypatch):
    write_lock(tmp_path, pid=dead_pid())
    slow, quick = RunLock(tmp_path, "r"), RunLock(tmp_path, "r")  # two jobs of one run
    judge = RunLock._why_stale

    def judged_then_overtaken(self, raw, holder, now):
        why = judge(self, raw, holder, now)
        if self is slow and why and not quick.held:  # between slow's verdict and its take-over
            quick.acquire()
        return why

    monkeypatch.setattr(RunLock, "_why_stale", judged_then_overtaken)
    with pytest.raises(RunDirBusy, match=f"being trained by pid {os.getpid()}"):
        slow.acquire()
    assert holder(tmp_path)["token"] == quick.token
    quick.release()


@pytest.mark.parametrize("stale", [False, True], ids=["no lock", "a stale lock"])
def test_of_concurrent_takers_exactly_one_holds_the_lock(tmp_path, stale):
    for attempt in range(10):
        run_dir = tmp_path / str(attempt)
        if stale:
            write_lock(run_dir, pid=dead_pid())
        else:
            run_dir.mkdir()
        locks = [RunLock(run_dir, "r") for _ in range(6)]  # six jobs of one run at once
        start, outcomes = threading.Barrier(len(locks)), {}

        def take(i, lock):
            start.wait()
            try:
                lock.acquire()
                outcomes[i] = "held"
            except RunDirBusy:
                outcomes[i] = "refused"

        threads = [threading.Thread(target=take, args=(i, lock)) for i, lock in enumerate(locks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [lock for i, lock in enumerate(locks) if outcomes[i] == "held"]
        assert len(winners) == 1, outcomes
        assert holder(run_dir)["token"] == winners[0].token
        assert not (run_dir / "run.lock.takeover").exists()
        winners[0].release()
        assert not (run_dir / "run.lock").exists()


def test_another_runs_lock_is_never_taken_over_even_stale(tmp_path):
    raw = write_lock(tmp_path, pid=dead_pid(), run_id="other")  # stale: its process is gone
    with pytest.raises(RunDirBusy, match=r"run.lock is the lock of run 'other', not of run 'r' .*stale"):
        RunLock(tmp_path, "r").acquire()
    assert (tmp_path / "run.lock").read_bytes() == raw  # untouched
    # the same run id, another run (its uid): refused too, live or stale
    lock = json.loads(raw)
    (tmp_path / "run.lock").write_text(json.dumps({**lock, "run_id": "r", "uid": "aaaa"}))
    with pytest.raises(RunDirBusy, match=r"uid aaaa, this one's is bbbb"):
        RunLock(tmp_path, "r", uid="bbbb").acquire()
    with RunLock(tmp_path, "r", uid="aaaa") as mine:  # its own run's stale lock: taken over, recording the uid
        assert holder(tmp_path)["uid"] == "aaaa" and mine.took_over is not None


def test_a_lock_that_is_a_link_to_another_directorys_is_refused(tmp_path):
    other = tmp_path / "other"
    raw = write_lock(other, pid=dead_pid())
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").symlink_to(other / "run.lock")
    with pytest.raises(RunDirBusy, match="is a link to .*other/run.lock"):
        RunLock(run, "r").acquire()
    assert (other / "run.lock").read_bytes() == raw and (run / "run.lock").is_symlink()


# ----------------------------------------------------------------------------- through `optimus pretrain`

def test_the_lock_is_gone_after_a_normal_end(finished_run):
    assert (finished_run / "summary.json").is_file() and not (finished_run / "run.lock").exists()


def test_pretrain_into_a_directory_another_live_process_trains_is_refused_untouched(small_tokens, run, capsys):
    write_lock(run, run_id="run-a")  # this very process, this host, a fresh heartbeat
    before = digest(run)
    capsys.readouterr()
    assert pretrain(small_tokens, run, 2) == 1
    err = capsys.readouterr().err
    assert f"optimus pretrain: error: {run} is being trained by pid {os.getpid()} on host {HOST} (heartbeat " in err
    assert f"s ago, run run-a): {REFUSAL_END}\n" in err
    assert digest(run) == before


def test_max_restarts_does_not_retry_a_refusal(small_tokens, run, capsys):
    """The attempt refused by a live lock says so once and is final: a rerun would be refused alike."""
    from workflow.cli import main

    from tiny_runs import TINY

    write_lock(run, run_id="run-a")
    before = digest(run)
    capsys.readouterr()
    assert main(["pretrain", "--preset", "mula-1b@laptop", "--data", str(small_tokens), "--out", str(run),
                 "--steps", "2", "--max-restarts", "3", *TINY]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"optimus pretrain: error: {run} is being trained by pid {os.getpid()} on host {HOST}")
    assert err.count("\n") == 1 and "restarting" not in err, err
    assert digest(run) == before


def test_pretrain_takes_over_a_stale_lock_trains_and_removes_it(small_tokens, run, capsys):
    write_lock(run, host="x1000c0s0b0n1", pid=777, age_s=3600, run_id="run-a")
    capsys.readouterr()
    assert pretrain(small_tokens, run, 2) == 0
    err = capsys.readouterr().err
    assert f"{run}: took over the stale lock of pid 777 on host x1000c0s0b0n1 (heartbeat 3600 s ago" in err
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert not (run / "run.lock").exists()


def test_the_lock_is_held_while_training_and_gone_after_a_failure(small_tokens, run, monkeypatch):
    from optimus_core.train.loop import Trainer

    seen = {}

    def fit(self):
        seen.update(holder(run))
        raise RuntimeError("boom in fit")

    monkeypatch.setattr(Trainer, "fit", fit)
    with pytest.raises(RuntimeError, match="boom in fit"):
        pretrain(small_tokens, run, 2)
    assert (seen["pid"], seen["host"], seen["run_id"]) == (os.getpid(), HOST, "run-a")
    assert not (run / "run.lock").exists()
    assert json.loads((run / "meta.json").read_text())["status"] == "failed"


def test_a_no_op_rerun_of_a_finished_run_does_not_touch_a_foreign_lock(small_tokens, run, capsys):
    raw = write_lock(run, host="x1000c0s0b0n1", pid=777, age_s=5, run_id="run-a")
    before = digest(run)
    capsys.readouterr()
    assert pretrain(small_tokens, run, 1) == 0
    assert "run-a: finished at step 1 already; nothing was trained or changed" in capsys.readouterr().out
    assert (run / "run.lock").read_bytes() == raw and digest(run) == before


def test_leftover_temporary_files_of_the_lock_do_not_make_a_run_directory_foreign(small_tokens, tmp_path):
    out = tmp_path / "fresh"
    out.mkdir()
    (out / ".run.lock.tmp-abc123").write_bytes(b"{")  # a heartbeat's write cut short
    assert pretrain(small_tokens, out, 1) == 0
    assert (out / "summary.json").is_file()


class OneRankOfTwo:
    """Rank ``rank`` of a world of two, whose collective (the ranks' agreement on the lock) says
    what rank 0 reported: 1.0 when it was refused."""

    def __init__(self, rank: int, rank0_failed: bool):
        self.rank, self.world_size, self.rank0_failed, self.agreed = rank, 2, rank0_failed, []

    def all_max(self, values):
        self.agreed.append(values)
        return [max(values[0], float(self.rank0_failed))]


def _stage_args(small_tokens, out):
    from optimus_core import presets
    from stages.pretrain import PretrainConfig, PretrainInputs, PretrainOutputs

    cfg = presets.get("mula-1b@laptop").run_config(**{"train.steps": 1, "train.device": "cpu"})
    return PretrainConfig(cfg, run_id="two"), PretrainInputs(small_tokens), PretrainOutputs(out), cfg


def test_the_other_ranks_neither_take_nor_are_refused_the_lock(small_tokens, tmp_path, monkeypatch):
    import stages.pretrain as stage

    out = tmp_path / "two"
    raw = write_lock(out, run_id="two")  # rank 0's (here: this process's), live
    monkeypatch.setattr(stage, "_train", lambda *a: "trained")
    mesh = OneRankOfTwo(rank=1, rank0_failed=False)
    assert stage._run_rank(*_stage_args(small_tokens, out), mesh) == "trained"
    assert mesh.agreed == [[0.0]] and (out / "run.lock").read_bytes() == raw


def test_the_other_ranks_stop_with_rank_0_when_it_is_refused_the_lock(small_tokens, tmp_path, monkeypatch):
    import stages.pretrain as stage

    out = tmp_path / "two"
    raw = write_lock(out, host="x1000c0s0b0n1", pid=777, age_s=3, run_id="two")
    monkeypatch.setattr(stage, "_train", lambda *a: pytest.fail("trained after rank 0 was refused"))
    with pytest.raises(RunDirBusy) as refused:  # not a hang in the first collective of the Trainer
        stage._run_rank(*_stage_args(small_tokens, out), OneRankOfTwo(rank=1, rank0_failed=True))
    assert str(refused.value).startswith(f"{out} is being trained by pid 777 on host x1000c0s0b0n1 (heartbeat ")
    mesh = OneRankOfTwo(rank=0, rank0_failed=False)  # rank 0 itself: refused, and says so to the others
    with pytest.raises(RunDirBusy, match="pid 777 on host x1000c0s0b0n1"):
        stage._run_rank(*_stage_args(small_tokens, out), mesh)
    assert mesh.agreed == [[1.0]]
    assert (out / "run.lock").read_bytes() == raw and sorted(p.name for p in out.iterdir()) == ["run.lock"]


def test_lock_parameters_are_checked():
    with pytest.raises(ValueError, match="need 0 < heartbeat_s < stale_after_s"):
        RunLock(".", "r", heartbeat_s=10, stale_after_s=5)
    assert run_lock.STALE_AFTER_S == 10 * run_lock.HEARTBEAT_S  # ten missed heartbeats, as the refusal says
