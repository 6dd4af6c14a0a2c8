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
  lm-head-f32-gemm
                the LM head's float32 dW summed over the loss's row chunks inside the GEMM
                (cuBLAS with a float32 C, torch's out_dtype overloads: CUDA only), where the
                default adds each chunk's bf16 product to the sum in a pass of its own (2.8-2.9 ms
                a step at 8 x 8, bench/NOTES.md); predicted -2 ms a step at 8 x 8
  autograd-norm RMSNorm as plain torch ops, autograd's chain for its backward (what it was until
                the twentieth session, which made it keep its input instead of float32 copies):
                the norm's own share of the step's change, apart from the bf16 residual stream's
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
    "lm-head-f32-gemm": "the LM head's float32 dW summed over the loss's chunks by the GEMM (CUDA)",
    "autograd-norm": "RMSNorm as plain torch ops, differentiated by autograd",
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
    if probe == "lm-head-f32-gemm":
        return [mock.patch.object(importlib.import_module("optimus_core.model.linear_cross_entropy"),
                                  "accumulate_dw", dw_summed_in_the_gemm)]
    if probe == "autograd-norm":
        return [mock.patch.object(importlib.import_module("optimus_core.model.layers").RMSNorm, "forward",
                                  norm_by_torch_ops)]
    raise AssertionError(probe)  # split() admits no other


def norm_by_torch_ops(self, x):
    """RMSNorm.forward as torch ops (the same forward bits): autograd keeps the float32 input copy
    and the normalised value for its backward."""
    import torch

    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def dw_summed_in_the_gemm(dw_VD, dlogits_CV, h_CD):
    """linear_cross_entropy.accumulate_dw's contract with the sum in the GEMM's float32 output:
    no bf16 product, no pass to add it (torch's mm / addmm ``out_dtype``, CUDA only)."""
    import torch

    if dw_VD is None:
        return torch.mm(dlogits_CV.T, h_CD, out_dtype=torch.float32)
    return torch.addmm(dw_VD, dlogits_CV.T, h_CD, out_dtype=torch.float32, out=dw_VD)
