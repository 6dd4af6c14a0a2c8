"""The hosts a job's ranks run on: its node file less the hosts a run named faulty.

    optimus hosts --nodes 2 --faults RUN_DIR/node-faults.json --out HOSTFILE   # on the job's head node

A site whose mpiexec line has a ``{hostfile}`` placeholder starts its ranks on the hosts this
writes: the job's nodes in node-file order (``$PBS_NODEFILE``, each host once), without those a
run named in its ``node-faults.json`` (optimus_core.train.node_faults), the first ``nodes`` of
them. A job asks PBS for ``site.spare_nodes`` more nodes than its run needs, so that a host named
faulty by one attempt is left out of the next (the paper's relaunch without failed nodes);
without enough healthy nodes it stops before any rank starts, in one line that says so.
"""
from __future__ import annotations

import os
from pathlib import Path

from optimus_core.atomic import atomic_write
from optimus_core.config import ConfigError
from optimus_core.train import node_faults


class NotEnoughHosts(ValueError):
    """The job's healthy nodes are fewer than its run needs."""


def job_hosts(nodefile: Path) -> list[str]:
    """The job's hosts, each once, in node-file order (PBS lists a host once per chunk)."""
    try:
        lines = Path(nodefile).read_text().splitlines()
    except OSError as e:
        raise FileNotFoundError(f"node file {nodefile}: {e.strerror or e}") from None
    hosts: list[str] = []
    for line in (l.strip() for l in lines):
        if line and line not in hosts:
            hosts.append(line)
    if not hosts:
        raise ValueError(f"node file {nodefile}: lists no host")
    return hosts


def named(hosts: list[str], faulty: list[str]) -> list[str]:
    """The ``hosts`` that one of ``faulty`` names (node_faults.same_host), in their order."""
    return [h for h in hosts if any(node_faults.same_host(h, f) for f in faulty)]


def healthy_hosts(hosts: list[str], faulty: list[str], nodes: int, spare: int | None = None) -> list[str]:
    """The first ``nodes`` of ``hosts`` none of ``faulty`` names (node_faults.same_host);
    NotEnoughHosts naming what is missing where there are fewer."""
    if nodes < 1:
        raise ConfigError(f"--nodes = {nodes}: must be >= 1")
    left_out = named(hosts, faulty)
    healthy = [h for h in hosts if h not in left_out]
    if len(healthy) >= nodes:
        return healthy[:nodes]
    held = f"{len(hosts)} node(s)" + (f" ({spare} spare)" if spare is not None else "")
    if not left_out:
        raise NotEnoughHosts(f"the job holds {held}, the run needs {nodes}")
    raise NotEnoughHosts(f"the job holds {held} and host(s) {', '.join(left_out)} were named faulty by the run: "
                         f"{len(healthy)} healthy of the {nodes} needed, so they cannot be left out; give the site "
                         f"spare nodes (site.spare_nodes), or clear the run's node-faults.json once they are mended")


def write_hostfile(out: Path, *, nodes: int, faults: Path | None, nodefile: Path | None = None,
                   log=print) -> list[str]:
    """``optimus hosts``: the hostfile ``out`` (one host a line) of the job's first ``nodes``
    healthy hosts; returns them. ``nodefile`` defaults to ``$PBS_NODEFILE``."""
    nodefile = nodefile or os.environ.get("PBS_NODEFILE")
    if not nodefile:
        raise ConfigError("optimus hosts: no --nodefile and no $PBS_NODEFILE (it runs inside a PBS job)")
    hosts = job_hosts(Path(nodefile))
    faulty = node_faults.read(faults)["hosts"] if faults is not None else []
    chosen = healthy_hosts(hosts, faulty, nodes, spare=len(hosts) - nodes)
    left_out = named(hosts, faulty)
    if left_out:
        log(f"optimus hosts: leaving out {', '.join(left_out)} (named faulty in {faults}); "
            f"running on {len(chosen)} of the job's {len(hosts)} nodes")
    atomic_write(out, "".join(f"{h}\n" for h in chosen))
    return chosen
