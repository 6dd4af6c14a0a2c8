"""Planning jobs on a site: plain Python, no Parsl.

    >>> from workflow.sites import load_site
    >>> from workflow.plan import plan
    >>> from workflow.experiments import get
    >>> site = load_site("aurora", account="MyProject")
    >>> job = plan(get("scaling-mula-220b-a10b-384").paper, site)
    >>> job.nodes, job.queue, job.walltime
    (32, 'debug-scaling', '01:00:00')
    >>> print(job.mpiexec)          # doctest: +ELLIPSIS
    mpiexec -n 384 --ppn 12 --cpu-bind list:2-8:...

``plan(run, site)`` turns a registry run (or a bare rank count) into a ``JobPlan`` -- nodes,
queue, walltime, the chained jobs it spans, the ``#PBS`` lines, the mpiexec prefix, the
environment, an estimate of the run's hours and node-hours, its memory per tile. The queue and
walltime come from the site's queue table (a routing queue's tier by node count): a long run
asks for the longest walltime its tier allows and spans ``jobs`` chained jobs, each resuming
from the newest checkpoint and each losing ``site.startup_h`` to its start; a timed run asks
for its estimate with ``site.timed_margin`` of room plus the start and must fit one job. It
raises ``ConfigError`` at planning time, naming the table, for a missing account or queue, a
node count or walltime no queue takes, a timed run that fits no queue, a tile count that is not
a multiple of the tiles per node, or a run whose memory per tile
(optimus_core/memory.py, activation checkpointing resolved as the run will) is over the
usable share of the machine's device memory (``MemoryBudgetError``: the GiB, the budget and the
knob that would help). ``plan_table(experiments, site)`` plans many runs
and prints them as a table with the node-hour total (`optimus plan`, `snakemake -n`). The site
(``SiteConfig``) is workflow/sites.py; the Parsl ``Config`` for a plan is workflow/parsl_sites.py.

Node-hour estimates: with ``site.machine`` set (a machine of workflow/machines/, e.g.
``aurora``), a run's hours are its steps x the step time workflow/perfmodel/ predicts for its
model, tiles, EP degree and batch on that machine. Where the model does not apply (no machine
set, or a layout it cannot price, e.g. fewer sequences per step than tiles) the estimate falls
back to the throughput assumption: the run's training FLOPs (the model's FLOP-per-token count x
tokens) over ``tiles x peak_tflops_per_tile x mfu`` (site config; Aurora: 419 TFLOP/s bf16 per
PVC tile, half of a Max 1550's dense bf16 peak, at 25 % MFU). ``JobPlan.est_source`` and the
plan table say which one each job used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from optimus_core.compile_cache import NODE_LOCAL, SHARED as COMPILE_CACHE
from optimus_core.config import ConfigError
from workflow.experiments import NOT_RUNNABLE
from workflow.sites import ACCOUNT_ENV, SiteConfig, at_scale


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
    memory_gib: float = float("nan")  # per tile, the memory model's (optimus_core.memory); nan: no run or machine
    budget_gib: float = float("nan")  # per tile: the usable share of the machine's device memory
    checkpointing: str = ""  # train.activation_checkpointing as resolved for the job
    spare_nodes: int = 0  # held beyond ``nodes`` (site.spare_nodes): a host named faulty is left out of the next job
    master_addr: str = ""  # site.master_addr: MASTER_ADDR from the hostfile's first host ({host})
    init: list[str] = field(default_factory=list)  # worker_init lines of this job's size (site.at_scale)

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
        return (self.nodes + self.spare_nodes) * self.est_hours  # spares are held, and charged, too

    def pbs_lines(self) -> list[str]:
        """Every directive the job gets: -A/-q (Parsl passes them to qsub) and the script's #PBS lines."""
        out = [f"#PBS -A {self.account}"] if self.account else []
        out += [f"#PBS -q {self.queue}"] if self.queue else []
        out += [self.select_line, f"#PBS -l walltime={self.walltime}"]
        return out + [l for l in self.scheduler_options.splitlines() if l]


