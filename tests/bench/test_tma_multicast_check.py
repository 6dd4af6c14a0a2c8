"""bench/tma_multicast_check.py on the CPU: the installed Triton's verdict, from a fresh process
(an interpreted kernel run earlier in this one leaves state that breaks Gluon's compiler).

What it must get right: where Gluon's TMA load takes ``multicast=`` (Triton 3.7 on), the PTX of
the load multicasts to the cluster; where it does not (3.6, the GPU machines' Triton), the same
broadcast layout compiles to a load per CTA, and the probe says false rather than failing.
"""
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
hopper = pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                             reason="this Triton has no Gluon Hopper language")

ROOT = Path(__file__).resolve().parents[2]


def test_the_verdict_follows_the_installed_gluon():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "bench/tma_multicast_check.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    verdict = json.loads(run.stdout.splitlines()[-1])
    tma = hopper.tma
    offers = any("multicast" in inspect.signature(getattr(tma, name)).parameters
                 for name in ("async_load", "async_copy_global_to_shared") if hasattr(tma, name))
    assert verdict["triton"] == triton.__version__
    assert len(verdict["tma_loads"]) == 1, verdict  # the one load, compiled for the cluster
    assert verdict["multicast"] == offers, verdict
