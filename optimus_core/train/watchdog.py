"""A per-rank watchdog: a stuck rank becomes a clear error and a non-zero exit, not a silent hang.

    with Watchdog(timeout_s=1800, rank=mesh.rank) as dog:   # 0 = off
        while ...:
            one_step()
            dog.beat(step)                                   # after every completed step

A daemon thread wakes a few times per timeout. When no heartbeat has come for ``timeout_s``
seconds it writes one line to stderr naming the rank and the last completed step, and ends the
process with ``HANG_EXIT_CODE`` through ``os._exit``: a rank blocked inside a collective (or a
kernel, or a dead file system) cannot be interrupted any other way, and a non-zero exit is what
lets a launcher (``optimus pretrain --max-restarts``, Parsl ``retries``, a PBS resubmit) restart
the run from its newest checkpoint. The other ranks of the job see the same silence (their
collectives wait on this rank) and end the same way, or earlier through the collective timeout
(``parallel.collective_timeout_s``) or the local launcher terminating the survivors.

The timeout must outlast the slowest legitimate gap between two heartbeats of the loop: the
first step (``torch.compile`` warm-up) above all, hence the generous default
(``train.watchdog_timeout_s`` = 30 min). Saves, loads and evaluations are phases with their own,
larger limit (``train.watchdog_io_timeout_s``), since a multi-terabyte checkpoint at 12k ranks
can outlast any step but is still bounded:

    with dog.phase("checkpoint save", timeout_s=7200):   # the clock restarts on entry and on exit
        save()
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator, TextIO

HANG_EXIT_CODE = 124  # as timeout(1) reports a command it had to stop


class Watchdog:
    def __init__(self, timeout_s: float, rank: int = 0, *, exit_code: int = HANG_EXIT_CODE,
                 stream: TextIO | None = None, on_timeout: Callable[[str], None] | None = None):
        """``on_timeout(message)`` replaces the exit (tests of the thread itself); by default the
        message goes to ``stream`` (stderr) and the process ends with ``exit_code``."""
        if timeout_s < 0:
            raise ValueError(f"timeout_s = {timeout_s}: must be >= 0 (0 = no watchdog)")
        self.timeout_s, self.rank, self.exit_code = float(timeout_s), rank, exit_code
        self.stream, self.on_timeout = stream, on_timeout
        self.last_step: int | None = None
        self._last_beat = time.monotonic()
        self._phase: tuple[str, float] | None = None  # (what, its timeout) while one runs
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def beat(self, step: int) -> None:
        """Progress: ``step`` completed (cheap enough for every step)."""
        self.last_step = step
        self._last_beat = time.monotonic()

    @contextlib.contextmanager
    def phase(self, what: str, timeout_s: float) -> Iterator[None]:
        """A stretch without steps (a checkpoint save or load, an evaluation) watched with its own
        ``timeout_s`` (0: unwatched) instead of the step timeout; the clock restarts on entry and
        on exit, and a stall in it is reported as a stall in ``what``."""
        outer = self._phase
        self._phase = (what, float(timeout_s))
        self._last_beat = time.monotonic()
        try:
            yield
        finally:
            self._phase = outer
            self._last_beat = time.monotonic()

    @property
    def current_timeout_s(self) -> float:
        """The limit now: the phase's while one runs, else the step timeout (0: none)."""
        return self._phase[1] if self._phase is not None else self.timeout_s

    def start(self, step: int | None = None) -> "Watchdog":
        """Start the clock (``step``: the step the run starts from, for the message)."""
        if step is not None:
            self.last_step = step
        self._last_beat = time.monotonic()
        if self.enabled and self._thread is None:
            self._stopped.clear()
            self._thread = threading.Thread(target=self._watch, name=f"watchdog-rank{self.rank}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def message(self, silent_s: float) -> str:
        step = "none yet" if self.last_step is None else str(self.last_step)
        if self._phase is not None:
            what, limit = self._phase
            where, knob = f"in the {what} after step {step}", f"train.watchdog_io_timeout_s = {limit:g} s"
        else:
            where, knob = f"after step {step} (last completed step {step})", f"train.watchdog_timeout_s = {self.timeout_s:g} s"
        return (f"rank {self.rank}: no progress for {silent_s:.1f} s {where}; watchdog timeout {knob}: this rank "
                f"or a collective it waits in is stuck. Exiting with status {self.exit_code}; rerun (or let the "
                f"launcher restart) to resume from the newest checkpoint")

    def _watch(self) -> None:
        poll_s = min(max(self.timeout_s / 10, 0.05), 10.0)
        while not self._stopped.wait(poll_s):
            silent_s = time.monotonic() - self._last_beat
            limit = self.current_timeout_s
            if not limit or silent_s < limit:
                continue
            text = self.message(silent_s)
            if self.on_timeout is not None:
                self.on_timeout(text)
                return
            stream = self.stream or sys.stderr
            try:
                stream.write(f"\nwatchdog: {text}\n")
                stream.flush()
            finally:
                os._exit(self.exit_code)
