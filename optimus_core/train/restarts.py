"""Rerun a failed run in a fresh process, up to R times: the local launcher's answer to a crash,
a kill, a watchdog exit or a resubmit status.

    status = run_with_restarts(ChildProcess(train, (args,)), max_restarts=3)

A training run resumes from its newest valid checkpoint by itself, so running the same command
again is all a restart needs. A stop signal (SIGTERM / SIGUSR1) that reaches the launcher is
forwarded to the run and ends the restarts: the scheduler wants the job gone.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from typing import Callable

from ..config import ConfigError
from ..log import get_logger
from .resilience import Preempted, StopRequest

_log = get_logger(__name__)


def exit_status(exitcode: int) -> int:
    """A child's status as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _child_main(fn: Callable, args: tuple) -> None:
    try:
        fn(*args)
    except Preempted as e:  # the run checkpointed on request: "try again" for any launcher
        _log.warning("%s", e)
        sys.exit(e.exit_code)
    except ConfigError as e:  # no rerun fixes it (the `optimus` command's status for it)
        _log.error("configuration error: %s", e)
        sys.exit(2)


class ChildProcess:
    """A callable that runs ``fn(*args)`` in a fresh process and returns its exit status.

    0 on success, the resubmit status (75) when the run stopped on request, 2 on a
    configuration error, 1 on another exception (its traceback printed), 128 + N when killed by
    signal N. While the child runs, SIGTERM and SIGUSR1 sent to this process are forwarded to
    it, and ``stop_signal`` names the signal.
    """

    def __init__(self, fn: Callable, args: tuple = (), start_method: str = "spawn", poll_s: float = 0.2):
        self.fn, self.args, self.poll_s = fn, args, poll_s
        self.context = multiprocessing.get_context(start_method)
        self.stop_signal: str | None = None

    def __call__(self) -> int:
        child = self.context.Process(target=_child_main, args=(self.fn, self.args), name="optimus-attempt")
        child.start()  # before our handlers exist: a forked child must not inherit them
        with StopRequest() as stop:
            forwarded = False
            while child.exitcode is None:
                child.join(self.poll_s)
                if stop.requested and not forwarded and child.exitcode is None:
                    self.stop_signal = stop.signal_name
                    os.kill(child.pid, getattr(signal, stop.signal_name))
                    forwarded = True
            if stop.requested:
                self.stop_signal = stop.signal_name
        return exit_status(child.exitcode)


def run_with_restarts(attempt: Callable[[], int], max_restarts: int, *,
                      should_restart: Callable[[int], bool] = lambda status: status != 0,
                      log: Callable[[str], None] = _log.warning) -> int:
    """Call ``attempt()`` (-> exit status) until it succeeds, at most ``1 + max_restarts`` times.

    A status for which ``should_restart`` is False (say, a configuration error, which no rerun
    fixes) ends the loop, and so does a stop signal the attempt reports (``attempt.stop_signal``,
    as ChildProcess sets it). Returns the last status.
    """
    if max_restarts < 0:
        raise ValueError(f"max_restarts = {max_restarts}: must be >= 0")
    for number in range(1, max_restarts + 2):
        status = attempt()
        stopped = getattr(attempt, "stop_signal", None)
        if status == 0 or stopped or number > max_restarts or not should_restart(status):
            if status and stopped:
                log(f"attempt {number} ended with status {status} after {stopped}: not restarting")
            elif status and number > max_restarts and should_restart(status):
                log(f"attempt {number} ended with status {status}: no restarts left ({max_restarts} allowed)")
            return status
        log(f"attempt {number} ended with status {status}: restarting ({number} of {max_restarts} restarts), "
            f"resuming from the newest valid checkpoint")
    raise AssertionError("unreachable")
