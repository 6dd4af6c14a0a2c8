"""Faults a long run survives: a scheduler's stop signal, and non-finite or spiking losses.

    guard = LossGuard(spike_factor=2.0, max_bad=3)
    if not guard.accept(loss): ...          # skip this batch (no update)
    if guard.should_roll_back: ...          # K bad steps in a row: back to the last checkpoint

    with StopRequest() as stop:             # SIGTERM / SIGUSR1 / SIGINT set stop.requested
        ...                                  # the loop checkpoints and raises Preempted
"""
from __future__ import annotations

import signal
import statistics
import threading
from collections import deque

RESUBMIT_EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; launchers rerun the command, which resumes
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports Ctrl-C
STOP_EXIT_CODES = (RESUBMIT_EXIT_CODE, INTERRUPTED_EXIT_CODE)


class Preempted(Exception):
    """The run stopped on request after saving a checkpoint; rerunning the command resumes it.
    ``exit_code``: 130 after SIGINT (Ctrl-C), else the resubmit status 75."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(f"stopped by {signal_name} after step {step}; a checkpoint is saved, "
                         f"rerun the same command to resume")
        self.step, self.signal_name = step, signal_name

    @property
    def exit_code(self) -> int:
        return INTERRUPTED_EXIT_CODE if self.signal_name == "SIGINT" else RESUBMIT_EXIT_CODE


class Diverged(RuntimeError):
    """Training cannot go on: bad losses with no checkpoint to roll back to, or a rollback that
    leads back to the same failure. The message is one line saying what to change."""


def describe_event(event: dict) -> str:
    """A fault the loop handled (Trainer.events), in one sentence for the log."""
    kind, step = event.get("kind"), event.get("step")
    if kind == "nonfinite":
        return f"step {step}: the loss is not finite ({event.get('loss')}): batch skipped, no update"
    if kind == "spike":
        return f"step {step}: loss {event.get('loss'):.4g} spiked above the recent median: batch skipped, no update"
    if kind == "rollback":
        return (f"step {step}: {event.get('bad_steps')} bad losses in a row: rolled back to the checkpoint of "
                f"step {event.get('to_step')}, the data since skipped")
    if kind == "nonfinite_grad_norm":
        return (f"step {step}: the gradient norm of the last update was not finite: its weights are lost, "
                f"rolled back to the newest checkpoint")
    if kind == "node_fault":
        return (f"step {step}: the loss is not finite on host(s) {', '.join(event.get('hosts', []))} only: "
                f"a node fault; stopping without an update or a checkpoint")
    if kind == "nonfinite_state":
        return (f"step {step}: the weights or the optimizer state hold non-finite values: no checkpoint written "
                f"(the previous one stays the newest)")
    return f"step {step}: {kind}: " + ", ".join(f"{k} {v}" for k, v in event.items() if k not in ("kind", "step"))


class LossGuard:
    """Judges each step's loss against a robust running estimate (the median of recent good ones).

    A loss is bad if it is not finite, or (after ``warmup`` good steps) above ``spike_factor``
    times that median. Bad losses never enter the estimate. The decision depends only on the
    sequence of losses, so ranks that see the same (all-reduced) losses agree.
    """

    def __init__(self, spike_factor: float | None = 2.0, max_bad: int = 3, window: int = 50, warmup: int = 20):
        self.spike_factor, self.max_bad, self.warmup = spike_factor, max_bad, warmup
        self.recent: deque[float] = deque(maxlen=window)
        self.consecutive_bad = 0

    def judge(self, loss: float) -> str | None:
        """None for a good loss, else the reason ("nonfinite" or "spike")."""
        if loss != loss or loss in (float("inf"), float("-inf")):
            return "nonfinite"
        if self.spike_factor and len(self.recent) >= self.warmup and loss > self.spike_factor * statistics.median(self.recent):
            return "spike"
        return None

    def accept(self, loss: float) -> bool:
        if self.judge(loss) is None:
            self.recent.append(loss)
            self.consecutive_bad = 0
            return True
        self.consecutive_bad += 1
        return False

    @property
    def should_roll_back(self) -> bool:
        return self.consecutive_bad >= self.max_bad

    def reset(self) -> None:
        self.consecutive_bad = 0

    def state_dict(self) -> dict:
        """What a resumed run needs to judge the next losses as the uninterrupted one would."""
        return {"recent": list(self.recent), "consecutive_bad": self.consecutive_bad}

    def load_state_dict(self, state: dict) -> None:
        self.recent.clear()
        self.recent.extend(float(x) for x in state["recent"])
        self.consecutive_bad = int(state["consecutive_bad"])


class StopRequest:
    """SIGTERM and SIGUSR1 (a scheduler's walltime warning), and SIGINT (Ctrl-C), ask the loop to
    stop after the step; the first one received is the one named.

    Handlers are installed only in the main thread and restored on exit.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        if self.signal_name is None:  # Ctrl-C reaches a launcher's ranks twice: itself, and forwarded
            self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                signum = getattr(signal, name, None)
                if signum is not None:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
