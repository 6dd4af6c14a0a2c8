"""Start N local ranks of one function, as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    spawn_local(train_one_rank, nproc=4, args=(cfg,))    # returns when every rank has returned

Each rank is a fresh process (torch.multiprocessing spawn) whose environment holds the torchrun
variables, so ``init_distributed`` inside it reads them like any other launch. If one rank
fails, the others are terminated and the failure is raised here, instead of the survivors
hanging in a collective. (Rerunning a failed run: optimus_core.train.restarts.)
"""
from __future__ import annotations

import os
import socket
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
    while not context.join(grace_period=grace_s):
        pass
