"""Start N local ranks of one function, as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    spawn_local(train_one_rank, nproc=4, args=(cfg,))    # returns when every rank has returned

Each rank is a fresh process (torch.multiprocessing spawn) whose environment holds the torchrun
variables, so ``init_distributed`` inside it reads them like any other launch. If one rank
fails, the others are terminated and the failure is raised here, instead of the survivors
hanging in a collective. A stop signal (SIGTERM, SIGUSR1, SIGINT) sent to the launcher alone is
forwarded to every rank, as torchrun does, so the ranks stop as they would had the whole process
group received it (the training loop checkpoints and exits with its stop status, which the
raised ProcessExitedException carries). (Rerunning a failed run: optimus_core.train.restarts.)
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from typing import Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn: Callable, nproc: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fn(*args)


def spawn_local(fn: Callable, nproc: int, args: tuple = (), start_method: str = "spawn",
                grace_s: float = 10.0) -> None:
    """Run ``fn(*args)`` on ``nproc`` local ranks (``fn`` must be importable: a module-level name).

    ``start_method="fork"`` skips re-importing torch in every rank (seconds each on a small CPU
    box): fine for CPU tests whose parent has not started accelerator or OpenMP work; the
    default ``spawn`` is always safe. When a rank fails, the others get ``grace_s`` seconds to
    end by themselves, then SIGTERM, then after ``grace_s`` more SIGKILL (a rank stuck in a
    collective does not act on SIGTERM).
    """
    if nproc < 1:
        raise ValueError(f"nproc = {nproc}: must be >= 1")
    context = mp.start_processes(_rank_main, args=(fn, nproc, free_port(), args), nprocs=nproc, join=False,
                                 start_method=start_method)
    with _forwarding_stop_signals(context.processes):
        while not context.join(grace_period=grace_s):
            pass


STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


@contextlib.contextmanager
def _forwarding_stop_signals(processes):
    """While the block runs, a stop signal to this process is sent on to each live one of
    ``processes`` instead of ending this one (main thread only: elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame):
        for p in processes:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    previous = {}
    for name in STOP_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is not None:
            previous[signum] = signal.signal(signum, forward)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
