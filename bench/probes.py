"""Probes: a change made inside one benchmark variant's process, for an A/B no execution choice
expresses. A probe is not an option of the trainer; each answers one open question of
bench/NOTES.md and is deleted once answered.

    python bench/train_step.py --batch 8 --repeat 2 \\
        --variants 7b8l-default 7b8l-default~tma 7b8l-default~programs-116 7b8l-default~update-after
    python bench/profile_step.py --batch 8 --variant 7b8l-default~programs-116

A variant named ``<variant>~<probe>`` is bench/train_step.py's ``<variant>`` with the probe applied
while it is built and timed; ``<variant>~<probe>~<probe>`` applies both. The question (eighteenth
session): the warp-specialized forward / dx kernel is 8-22 % faster than the TMA kernel alone
and moved the 8 x 8 step by 0.2 %. Three explanations, one probe or reading each:
- the AdamW update runs beside the next forward, and each block's forward waits for its block's
  update: where the update and the forward's own memory passes bound that phase, faster GEMMs
  do not shorten it (~update-after, with and without ~tma);
- the warp-specialized kernel holds all of an SM's registers (168 a thread over 384 threads), so
  nothing runs beside it; the TMA kernel leaves 10-24K registers free in its up projection's
  forward and dx (~programs-N leaves whole SMs to the update instead);
- the GPU at its power limit, where hiding latency saves no energy (the gpu_* readings of
  bench/gpu_telemetry.py on every record).

  tma           the forward and dx by the Triton TMA kernel where the warp-specialized one would run
  programs-N    our persistent GEMM kernels (forward, dx, dW) on at most N programs, one per SM:
                the other SMs stay free for the update beside them (the H200 has 132)
  update-after  the update after the backward, not beside the next forward
  ws-pingpong   the warp-specialized kernel's ping-pong config (kernels/grouped_mm_ws.CONFIGS) at
                every shape instead of the cooperative default: the H200's step at micro-batch 2
                and 4, where ping-pong's kernels measured 2-4 % faster (twenty-third session)
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
from unittest import mock

PROBES = {
    "tma": "the forward and dx by the TMA kernel where the warp-specialized one would run",
    "programs-N": "our persistent GEMM kernels on at most N programs",
    "update-after": "the update after the backward, not beside the next forward",
    "ws-pingpong": "the warp-specialized kernel's ping-pong config at every shape",
}


def split(name: str) -> tuple[str, tuple[str, ...]]:
    """``"7b8l-default~tma~update-after"`` -> ("7b8l-default", ("tma", "update-after")); a name
    without a probe -> (name, ()). ValueError for a probe that is not one of PROBES."""
    base, *wanted = name.split("~")
    for probe in wanted:
        if probe not in PROBES and not re.fullmatch(r"programs-[1-9][0-9]*", probe):
            raise ValueError(f"{name!r}: unknown probe {probe!r}; probes: {', '.join(PROBES)}")
    return base, tuple(wanted)


def variant_type(variants):
    """An argparse ``type``: a name of ``variants``, or one with a probe (``<variant>~<probe>``)."""
    import argparse

    def check(name: str) -> str:
        try:
            base, _ = split(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if base not in variants:
            raise argparse.ArgumentTypeError(f"{base!r}: not a variant; variants: {', '.join(variants)}")
        return name
    return check


@contextlib.contextmanager
def applied(name: str):
    """The probes of variant ``name`` in effect inside the block (nothing for a plain variant)."""
    with contextlib.ExitStack() as stack:
        for probe in split(name)[1]:
            for patch in _patches(probe):
                stack.enter_context(patch)
        yield


def apply_for_process(name: str) -> None:
    """The probe of variant ``name`` in effect from now to the process's end: for a tool that looks
    into one variant's step (bench/profile_step.py, bench/memory_step.py)."""
    import atexit

    stack = contextlib.ExitStack()
    stack.enter_context(applied(name))
    atexit.register(stack.close)


def _patches(probe: str) -> list:
    # Modules by importlib: the kernels package's attribute grouped_mm is the function, not the module.
    if probe == "tma":
        launchers = importlib.import_module("kernels.grouped_mm")
        return [mock.patch.object(launchers, "ws_unsupported", lambda *args, **kwargs: "probe: the TMA kernel")]
    if probe.startswith("programs-"):
        tma = importlib.import_module("kernels.grouped_mm_tma")  # every launcher reads its _num_programs at each launch
        cap, real = int(probe.removeprefix("programs-")), tma._num_programs
        return [mock.patch.object(tma, "_num_programs", lambda device: min(cap, real(device)))]
    if probe == "update-after":
        execution = importlib.import_module("optimus_core.execution")
        real = execution.plan_execution

        def plan_execution(*args, **kwargs):
            return dataclasses.replace(real(*args, **kwargs), update_beside_forward=False)
        # measure_steps holds its own name for it; profile_step imports it at each call
        return [mock.patch.object(execution, "plan_execution", plan_execution),
                mock.patch.object(importlib.import_module("optimus_core.train.measure"), "plan_execution", plan_execution)]
    if probe == "ws-pingpong":
        ws = importlib.import_module("kernels.grouped_mm_ws")  # its launchers call default_config at each launch
        pingpong = ws.config_dict(*next(c for c in ws.CONFIGS if not c[4]))
        return [mock.patch.object(ws, "default_config", lambda n: pingpong)]
    raise AssertionError(probe)  # split() admits no other