def _fmt_h(h: float) -> str:
    return f"{h:g}h"


def _table(site: SiteConfig) -> str:
    return "; ".join(f"{n}: {q.describe()}" for n, q in site.queues.items())


def choose_queue(site: SiteConfig, nodes: int, walltime_h: float) -> tuple[str, float]:
    """(queue, walltime in hours) of a job of ``nodes`` nodes: the configured queue, or (queue:
    auto) the first of the table whose tier for ``nodes`` allows ``walltime_h``. ``walltime_h`` 0:
    as long as a queue allows, so the queue whose tier for ``nodes`` allows the longest (a long
    run then spans the fewest jobs). ConfigError, naming the table, when no queue takes the job."""
    names = list(site.queues) if site.queue == "auto" else [site.queue]
    fits = [(n, site.queues[n].tier(nodes)) for n in names]
    fits = [(n, t) for n, t in fits if t is not None]
    if not fits:
        if site.queue != "auto":
            raise ConfigError(f"site {site.name}: nodes = {nodes}: queue {site.queue!r} allows "
                              f"{site.queues[site.queue].describe()}")
        raise ConfigError(f"site {site.name}: nodes = {nodes}: no queue takes {nodes} nodes; allowed: {_table(site)}")
    if walltime_h == 0:
        name, tier = max(fits, key=lambda f: f[1].walltime_h)
        return name, tier.walltime_h
    for name, tier in fits:
        if walltime_h <= tier.walltime_h:
            return name, walltime_h
    if site.queue != "auto":
        raise ConfigError(f"site {site.name}: walltime_h = {walltime_h:g}: over queue {site.queue!r}'s "
                          f"limit of {_fmt_h(fits[0][1].walltime_h)} at {nodes} nodes")
    raise ConfigError(f"site {site.name}: nodes = {nodes}, walltime_h = {walltime_h:g}: no queue fits; "
                      f"allowed: {_table(site)}")


def timed_walltime(site: SiteConfig, est_hours: float) -> float:
    """The walltime a timed run (scaling point, ablation: one job, never resumed) asks for: its
    estimated hours with ``site.timed_margin`` of room, plus the site's ``startup_h`` (module
    load, imports, building and sharding the model), rounded up to 5 minutes."""
    return math.ceil((est_hours * (1 + site.timed_margin) + site.startup_h) * 12) / 12


UNSET_ACCOUNT = f"<set site.account or {ACCOUNT_ENV}>"  # a dry run's account where none is set
HOSTFILE_VARIABLE = "OPTIMUS_HOSTFILE"  # a job's hostfile (workflow/hostfile.py), where the mpiexec line has {hostfile}


