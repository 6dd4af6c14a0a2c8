"""Sites: where a run executes through Parsl. Planning here is plain Python; Parsl only at the end.

    >>> from workflow import sites
    >>> from workflow.experiments import get
    >>> site = sites.load_site("aurora", account="MyProject")
    >>> job = sites.plan(get("scaling-mula-220b-a10b-384").paper, site)
    >>> job.nodes, job.queue, job.walltime
    (32, 'debug-scaling', '01:00:00')
    >>> print(job.mpiexec)          # doctest: +ELLIPSIS
    mpiexec -n 384 --ppn 12 --cpu-bind list:1-8:...

A site is a validated ``SiteConfig`` read from the ``site:`` block of
``workflow/config/<name>.yaml`` (or any YAML file with such a block); ``local`` is built in.
Moving to another PBS machine, account or queue is a YAML edit, never a code edit: the queue
table, the launcher line (Aurora's PALS `mpiexec --ppn 12 --cpu-bind list:...`, or MPICH's
`mpiexec -ppn N`), module loads, environment and throughput assumption all live there.

Rank placement is site configuration too: ``cpu_bind`` binds local rank i to the i-th core set
of its list, and ``gpu_affinity`` (a ``GpuAffinity``) becomes a small ``sh -c`` wrapper between
mpiexec and the command that shows each rank only its own device -- on Aurora
ZE_AFFINITY_MASK=<gpu>.<tile> from PALS_LOCAL_RANKID, one tile per rank -- so the trainer core
never learns the node's topology (it takes device ``local_rank % device_count``, i.e. 0).

``plan(run, site)`` turns a registry run (or a bare rank count) into a ``JobPlan`` -- nodes,
queue, walltime, the ``#PBS`` lines, the mpiexec prefix, the environment, an estimate of the
run's hours and node-hours -- and raises ``ConfigError`` at planning time for a missing
account or queue, more nodes than the queue allows, a walltime over its limit, or a tile count
that is not a multiple of the tiles per node. ``parsl_config(site, job, run_dir)`` builds the
Parsl ``Config`` (HighThroughputExecutor + LocalProvider or PBSProProvider) for one job.

Node-hour estimates: with ``site.machine`` set (a machine of workflow/machines/, e.g.
``aurora``), a run's hours are its steps x the step time workflow/perfmodel.py predicts for its
model, tiles, EP degree and batch on that machine. Where the model does not apply (no machine
set, or a layout it cannot price, e.g. fewer sequences per step than tiles) the estimate falls
back to the throughput assumption: the run's training FLOPs (the model's FLOP-per-token count x
tokens) over ``tiles x peak_tflops_per_tile x mfu`` (site config; Aurora: 419 TFLOP/s bf16 per
PVC tile, half of a Max 1550's dense bf16 peak, at 25 % MFU). ``JobPlan.est_source`` and the
plan table say which one each job used.
"""
from __future__ import annotations

import math
import os
import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from optimus_core.config import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent / "config"
ACCOUNT_ENV = "OPTIMUS_ACCOUNT"  # fills site.account when the YAML leaves it empty


@dataclass(frozen=True)
class QueueLimits:
    min_nodes: int
    max_nodes: int
    walltime_h: float

    def __post_init__(self):
        if not (1 <= self.min_nodes <= self.max_nodes):
            raise ConfigError(f"queue nodes = {self.min_nodes}-{self.max_nodes}: need 1 <= min_nodes <= max_nodes")
        if self.walltime_h <= 0:
            raise ConfigError(f"queue walltime_h = {self.walltime_h}: must be > 0")


