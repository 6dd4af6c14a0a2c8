"""How many of our jobs a queue holds at once: slots, one lock file each, held while a job is in it.

    with queue_slots(site, job.queue, wait_log=print):   # blocks while the queue is full
        submit(site, job, command, run_dir)

ALCF's debug and debug-scaling queues take one job per user, capacity five, and a project runs at
most ten: a job over a limit is refused by qsub (or held), and Snakemake would start every
training rule of the paper DAG at once. Each launcher (one per training rule, all on one login
node) takes a slot of its queue (``max_jobs_per_user`` of the site's queue table) and one of the
project (``max_jobs_per_project``) before it submits, and gives both back when its job has ended;
a launcher that dies gives them back with its process (the locks are ``flock``s). No limit, no
slot. The slot files live in ``site.slots_dir`` (default ~/.cache/optimus/queue-slots): one
directory for every launcher of the user on that machine.
"""
from __future__ import annotations

import fcntl
import os
import re
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

DEFAULT_DIR = "~/.cache/optimus/queue-slots"


@contextmanager
def slot(directory: str | Path, name: str, limit: int, *, poll_s: float = 10.0,
         wait_log: Callable[[str], None] | None = None) -> Iterator[int]:
    """Hold one of ``limit`` slots named ``name`` (waiting while all are held); yields its number."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    told = False
    while True:
        for k in range(limit):
            fd = os.open(directory / f"{safe}.{k}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                yield k
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return
        if wait_log and not told:
            wait_log(f"[optimus launch] {name}: all {limit} slot(s) held by our other jobs; waiting for one "
                     f"(the queue's limit per user)")
            told = True
        time.sleep(poll_s)


@contextmanager
def queue_slots(site, queue: str | None, *, poll_s: float = 10.0,
                wait_log: Callable[[str], None] | None = None) -> Iterator[None]:
    """A slot of ``queue`` (its ``max_jobs_per_user``) and one of the project
    (``site.max_jobs_per_project``), where the site's table sets them."""
    directory = site.slots_dir or DEFAULT_DIR
    with ExitStack() as stack:
        q = site.queues.get(queue) if queue else None
        if q is not None and q.max_jobs_per_user:
            stack.enter_context(slot(directory, f"{site.name}-{queue}", q.max_jobs_per_user, poll_s=poll_s,
                                     wait_log=wait_log))
        if site.kind == "pbspro" and site.max_jobs_per_project:
            stack.enter_context(slot(directory, f"{site.name}-project", site.max_jobs_per_project, poll_s=poll_s,
                                     wait_log=wait_log))
        yield