def plan(run=None, site: SiteConfig | None = None, *, ranks: int | None = None,
         walltime_h: float | None = None, dry_run: bool = False) -> JobPlan:
    """Plan one job: ``run`` is a registry RunScale (its tiles, walltime, FLOPs), or give ``ranks``.

    The walltime is ``walltime_h``, else the run's (0: the longest its queue allows), else the
    site's; a timed run (``run.timed``) asks for its estimate with room (``timed_walltime``) and
    must fit one job. A run longer than its walltime spans ``jobs`` chained jobs, each resuming
    from the last checkpoint and each losing ``site.startup_h`` to its start. A PBS site needs an
    account to submit to; ``dry_run`` (a table, nothing submitted) plans without one, the
    account then UNSET_ACCOUNT."""
    if site is None:
        raise ConfigError("plan: a site is needed")
    ranks = ranks if ranks is not None else run.devices
    if walltime_h is None:
        walltime_h = run.walltime_h if run is not None else site.walltime_h
    # A local site is one machine: every rank on it, whatever tiles_per_node says.
    ppn = site.tiles_per_node if site.kind == "pbspro" else max(1, ranks)
    if site.kind == "pbspro" and not site.account and not dry_run:
        raise ConfigError(f"site {site.name}: account = '': missing; set site.account in the site YAML "
                          f"or the {ACCOUNT_ENV} environment variable")
    if ranks < 1:
        raise ConfigError(f"tiles = {ranks}: must be >= 1")
    if ranks % ppn:
        near = [n for n in (ranks // ppn * ppn, (ranks // ppn + 1) * ppn) if n]
        raise ConfigError(f"site {site.name}: tiles = {ranks}: must be a multiple of tiles_per_node ({ppn}); "
                          f"nearest: {' or '.join(map(str, near))}")
    if walltime_h < 0 or walltime_h != walltime_h:
        raise ConfigError(f"walltime_h = {walltime_h}: must be > 0 (or 0: the longest the queue allows)")
    nodes = ranks // ppn
    if site.kind == "pbspro" and site.spare_nodes > nodes:
        raise ConfigError(f"site {site.name}: spare_nodes = {site.spare_nodes}: more than the job's {nodes} node(s); "
                          f"a spare stands in for a faulty node, so at most {nodes}")
    memory_gib, budget_gib, checkpointing, _ = plan_memory(run, site, ranks)
    est, source = estimate_hours(run, site, ranks)
    timed = bool(getattr(run, "timed", False))
    if timed and est == est:
        needed = timed_walltime(site, est)
        if walltime_h and walltime_h < needed:
            raise ConfigError(f"site {site.name}: walltime_h = {walltime_h:g}: a timed run needs {needed:.2f} h "
                              f"(an estimated {est:.2f} h with {site.timed_margin:.0%} room, plus {site.startup_h:g} h "
                              f"to start); give it more walltime, fewer steps or more tiles")
        walltime_h = walltime_h or needed
    queue = account = None
    sched, select = [], f"#PBS -l select={nodes}"
    if site.kind == "pbspro":
        account = site.account or UNSET_ACCOUNT
        try:
            queue, walltime_h = choose_queue(site, nodes + site.spare_nodes, walltime_h)
        except ConfigError as e:
            if timed:
                raise ConfigError(f"{e} (a timed run: {est:.2f} h estimated, asking {walltime_h:.2f} h with room; "
                                  f"fewer steps or more tiles would fit)") from None
            raise
        select = f"#PBS -l select={nodes + site.spare_nodes}:ncpus={site.cpus_per_node}" + (
            f":{site.select_options.lstrip(':')}" if site.select_options else "")
        if site.filesystems:
            sched.append(f"#PBS -l filesystems={site.filesystems}")
        if site.place:
            sched.append(f"#PBS -l place={site.place}")
        sched += [l if l.startswith("#PBS") else f"#PBS {l}" for l in site.scheduler_options]
    elif walltime_h == 0:
        walltime_h = site.walltime_h
    useful = walltime_h - (site.startup_h if site.kind == "pbspro" else 0.0)
    if est == est and useful <= 0:
        raise ConfigError(f"site {site.name}: walltime_h = {walltime_h:g}: not more than startup_h = "
                          f"{site.startup_h:g}, so no job would train")
    jobs = 1 if timed or est != est else max(1, math.ceil(est / useful))
    mpiexec = site.mpiexec.format(ranks=ranks, nodes=nodes, ppn=ppn, cpu_bind=site.cpu_bind,
                                  hostfile=f'"${HOSTFILE_VARIABLE}"').strip()
    affinity = site.gpu_affinity.wrapper() if site.gpu_affinity is not None else ""
    env, init = at_scale(site, nodes)
    if site.compile_cache:  # every rank starts from the warm cache (optimus_core.compile_cache)
        env.update({COMPILE_CACHE: site.compile_cache, NODE_LOCAL: site.node_local})
    return JobPlan(site.name, ranks, nodes, ppn, queue, account, walltime_h, "\n".join(sched), select, mpiexec,
                   env, est, jobs, source, affinity, memory_gib, budget_gib, _label(checkpointing),
                   site.spare_nodes if site.kind == "pbspro" else 0, site.master_addr, init)


def _label(checkpointing: tuple[str, int] | None) -> str:
    """The table's name of a resolved checkpointing: "full/2" checkpoints every 2nd block."""
    if checkpointing is None:
        return ""
    mode, every = checkpointing
    return mode + (f"/{every}" if mode == "full" and every > 1 else "")


def plan_memory(run, site: SiteConfig, ranks: int) -> tuple[float, float, tuple[str, int] | None, str | None]:
    """(GiB per tile, budget GiB, (mode, every), weight gathers) of ``run`` on ``site.machine``'s
    devices, with activation checkpointing and weight gathers resolved as the run will resolve
    them on such a device (workflow.perfmodel.planned_run: the plan the step time is predicted
    for; the gathers None where a rank is not sharded); MemoryBudgetError -- the run, the GiB, the
    budget and the knob that would help -- when it cannot fit. (nan, nan, None, None) without a
    run or a machine."""
    from optimus_core.memory import GIB
    from workflow import perfmodel

    nan = float("nan")
    if run is None or not site.machine:
        return nan, nan, None, None
    plan = perfmodel.planned_run(run.run_config(), _machine(site.machine), ranks)  # that device is not here
    budget = plan.budget_bytes
    return plan.memory.peak_gib, budget / GIB if budget else nan, plan.checkpointing, plan.weight_gathers


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


def plan_table(experiments, site: SiteConfig, layout: str = "authors") -> tuple[str, list[JobPlan]]:
    """The paper-scale jobs of ``experiments`` in design ``layout`` (workflow.experiments.DESIGNS)
    as a table, with the node-hour total last: a dry run, planned without an account where the
    site has none (and saying so before the total)."""
    rows, plans = [], []
    head = (f"{'run':32s} {'tiles':>6s} {'nodes':>5s} {'queue':>13s} {'walltime':>9s} {'jobs':>4s} "
            f"{'GiB/tile':>8s} {'act. ckpt':>9s} {'est. hours':>10s} {'node-hours':>11s}  {'estimate':s}")
    for exp in experiments:
        try:
            p = plan(exp.scale("paper", layout), site, dry_run=True)
        except ConfigError as e:
            raise ConfigError(f"{exp.name}: {e}") from None
        plans.append(p)
        rows.append(f"{exp.name:32s} {p.ranks:6d} {p.nodes:5d} {p.queue or '-':>13s} {p.walltime:>9s} {p.jobs:4d} "
                    f"{p.memory_gib:8.1f} {p.checkpointing or '-':>9s} {p.est_hours:10.2f} {p.node_hours:11,.1f}  "
                    f"{p.est_source}")
    total = sum(p.node_hours for p in plans)
    modelled = sum(p.est_source.startswith("perfmodel") for p in plans)
    assumed = f"assumed {site.peak_tflops_per_tile:g} TFLOP/s per tile at {site.mfu:.0%} MFU"
    if modelled:
        rest = f"; {assumed} for the other {len(plans) - modelled}" if modelled < len(plans) else ""
        foot = (f"TOTAL {len(plans)} jobs, {total:,.0f} node-hours (performance model on machine "
                f"{site.machine} for {modelled} jobs{rest})")
    else:
        foot = f"TOTAL {len(plans)} jobs, {total:,.0f} node-hours ({assumed})"
    budgets = {round(p.budget_gib, 1) for p in plans if p.budget_gib == p.budget_gib}
    if budgets:
        foot += (f"; memory per tile from optimus_core/memory.py, every job within the "
                 f"{', '.join(f'{b:g}' for b in sorted(budgets))} GiB budget per tile")
    waiting = [f"not runnable yet: {name}: {why}" for name, why in NOT_RUNNABLE.items()]
    if site.kind == "pbspro" and not site.account:
        waiting.append(f"no account: set site.account in the site YAML or the {ACCOUNT_ENV} environment variable "
                       f"before submitting (the jobs above are planned without one)")
    return "\n".join([head, "-" * len(head), *rows, *waiting, foot]), plans


def paper_run_rows(experiments, plans: list[JobPlan], layout: str = "authors") -> list[dict]:
    """One row per pretraining run of ``experiments`` as planned (``plans``) in design ``layout``:
    its preset and the authors' tag, its shape, total and active parameters beside the name's
    nominal sizes, context, batch, tokens, steps, tiles, EP and PP degrees, node-hours, GiB per
    tile and activation checkpointing."""
    from optimus_core import presets

    rows = []
    for exp, job in zip(experiments, plans):
        if exp.kind != "pretrain":
            continue
        run = exp.scale("paper", layout)
        p = presets.get(run.preset)
        m = p.model
        rows.append({
            "run": exp.name, "preset": run.preset, "base": p.base, "tag": p.tag, "layers": m.n_layers,
            "d_model": m.d_model, "heads": m.n_heads, "experts": m.moe.n_experts if m.moe else 0,
            "top_k": m.moe.top_k if m.moe else 0, "params": m.num_params(), "active_params": m.num_active_params(),
            "nominal": nominal_size(run.preset), "seq_len": p.seq_len, "batch": run.batch, "tokens": run.tokens,
            "steps": run.steps, "tiles": run.devices, "nodes": run.nodes, "ep": run.ep, "pp": run.pp,
            "node_hours": job.node_hours, "gib_per_tile": job.memory_gib, "budget_gib": job.budget_gib,
            "checkpointing": job.checkpointing})
    return rows


def nominal_size(preset: str) -> str:
    """The sizes a Mula name states (``mula-20b-a2b`` -> "20B / 2B"; a dense one its total)."""
    parts = preset.split("@")[0].removeprefix("mula-").split("-")
    if not parts[0].endswith("b"):
        return ""
    total = parts[0][:-1].upper() + "B"
    active = next((x[1:-1].upper() + "B" for x in parts[1:] if x.startswith("a") and x.endswith("b")), total)
    return f"{total} / {active}"


def design_rows(experiments, site: SiteConfig) -> list[dict]:
    """For each run of ``experiments`` that has a design of its own beside the authors' layout
    (workflow.experiments.Experiment.layouts), one row per design as planned on ``site``: tiles,
    EP and PP, activation checkpointing, estimated hours, node-hours, GiB per tile."""
    rows = []
    for exp in (e for e in experiments if e.layouts):
        for layout in ("authors", *exp.layouts):
            run = exp.scale("paper", layout)
            job = plan(run, site, dry_run=True)
            rows.append({"run": exp.name, "design": layout, "tiles": run.devices, "ep": run.ep, "pp": run.pp,
                         "checkpointing": job.checkpointing, "est_hours": job.est_hours,
                         "node_hours": job.node_hours, "gib_per_tile": job.memory_gib, "source": job.est_source})
    return rows


def record_plan(store_path, site: SiteConfig, experiments, plans: list[JobPlan], layout: str = "authors") -> str:
    """Write the pretraining runs' rows (paper_run_rows, in design ``layout``) and every run's
    designs side by side (design_rows) into run ``plan-<site>`` of the results store, as attrs
    (they hold strings): the report's tables of the paper's runs. Returns the run id."""
    from optimus_core.store import open_store

    run_id = f"plan-{site.name}"
    # "running": this writer (re)starts the run, so leaving it marks the run completed (or failed)
    attrs = {"kind": "plan", "site": site.name, "machine": site.machine, "status": "running", "layout": layout,
             "paper_runs": paper_run_rows(experiments, plans, layout), "designs": design_rows(experiments, site)}
    with open_store(store_path).run_writer(run_id, attrs):
        pass
    return run_id