@dataclass(frozen=True)
class GpuAffinity:
    """Which accelerator each rank of a node sees: local rank r (the first of ``local_rank_env``
    set by the launcher) gets ``variable`` = ``value`` with {gpu} = r // tiles_per_gpu,
    {tile} = r % tiles_per_gpu, {local_rank} = r. Aurora: ZE_AFFINITY_MASK={gpu}.{tile}, two
    tiles per GPU, so each of the 12 ranks of a node sees one tile as its only device."""

    variable: str
    value: str = "{local_rank}"
    tiles_per_gpu: int = 1
    local_rank_env: tuple[str, ...] = ("PALS_LOCAL_RANKID",)

    def __post_init__(self):
        def bad(name, allowed):
            raise ConfigError(f"site.gpu_affinity.{name} = {getattr(self, name)!r}: {allowed}")

        object.__setattr__(self, "local_rank_env", tuple(
            [self.local_rank_env] if isinstance(self.local_rank_env, str) else self.local_rank_env))
        if not _ENV_NAME.fullmatch(str(self.variable)):
            bad("variable", "must be an environment variable name")
        if not self.local_rank_env or not all(_ENV_NAME.fullmatch(str(v)) for v in self.local_rank_env):
            bad("local_rank_env", "must be one or more environment variable names (the launcher's local rank)")
        if not isinstance(self.tiles_per_gpu, int) or self.tiles_per_gpu < 1:
            bad("tiles_per_gpu", "must be an integer >= 1")
        try:
            str(self.value).format(gpu=0, tile=0, local_rank=0)
        except (KeyError, IndexError, ValueError) as e:
            bad("value", f"unknown placeholder {e}; allowed: {{gpu}} {{tile}} {{local_rank}}")
        if not _AFFINITY_VALUE.fullmatch(str(self.value)):
            bad("value", "must be letters, digits and . , : - with the placeholders {gpu} {tile} {local_rank}")

    def wrapper(self) -> str:
        """A POSIX ``sh`` prefix that exports the variable for this rank, then execs the command."""
        r, t = "$r", self.tiles_per_gpu
        value = self.value.format(gpu=f"$(({r} / {t}))", tile=f"$(({r} % {t}))", local_rank=r)
        rank = f"${{{self.local_rank_env[-1]}:?gpu_affinity: none of {' '.join(self.local_rank_env)} is set}}"
        for name in reversed(self.local_rank_env[:-1]):
            rank = f"${{{name}:-{rank}}}"
        script = f'r={rank}; export {self.variable}={value}; exec "$@"'
        return f"sh -c {shlex.quote(script)} gpu_affinity"


