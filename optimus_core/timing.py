"""Where a training step's time goes: device time per named phase, with one sync per step.

    timer = PhaseTimer(device)
    with timer.active():                       # the parallel layer reports into it
        with phase("compute"):                 # forward + backward
            ...                                # all_to_all inside: with phase("a2a")
        with phase("optimizer"): ...
    timer.totals()     # {"compute": s, "a2a": s, ...}: exclusive seconds, syncs once

A phase nested inside another is not counted in the outer one: the all-to-all inside a
forward is "a2a", not "compute". On CUDA / XPU each phase is a pair of device events on the
current stream (our collectives are synchronous: the stream waits for them, so their time lands
between the events); on the CPU it is wall time, which is the same thing there.

``phase(name)`` is free when no timer is active (a normal training run), so the model and the
parallel layer can mark their phases unconditionally. The active timer is a module global, not
a context variable, because the autograd engine runs CUDA backward passes (and the all-to-all's
backward with them) on its own thread while the main thread waits in ``backward()``.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch

_ACTIVE: "PhaseTimer | None" = None


class _Span:
    __slots__ = ("name", "start", "end", "children")

    def __init__(self, name: str, start):
        self.name, self.start, self.end, self.children = name, start, None, []


class PhaseTimer:
    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._events = self.device.type in ("cuda", "xpu")
        self._stack: list[_Span] = []
        self._done: list[_Span] = []  # top-level spans of this measurement

    def _mark(self):
        if not self._events:
            return time.perf_counter()
        event = getattr(torch, self.device.type).Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        span = _Span(name, self._mark())
        (self._stack[-1].children if self._stack else self._done).append(span)
        self._stack.append(span)
        try:
            yield
        finally:
            span.end = self._mark()
            self._stack.pop()

    @contextlib.contextmanager
    def active(self) -> Iterator["PhaseTimer"]:
        global _ACTIVE
        previous, _ACTIVE = _ACTIVE, self
        try:
            yield self
        finally:
            _ACTIVE = previous

    def _elapsed(self, span: _Span) -> float:
        if not self._events:
            return span.end - span.start
        return span.start.elapsed_time(span.end) / 1e3  # ms -> s

    def totals(self) -> dict[str, float]:
        """Exclusive seconds per phase since the last reset; waits for the device once."""
        if self._stack:
            raise RuntimeError(f"phase {self._stack[-1].name!r} is still open")
        if self._events:
            getattr(torch, self.device.type).synchronize(self.device)
        out: dict[str, float] = defaultdict(float)

        def visit(span: _Span) -> float:
            total = self._elapsed(span)
            out[span.name] += total - sum(visit(child) for child in span.children)
            return total

        for span in self._done:
            visit(span)
        return dict(out)

    def reset(self) -> None:
        self._done.clear()


def phase(name: str):
    """Time the block as ``name`` in the active PhaseTimer; a no-op when none is active."""
    return _ACTIVE.span(name) if _ACTIVE is not None else contextlib.nullcontext()
