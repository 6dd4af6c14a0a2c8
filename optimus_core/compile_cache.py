"""The compiled kernels a job starts with: Triton's and Inductor's caches, warm, on each node.

    use_compile_cache(local_rank)    # every rank, at its start, before any kernel compiles

A site that sets a shared cache (``OPTIMUS_COMPILE_CACHE``, exported by the site's jobs) has it
filled once by a small warm-up job (`optimus warm-cache`, which the paper DAG runs before the big
jobs): there ``OPTIMUS_COMPILE_CACHE_FILL=1`` and the ranks compile and autotune into the shared
directory itself. Every other job's ranks start from a copy of it on their node's own storage
(``OPTIMUS_NODE_LOCAL``, default /tmp): the node's local rank 0 copies it, published whole, and
the node's other ranks wait for it. So 12288 ranks neither compile what the warm-up job compiled
(the kernels' self-check included) nor write ``~/.triton`` on a shared file system, and Triton
keeps its autotuning results in the cache (``TRITON_CACHE_AUTOTUNING=1``) for the next process.

Without ``OPTIMUS_COMPILE_CACHE`` nothing changes (a laptop, or a site without one). A cache
directory that cannot be written is a ConfigError naming it, before anything compiles.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import MutableMapping

from .atomic import atomic_dir
from .config import ConfigError
from .log import get_logger

_log = get_logger(__name__)

SHARED, FILL, NODE_LOCAL = "OPTIMUS_COMPILE_CACHE", "OPTIMUS_COMPILE_CACHE_FILL", "OPTIMUS_NODE_LOCAL"
PARTS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def check_cache_dir(path: Path, what: str) -> None:
    """Make ``path`` if absent; ConfigError naming ``what`` and the path where it cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".optimus-write-probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{what} = {path}: cannot write there ({e.strerror or e})") from None


def use_compile_cache(local_rank: int = 0, env: MutableMapping[str, str] | None = None,
                      wait_s: float = 600.0, poll_s: float = 0.2) -> Path | None:
    """Point Triton and Inductor at this job's cache (the module doc) by setting their variables
    in ``env`` (os.environ); returns the directory they use, or None where the site set none."""
    env = os.environ if env is None else env
    shared = env.get(SHARED)
    if not shared:
        return None
    shared = Path(shared)
    if env.get(FILL) == "1":
        check_cache_dir(shared, SHARED)
        where = shared
    else:
        job = env.get("PBS_JOBID", "local").split(".")[0]
        root = Path(env.get(NODE_LOCAL) or "/tmp")
        where = root / f"optimus-compile-cache-{os.environ.get('USER', 'user')}-{job}"
        if local_rank == 0 and not where.exists():
            check_cache_dir(root, NODE_LOCAL)
            t0 = time.monotonic()
            with atomic_dir(where) as tmp:
                if shared.is_dir():
                    shutil.copytree(shared, tmp, dirs_exist_ok=True, symlinks=True)
                else:
                    _log.warning("no warm compile cache at %s (run `optimus warm-cache` first): compiling", shared)
            _log.info("compile cache: %s copied to %s in %.1f s", shared, where, time.monotonic() - t0)
        deadline = time.monotonic() + wait_s
        while not where.is_dir():  # the node's local rank 0 publishes it whole
            if time.monotonic() > deadline:
                raise TimeoutError(f"compile cache: {where} did not appear within {wait_s:.0f} s (the node's local "
                                   f"rank 0 copies {shared} there)")
            time.sleep(poll_s)
    for variable, part in PARTS.items():
        env[variable] = str(where / part)
    env["TRITON_CACHE_AUTOTUNING"] = "1"
    return where