@dataclass(frozen=True)
class CpuExecutor:
    """The site's executor for CPU-only fan-out work (tokenization, one task per corpus file):
    blocks of ``nodes`` nodes for ``walltime_h``, at most ``max_blocks`` at once, with
    ``workers_per_node`` Parsl workers per node (0 = cpus_per_node; on a local site, this
    machine's cores). ``launcher`` starts the workers: ``simple`` on a block's first node only,
    ``mpiexec`` on every node of a block (Parsl's MpiExecLauncher with ``bind_cmd`` and
    ``launcher_options``, e.g. PALS' "--ppn 1 --depth=208")."""

    nodes: int = 1
    workers_per_node: int = 0
    walltime_h: float = 1.0
    max_blocks: int = 1
    launcher: str = "simple"
    launcher_options: str = ""
    bind_cmd: str = "--cpu-bind"

    def __post_init__(self):
        def bad(name, allowed):
            raise ConfigError(f"site.cpu_executor.{name} = {getattr(self, name)!r}: {allowed}")

        for name in ("nodes", "max_blocks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "must be an integer >= 1")
        if not isinstance(self.workers_per_node, int) or self.workers_per_node < 0:
            bad("workers_per_node", "must be an integer >= 0 (0 = cpus_per_node)")
        if not self.walltime_h > 0:
            bad("walltime_h", "must be > 0")
        if self.launcher not in ("simple", "mpiexec"):
            bad("launcher", "must be 'simple' or 'mpiexec'")
        if self.launcher == "simple" and self.nodes > 1:
            bad("launcher", f"'simple' starts workers on one node only; use 'mpiexec' for nodes = {self.nodes}")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_AFFINITY_VALUE = re.compile(r"([A-Za-z0-9_.,:-]|\{(gpu|tile|local_rank)\})*")


@dataclass(frozen=True)
class SiteConfig:
    """One execution site. ``kind``: ``local`` (LocalProvider) or ``pbspro`` (PBSProProvider)."""

    name: str
    kind: str = "local"
    account: str = ""
    queue: str = "auto"  # a name of ``queues`` or "auto": the first queue that fits nodes and walltime
    queues: dict[str, QueueLimits] = field(default_factory=dict)
    tiles_per_node: int = 1  # ranks per node: Aurora 12 (6 PVC GPUs x 2 tiles)
    cpus_per_node: int = 1  # PBS `select=N:ncpus=C`
    select_options: str = ""  # appended to the select line, e.g. "ngpus=4"
    filesystems: str = ""  # `-l filesystems=...`
    place: str = ""  # `-l place=...`
    scheduler_options: list[str] = field(default_factory=list)  # further `#PBS` lines
    worker_init: list[str] = field(default_factory=list)  # module loads, venv activation
    env: dict[str, str] = field(default_factory=dict)  # exported in the job (oneCCL / xccl, ...)
    mpiexec: str = ""  # template: {ranks} {nodes} {ppn} {cpu_bind}; empty = no MPI launcher
    cpu_bind: str = ""  # "list:A:B:...": local rank i runs on the i-th core set (one per rank of a node)
    gpu_affinity: Optional[GpuAffinity] = None  # which GPU (tile) each rank sees; None = all of them
    cpu_executor: CpuExecutor = field(default_factory=CpuExecutor)  # CPU fan-out (tokenization)
    optimus: str = "optimus"  # the command on the compute nodes
    retries: int = 1  # extra attempts for a failed task (beyond those a multi-job run needs)
    walltime_h: float = 1.0  # per job, for runs that do not come from the registry
    address: str = ""  # interchange address the workers connect to; empty = Parsl's guess
    max_workers_per_node: int = 1
    heartbeat_period: int = 30  # s; a job cut by PBS is noticed after heartbeat_threshold
    heartbeat_threshold: int = 120
    status_polling_interval: int = 60  # s between `qstat` polls (Parsl's PBSProProvider default)
    peak_tflops_per_tile: float = 419.0
    mfu: float = 0.25
    machine: str = ""  # workflow/machines/<name>.yaml (or a path) for model-based node-hours; "" = none
    run_dir: str = "results/parsl"  # Parsl's run directory (submit scripts, logs)

    def __post_init__(self):
        def bad(name, allowed):
            raise ConfigError(f"site {self.name}: {name} = {getattr(self, name)!r}: {allowed}")

        if self.kind not in ("local", "pbspro"):
            bad("kind", "must be 'local' or 'pbspro'")
        for name in ("tiles_per_node", "cpus_per_node", "max_workers_per_node", "heartbeat_period",
                     "heartbeat_threshold", "status_polling_interval"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        if self.retries < 0:
            bad("retries", "must be >= 0")
        if self.walltime_h <= 0:
            bad("walltime_h", "must be > 0")
        if not (0 < self.mfu <= 1) or self.peak_tflops_per_tile <= 0:
            bad("mfu", "must be in (0, 1], with peak_tflops_per_tile > 0")
        if self.kind == "pbspro" and not self.queues:
            bad("queues", "a PBS site needs its queue table (name: {min_nodes, max_nodes, walltime_h})")
        if self.queue != "auto" and self.queues and self.queue not in self.queues:
            bad("queue", f"unknown; allowed: auto, {', '.join(self.queues)}")
        if self.cpu_bind.startswith("list:") and len(self.cpu_bind[5:].split(":")) != self.tiles_per_node:
            bad("cpu_bind", f"a list needs one core set per rank of a node (tiles_per_node = {self.tiles_per_node}), "
                            f"not {len(self.cpu_bind[5:].split(':'))}")
        if self.gpu_affinity is not None and not self.mpiexec:
            bad("gpu_affinity", "needs an mpiexec line: the local rank it reads comes from the MPI launcher")
        if self.gpu_affinity is not None and self.tiles_per_node % self.gpu_affinity.tiles_per_gpu:
            raise ConfigError(f"site {self.name}: gpu_affinity.tiles_per_gpu = {self.gpu_affinity.tiles_per_gpu}: "
                              f"must divide tiles_per_node ({self.tiles_per_node})")
        if self.mpiexec:
            try:
                self.mpiexec.format(ranks=1, nodes=1, ppn=1, cpu_bind="")
            except (KeyError, IndexError) as e:
                bad("mpiexec", f"unknown placeholder {e}; allowed: {{ranks}} {{nodes}} {{ppn}} {{cpu_bind}}")


def site_from_dict(data: dict[str, Any], **overrides: Any) -> SiteConfig:
    """A SiteConfig from a YAML ``site:`` block; ``overrides`` replace fields (tests, CLI)."""
    data = {**(data or {}), **overrides}
    known = {f.name for f in fields(SiteConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"site.{unknown[0]}: unknown field; allowed: {', '.join(sorted(known))}")
    if "name" not in data:
        raise ConfigError("site.name: missing")
    queues = {}
    for qname, q in (data.get("queues") or {}).items():
        try:
            queues[qname] = q if isinstance(q, QueueLimits) else QueueLimits(**q)
        except TypeError as e:
            raise ConfigError(f"site.queues.{qname} = {q!r}: needs min_nodes, max_nodes, walltime_h ({e})") from None
        except ConfigError as e:
            raise ConfigError(f"site.queues.{qname}: {e}") from None
    data["queues"] = queues
    if not data.get("account"):
        data["account"] = os.environ.get(ACCOUNT_ENV, "")
    data["env"] = {str(k): str(v) for k, v in (data.get("env") or {}).items()}
    affinity = data.get("gpu_affinity")
    if isinstance(affinity, dict):
        try:
            data["gpu_affinity"] = GpuAffinity(**affinity)
        except TypeError as e:
            raise ConfigError(f"site.gpu_affinity = {affinity!r}: needs variable, and may have value, tiles_per_gpu, "
                              f"local_rank_env ({e})") from None
    cpu = data.get("cpu_executor")
    if isinstance(cpu, dict):
        known = {f.name for f in fields(CpuExecutor)}
        if set(cpu) - known:
            raise ConfigError(f"site.cpu_executor.{sorted(set(cpu) - known)[0]}: unknown field; allowed: "
                              f"{', '.join(sorted(known))}")
        data["cpu_executor"] = CpuExecutor(**cpu)
    elif cpu is None:
        data.pop("cpu_executor", None)
    if affinity is not None and not isinstance(affinity, (dict, GpuAffinity)):
        raise ConfigError(f"site.gpu_affinity = {affinity!r}: must be a mapping (variable, value, tiles_per_gpu, "
                          "local_rank_env) or null")
    for key in ("worker_init", "scheduler_options"):
        if isinstance(data.get(key), str):
            data[key] = [data[key]]
    return SiteConfig(**data)


def load_site(name_or_path: str | Path, **overrides: Any) -> SiteConfig:
    """``local`` (built in), a name (``workflow/config/<name>.yaml``) or a YAML file's ``site:`` block."""
    if str(name_or_path) == "local":
        return site_from_dict({"name": "local", "kind": "local", "mpiexec": ""}, **overrides)
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ["local", *sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if _has_site(p))]
        raise ConfigError(f"site = {str(name_or_path)!r}: unknown; known: {', '.join(known)} or a YAML file with a site: block")
    import yaml

    block = (yaml.safe_load(path.read_text()) or {}).get("site")
    if not isinstance(block, dict):
        raise ConfigError(f"site: {path} has no site: block")
    return site_from_dict(block, **overrides)


def _has_site(path: Path) -> bool:
    return "\nsite:" in "\n" + path.read_text()


# ----------------------------------------------------------------------------- planning

@dataclass(frozen=True)
class JobPlan:
    """One PBS (or local) job for one run: everything needed to submit it, and its cost estimate."""

    site: str
    ranks: int
    nodes: int
    ppn: int
    queue: Optional[str]
    account: Optional[str]
    walltime_h: float
    scheduler_options: str  # the `#PBS` lines Parsl puts in the submit script
    select_line: str
    mpiexec: str  # the launcher prefix ('' = run the command directly)
    env: dict[str, str]
    est_hours: float  # of training (nan if unknown): the performance model's, else the throughput assumption's
    jobs: int  # PBS jobs the run spans (each resumes from the last checkpoint)
    est_source: str = "throughput"  # "perfmodel:<machine>" | "throughput" | "" (no run to estimate)
    gpu_affinity: str = ""  # per-rank prefix after mpiexec: each rank sees only its GPU / tile ('' = none)

    @property
    def launcher(self) -> str:
        """What precedes the command on the job's head node: mpiexec, then the per-rank affinity wrapper."""
        return " ".join(part for part in (self.mpiexec, self.gpu_affinity) if part)

    @property
    def walltime(self) -> str:
        s = round(self.walltime_h * 3600)
        return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"

    @property
    def node_hours(self) -> float:
        return self.nodes * self.est_hours

    def pbs_lines(self) -> list[str]:
        """Every directive the job gets: -A/-q (Parsl passes them to qsub) and the script's #PBS lines."""
        out = [f"#PBS -A {self.account}"] if self.account else []
        out += [f"#PBS -q {self.queue}"] if self.queue else []
        out += [self.select_line, f"#PBS -l walltime={self.walltime}"]
        return out + [l for l in self.scheduler_options.splitlines() if l]


def _fmt_h(h: float) -> str:
    return f"{h:g}h"


def choose_queue(site: SiteConfig, nodes: int, walltime_h: float) -> str:
    """The configured queue, checked, or (queue: auto) the first of the table that fits."""
    if site.queue != "auto":
        q = site.queues[site.queue]
        if not q.min_nodes <= nodes <= q.max_nodes:
            raise ConfigError(f"site {site.name}: nodes = {nodes}: queue {site.queue!r} allows "
                              f"{q.min_nodes}-{q.max_nodes} nodes")
        if walltime_h > q.walltime_h:
            raise ConfigError(f"site {site.name}: walltime_h = {walltime_h:g}: over queue {site.queue!r}'s "
                              f"limit of {_fmt_h(q.walltime_h)}")
        return site.queue
    for name, q in site.queues.items():
        if q.min_nodes <= nodes <= q.max_nodes and walltime_h <= q.walltime_h:
            return name
    table = "; ".join(f"{n}: {q.min_nodes}-{q.max_nodes} nodes, <= {_fmt_h(q.walltime_h)}" for n, q in site.queues.items())
    raise ConfigError(f"site {site.name}: nodes = {nodes}, walltime_h = {walltime_h:g}: no queue fits; allowed: {table}")


def plan(run=None, site: SiteConfig | None = None, *, ranks: int | None = None,
         walltime_h: float | None = None) -> JobPlan:
    """Plan one job: ``run`` is a registry RunScale (its tiles, walltime, FLOPs), or give ``ranks``."""
    if site is None:
        raise ConfigError("plan: a site is needed")
    ranks = ranks if ranks is not None else run.devices
    walltime_h = walltime_h if walltime_h is not None else (run.walltime_h if run and run.walltime_h else site.walltime_h)
    # A local site is one machine: every rank on it, whatever tiles_per_node says.
    ppn = site.tiles_per_node if site.kind == "pbspro" else max(1, ranks)
    if site.kind == "pbspro" and not site.account:
        raise ConfigError(f"site {site.name}: account = '': missing; set site.account in the site YAML "
                          f"or the {ACCOUNT_ENV} environment variable")
    if ranks < 1:
        raise ConfigError(f"tiles = {ranks}: must be >= 1")
    if ranks % ppn:
        near = [n for n in (ranks // ppn * ppn, (ranks // ppn + 1) * ppn) if n]
        raise ConfigError(f"site {site.name}: tiles = {ranks}: must be a multiple of tiles_per_node ({ppn}); "
                          f"nearest: {' or '.join(map(str, near))}")
    if walltime_h <= 0:
        raise ConfigError(f"walltime_h = {walltime_h}: must be > 0")
    nodes = ranks // ppn
    est, source = estimate_hours(run, site, ranks)
    jobs = max(1, math.ceil(est / walltime_h)) if est == est else 1
    queue = account = None
    sched, select = [], f"#PBS -l select={nodes}"
    if site.kind == "pbspro":
        account = site.account
        queue = choose_queue(site, nodes, walltime_h)
        select = f"#PBS -l select={nodes}:ncpus={site.cpus_per_node}" + (
            f":{site.select_options.lstrip(':')}" if site.select_options else "")
        if site.filesystems:
            sched.append(f"#PBS -l filesystems={site.filesystems}")
        if site.place:
            sched.append(f"#PBS -l place={site.place}")
        sched += [l if l.startswith("#PBS") else f"#PBS {l}" for l in site.scheduler_options]
    mpiexec = site.mpiexec.format(ranks=ranks, nodes=nodes, ppn=ppn, cpu_bind=site.cpu_bind).strip()
    affinity = site.gpu_affinity.wrapper() if site.gpu_affinity is not None else ""
    return JobPlan(site.name, ranks, nodes, ppn, queue, account, walltime_h, "\n".join(sched), select, mpiexec,
                   dict(site.env), est, jobs, source, affinity)


def estimate_hours(run, site: SiteConfig, ranks: int) -> tuple[float, str]:
    """(hours of training, how they were estimated): the performance model on ``site.machine``
    where it applies to the run as planned, else the throughput assumption; (nan, "") without a run."""
    if run is None:
        return float("nan"), ""
    if site.machine and ranks == run.devices:
        from workflow import perfmodel

        machine = _machine(site.machine)  # an unknown or broken machine file is an error, not a fallback
        try:
            est = perfmodel.estimate_node_hours(run, machine)
            return est["hours"], est["source"]
        except ConfigError:
            pass  # e.g. fewer sequences than tiles: the model has no layout for it
    return run.flops() / (ranks * site.peak_tflops_per_tile * 1e12 * site.mfu) / 3600, "throughput"


_MACHINES: dict[str, Any] = {}


def _machine(name: str):
    """The performance model's machine (loaded once per process: plan_table asks per job)."""
    if name not in _MACHINES:
        from workflow import perfmodel

        _MACHINES[name] = perfmodel.load_machine(name)
    return _MACHINES[name]


def plan_table(experiments, site: SiteConfig) -> tuple[str, list[JobPlan]]:
    """The paper-scale jobs of ``experiments`` as a table, with the node-hour total last."""
    rows, plans = [], []
    head = (f"{'run':30s} {'tiles':>6s} {'nodes':>5s} {'queue':>13s} {'walltime':>9s} {'jobs':>4s} "
            f"{'est. hours':>10s} {'node-hours':>11s}  {'estimate':s}")
    for exp in experiments:
        try:
            p = plan(exp.paper, site)
        except ConfigError as e:
            raise ConfigError(f"{exp.name}: {e}") from None
        plans.append(p)
        rows.append(f"{exp.name:30s} {p.ranks:6d} {p.nodes:5d} {p.queue or '-':>13s} {p.walltime:>9s} {p.jobs:4d} "
                    f"{p.est_hours:10.2f} {p.node_hours:11,.1f}  {p.est_source}")
    total = sum(p.node_hours for p in plans)
    modelled = sum(p.est_source.startswith("perfmodel") for p in plans)
    assumed = f"assumed {site.peak_tflops_per_tile:g} TFLOP/s per tile at {site.mfu:.0%} MFU"
    if modelled:
        rest = f"; {assumed} for the other {len(plans) - modelled}" if modelled < len(plans) else ""
        foot = (f"TOTAL {len(plans)} jobs, {total:,.0f} node-hours (performance model on machine "
                f"{site.machine} for {modelled} jobs{rest})")
    else:
        foot = f"TOTAL {len(plans)} jobs, {total:,.0f} node-hours ({assumed})"
    return "\n".join([head, "-" * len(head), *rows, foot]), plans


# ----------------------------------------------------------------------------- Parsl

def worker_init(site: SiteConfig, job: JobPlan) -> str:
    """The job script's preamble: module loads / venv, then the environment exports."""
    lines = list(site.worker_init)
    lines += [f"export {k}={shlex.quote(v)}" for k, v in job.env.items()]
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
        heartbeat_period=site.heartbeat_period, heartbeat_threshold=site.heartbeat_threshold,
        **({"address": site.address} if site.address else {}),
    )
    # A run longer than one job needs (jobs - 1) resubmissions; each resumes from `latest`.
    return Config(executors=[executor], retries=site.retries + job.jobs - 1, run_dir=str(run_dir),
                  strategy="simple", usage_tracking=0)


def _provider(site: SiteConfig, job: JobPlan, launcher, max_blocks: int = 1):
    """The Parsl provider of ``job``'s blocks: PBS Pro (``job.nodes`` nodes per block) or this machine."""
    from parsl.providers import LocalProvider, PBSProProvider

    class PolledPBSPro(PBSProProvider):  # Parsl fixes the qstat interval at 60 s; the site chooses
        @property
        def status_polling_interval(self):
            return site.status_polling_interval

    init = worker_init(site, job)
    if site.kind == "pbspro":
        return PolledPBSPro(
            account=job.account, queue=job.queue, scheduler_options=job.scheduler_options,
            select_options=site.select_options, worker_init=init, nodes_per_block=job.nodes,
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
        heartbeat_period=site.heartbeat_period, heartbeat_threshold=site.heartbeat_threshold,
        **({"address": site.address} if site.address else {}),
    )
    return Config(executors=[executor], retries=site.retries, run_dir=str(run_dir), strategy="simple",
                  usage_tracking=0)
