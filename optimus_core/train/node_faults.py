"""Faults of a node, not of the model: a non-finite loss on some ranks while the others' are finite.

    hosts = suspect_hosts(mesh, stats.local_sums)   # a collective, on the failure path only
    if hosts:
        record(run_dir, step, hosts)                 # rank 0: run_dir/node-faults.json
        raise NodeFault(step, hosts)                 # every rank: exit status 76

Every rank trains the same weights, so a loss that is not finite on some ranks only was made by
their hardware, not by the model or the data (which diverge everywhere): the run stops there
without an update or a checkpoint, names the hosts in ``node-faults.json`` in the run directory,
and exits with NODE_FAULT_EXIT_CODE. A launcher that holds spare nodes leaves the named hosts out
of the next attempt (workflow/hostfile.py), which resumes from the newest checkpoint; this is
the paper's fault handling (its authors stop on a NaN/Inf, name the node in a file and relaunch
without it). A loss that is not finite on every rank is the model's, and the loss guard
(optimus_core.train.resilience) skips and rolls back as before.

Under pipeline stages only a last stage computes a loss: the pipeline (its P ranks) that gave
a non-finite one is named whole, since a fault on any of its stages reaches the loss there.

A rank's host is the name its launcher placed it by (MPICH's Hydra exports it; PALS and
torchrun do not, and the system's host name is taken): the name the job's node file and a
hostfile spell, up to the domain (``same_host``).
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from ..atomic import atomic_write  # (no torch at import: launchers read the file on a login node)

FAULTS_FILE = "node-faults.json"
NODE_FAULT_EXIT_CODE = 76  # distinct from the resubmit status 75: rerun without the named hosts
LAUNCHER_HOST_VARIABLES = ("MPIR_CVAR_CH3_INTERFACE_HOSTNAME",)  # MPICH Hydra: the host list's name


class NodeFault(RuntimeError):
    """Some ranks' losses are not finite while the others' are: their hosts are named in the run
    directory's node-faults.json and the run stops, with nothing updated or saved."""

    exit_code = NODE_FAULT_EXIT_CODE

    def __init__(self, step: int, hosts: list[str], path: Path | None = None):
        where = f" (named in {path})" if path is not None else ""
        super().__init__(f"step {step}: the loss is not finite on host(s) {', '.join(hosts)} and finite on the "
                         f"others{where}: a node fault, not the model's; nothing was updated or saved. Rerun "
                         f"without those hosts (a launcher with spare nodes leaves them out), which resumes from "
                         f"the newest checkpoint")
        self.step, self.hosts = step, hosts


def this_host() -> str:
    """The name this rank's launcher placed it by, else the system's host name."""
    return next((os.environ[v] for v in LAUNCHER_HOST_VARIABLES if os.environ.get(v)), socket.gethostname())


def same_host(a: str, b: str) -> bool:
    """Whether two spellings name one host: equal, or one the other with its domain
    (``x4102c5s0b0n0`` and ``x4102c5s0b0n0.hostmgmt2102.cm.aurora.alcf.anl.gov``)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def suspect_hosts(mesh, local_sums) -> list[str]:
    """The hosts whose ranks' losses are not finite while some others' are (sorted, no
    duplicates); [] when every rank's is, or none's (the model's fault, or no fault).
    ``local_sums``: this rank's loss sums before the mean over the ranks (StepStats.local_sums).
    Every rank calls it once the world's loss is not finite (a collective: one small all-gather)."""
    if local_sums is None or not mesh.distributed:
        return []
    import torch
    import torch.distributed as dist

    mine = {"rank": mesh.rank, "host": this_host(), "bad": not bool(torch.isfinite(local_sums).all()),
            "loss_rank": mesh.pp == 1 or mesh.pp_rank == mesh.pp - 1, "pipeline": list(mesh.pp_ranks)}
    everyone: list[dict] = [{}] * mesh.world_size
    dist.all_gather_object(everyone, mine)
    return select_hosts(everyone)


def select_hosts(ranks: list[dict]) -> list[str]:
    """``suspect_hosts``' verdict on every rank's record (``rank``, ``host``, ``bad``: its loss is
    not finite, ``loss_rank``: it computes a loss, ``pipeline``: its pipeline's ranks)."""
    judged = [r for r in ranks if r["loss_rank"]]
    bad = [r for r in judged if r["bad"]]
    if not bad or len(bad) == len(judged):
        return []
    named = {r["rank"] for r in bad} | {p for r in bad for p in r["pipeline"]}
    return sorted({r["host"] for r in ranks if r["rank"] in named})


def record(run_dir: Path, step: int, hosts: list[str]) -> Path:
    """Add ``hosts`` to ``run_dir/node-faults.json`` (written atomically; earlier entries kept)."""
    path = Path(run_dir) / FAULTS_FILE
    data = read(path)
    data["events"].append({"step": step, "hosts": hosts, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    data["hosts"] = sorted(set(data["hosts"]) | set(hosts))
    atomic_write(path, json.dumps(data, indent=1))
    return path


def read(path: Path) -> dict:
    """node-faults.json as {"hosts": [...], "events": [...]}; empty where there is none. A file
    that is not ours is an error naming it (a launcher must not run on hosts it cannot read)."""
    path = Path(path)
    if not path.is_file():
        return {"hosts": [], "events": []}
    try:
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and isinstance(data.get("hosts"), list) and isinstance(data.get("events"), list)
                and all(isinstance(h, str) for h in data["hosts"])):
            raise ValueError("not a mapping with lists 'hosts' and 'events'")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a node-faults file of ours ({e}); move it aside") from None
    return data
