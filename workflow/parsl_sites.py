"""Parsl configurations built from a site (workflow/sites.py) and a plan (workflow/plan.py).

    from workflow.experiments import get
    from workflow.sites import load_site
    from workflow.plan import plan
    from workflow.parsl_sites import parsl_config, parsl_cpu_config
    site = load_site("aurora", account="MyProject")
    config = parsl_config(site, plan(get("pretrain-mula-7b-a1b").paper, site), "results/parsl/x")
    cpu = parsl_cpu_config(site, "results/parsl/tokenize")   # the tokenize fan-out's executor

``parsl_config(site, job, run_dir)`` builds the Parsl ``Config`` (HighThroughputExecutor +
LocalProvider or PBSProProvider) for one planned job (a ``JobPlan`` of workflow/plan.py): one
block of ``job.nodes`` nodes, one worker on its head node, no Parsl retries (a run that spans
several jobs, or is retried, gets a new job per attempt: workflow/launch.py). The workers reach the
interchange at ``site.address``, or at the address of ``site.address_interface`` (Aurora: hsn0).
``parsl_cpu_config(site, run_dir)`` builds the site's CPU executor
(``site.cpu_executor``) for many single-core Python tasks, its block planned by ``cpu_job``.
Parsl itself is imported only inside these functions.
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path

from optimus_core.config import ConfigError
from workflow.plan import JobPlan, plan
from workflow.sites import SiteConfig


def worker_init(site: SiteConfig, job: JobPlan) -> str:
    """The job script's preamble: module loads / venv, the environment exports, then the lines of
    the job's size (site.at_scale: Copper's start, whose paths the exports may name)."""
    lines = list(site.worker_init)
    lines += [f"export {k}={shlex.quote(v)}" for k, v in job.env.items()]
    lines += job.init
    return "\n".join(lines)


def parsl_config(site: SiteConfig, job: JobPlan, run_dir: str | Path, label: str = "optimus"):
    """The Parsl Config running ``job``: one block of ``job.nodes`` nodes, one worker on its head
    node; the app itself starts the ranks with ``job.mpiexec``."""
    from parsl.config import Config
    from parsl.executors import HighThroughputExecutor
    from parsl.launchers import SimpleLauncher

    provider = _provider(site, job, SimpleLauncher())
    executor = HighThroughputExecutor(
        label=label, max_workers_per_node=site.max_workers_per_node, provider=provider,
        heartbeat_period=site.heartbeat_period, heartbeat_threshold=site.heartbeat_threshold, **_address(site),
    )
    # No Parsl retries, and no replacement block while the task is still outstanding (strategy
    # "none": the initial block only): a new attempt is a new job of workflow/launch.py's chain.
    return Config(executors=[executor], retries=0, run_dir=str(run_dir), strategy="none", usage_tracking=0)


def _address(site: SiteConfig) -> dict:
    """The interchange address the workers connect to: the site's, else its interface's (Aurora:
    hsn0, the login node's high-speed network), else Parsl's guess."""
    if site.address:
        return {"address": site.address}
    if site.address_interface:
        from parsl.addresses import address_by_interface

        try:
            return {"address": address_by_interface(site.address_interface)}
        except OSError as e:
            raise ConfigError(f"site {site.name}: address_interface = {site.address_interface!r}: this machine "
                              f"has no such interface ({e}); set site.address instead") from None
    return {}


def _provider(site: SiteConfig, job: JobPlan, launcher, max_blocks: int = 1):
    """The Parsl provider of ``job``'s blocks: PBS Pro (``job.nodes`` and its spares per block) or this machine."""
    from parsl.providers import LocalProvider, PBSProProvider

    class PolledPBSPro(PBSProProvider):  # Parsl fixes the qstat interval at 60 s; the site chooses
        @property
        def status_polling_interval(self):
            return site.status_polling_interval

    init = worker_init(site, job)
    if site.kind == "pbspro":
        return PolledPBSPro(
            account=job.account, queue=job.queue, scheduler_options=job.scheduler_options,
            select_options=site.select_options, worker_init=init, nodes_per_block=job.nodes + job.spare_nodes,
            cpus_per_node=site.cpus_per_node, init_blocks=1, min_blocks=0, max_blocks=max_blocks,
            walltime=job.walltime, launcher=launcher,
        )
    return LocalProvider(worker_init=init, init_blocks=1, min_blocks=0, max_blocks=max_blocks, launcher=launcher)


def cpu_job(site: SiteConfig) -> JobPlan:
    """One block of the site's CPU executor, planned like a training job (queue, walltime and
    account checked now, before anything is submitted)."""
    cpu = site.cpu_executor
    ranks = cpu.nodes * site.tiles_per_node if site.kind == "pbspro" else 1
    return plan(None, site, ranks=ranks, walltime_h=cpu.walltime_h)


def parsl_cpu_config(site: SiteConfig, run_dir: str | Path, label: str = "optimus_cpu"):
    """The Parsl Config of the site's CPU executor (``site.cpu_executor``): many single-core
    Python tasks over the cores of one or more nodes (the tokenize fan-out)."""
    from parsl.config import Config
    from parsl.executors import HighThroughputExecutor
    from parsl.launchers import MpiExecLauncher, SimpleLauncher

    cpu, job = site.cpu_executor, cpu_job(site)
    launcher = (SimpleLauncher() if cpu.launcher == "simple"
                else MpiExecLauncher(bind_cmd=cpu.bind_cmd, overrides=cpu.launcher_options))
    workers = cpu.workers_per_node or (site.cpus_per_node if site.kind == "pbspro" else os.cpu_count() or 1)
    executor = HighThroughputExecutor(
        label=label, max_workers_per_node=workers, provider=_provider(site, job, launcher, cpu.max_blocks),
        heartbeat_period=site.heartbeat_period, heartbeat_threshold=site.heartbeat_threshold, **_address(site),
    )
    return Config(executors=[executor], retries=site.retries, run_dir=str(run_dir), strategy="simple",
                  usage_tracking=0)
