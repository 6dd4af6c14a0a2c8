"""Sites: where a run executes -- the validated site configuration, and nothing else.

    >>> from workflow.sites import load_site
    >>> site = load_site("aurora", account="MyProject")
    >>> site.kind, site.tiles_per_node, list(site.queues), site.device
    ('pbspro', 12, ['debug', 'debug-scaling', 'capacity', 'prod'], 'xpu')
    >>> site.queues["prod"].tier(300)
    QueueTier(min_nodes=256, max_nodes=1024, walltime_h=12)

A site is a validated ``SiteConfig`` read from the ``site:`` block of
``workflow/config/<name>.yaml`` (or any YAML file with such a block); ``local`` is built in.
Moving to another PBS machine, account or queue is a YAML edit, never a code edit: the queue
table (``Queue``: node range and walltime, or a routing queue's tiers; jobs per user; copied
from the site's documentation with its date in ``queues_source``), the launcher line (Aurora's
PALS `mpiexec --ppn 12 --cpu-bind list:...`, or MPICH's `mpiexec -ppn N`), module loads,
environment, the device type its ranks train on and the checkpoint interval its interrupts
call for, and the throughput assumption all live there. Every field is checked by name and type
when the site loads.

Rank placement is site configuration too: ``cpu_bind`` binds local rank i to the i-th core set
of its list. Each rank trains on its own device of the node (optimus_core.device: the one it
sees, or the one at its local rank, else a clear error); on Aurora, under the frameworks
module's FLAT mode, that is tile <local rank> with no mask, as ALCF's PyTorch page binds. A site
that wants a per-rank mask sets ``gpu_affinity`` (a ``GpuAffinity``): a small ``sh -c`` wrapper
between mpiexec and the command (CUDA_VISIBLE_DEVICES=<local rank>, a flat ZE_AFFINITY_MASK).
``cpu_executor`` (a ``CpuExecutor``) describes the site's blocks for CPU fan-out work.

Planning jobs on a site is workflow/plan.py; the Parsl configurations built from a site and a
plan are workflow/parsl_sites.py.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from optimus_core.config import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent / "config"
ACCOUNT_ENV = "OPTIMUS_ACCOUNT"  # fills site.account when the YAML leaves it empty


def _check_type(where: str, value: Any, kind: type, allowed: str) -> None:
    """YAML gives strings for quoted numbers and floats for ints: refuse both, naming the field."""
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(f"{where} = {value!r}: {allowed}")


@dataclass(frozen=True)
class QueueTier:
    """Nodes and walltime a queue (or one execution tier of a routing queue) accepts."""

    min_nodes: int
    max_nodes: int
    walltime_h: float

    def check(self, where: str) -> None:
        _check_type(f"{where}.min_nodes", self.min_nodes, int, "must be an integer")
        _check_type(f"{where}.max_nodes", self.max_nodes, int, "must be an integer")
        _check_type(f"{where}.walltime_h", self.walltime_h, float, "must be a number of hours")
        if not (1 <= self.min_nodes <= self.max_nodes):
            raise ConfigError(f"{where}: nodes = {self.min_nodes}-{self.max_nodes}: need 1 <= min_nodes <= max_nodes")
        if self.walltime_h <= 0:
            raise ConfigError(f"{where}.walltime_h = {self.walltime_h}: must be > 0")

    def fits(self, nodes: int) -> bool:
        return self.min_nodes <= nodes <= self.max_nodes


@dataclass(frozen=True)
class Queue:
    """One queue of the site's table. An execution queue has its own ``min_nodes``,
    ``max_nodes`` and ``walltime_h``; a routing queue (Aurora's prod) has ``tiers`` instead, and a
    job goes to the tier of its node count, with that tier's walltime limit. ``max_jobs_per_user``:
    how many of one user's jobs the queue takes at once, queued or running (0 = no limit)."""

    min_nodes: int = 0
    max_nodes: int = 0
    walltime_h: float = 0.0
    max_jobs_per_user: int = 0
    tiers: dict[str, QueueTier] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, name: str, data: Any) -> "Queue":
        where = f"site.queues.{name}"
        if isinstance(data, Queue):
            return data
        if not isinstance(data, dict):
            raise ConfigError(f"{where} = {data!r}: must be a mapping (min_nodes, max_nodes, walltime_h, "
                              f"max_jobs_per_user) or (tiers, max_jobs_per_user)")
        known = {"min_nodes", "max_nodes", "walltime_h", "max_jobs_per_user", "tiers"}
        if set(data) - known:
            raise ConfigError(f"{where}.{sorted(set(data) - known)[0]}: unknown field; allowed: {', '.join(sorted(known))}")
        tiers = data.get("tiers") or {}
        if tiers and set(data) & {"min_nodes", "max_nodes", "walltime_h"}:
            raise ConfigError(f"{where}: a routing queue's limits are its tiers': give tiers, or min_nodes, "
                              f"max_nodes and walltime_h, not both")
        if not tiers:
            missing = [k for k in ("min_nodes", "max_nodes", "walltime_h") if k not in data]
            if missing:
                raise ConfigError(f"{where} = {data!r}: needs min_nodes, max_nodes, walltime_h (or tiers); "
                                  f"missing {', '.join(missing)}")
        parsed = {}
        for tname, t in tiers.items():
            if not isinstance(t, dict) or set(t) != {"min_nodes", "max_nodes", "walltime_h"}:
                raise ConfigError(f"{where}.tiers.{tname} = {t!r}: needs exactly min_nodes, max_nodes, walltime_h")
            parsed[tname] = QueueTier(**t)
            parsed[tname].check(f"{where}.tiers.{tname}")
        queue = cls(**{k: v for k, v in data.items() if k != "tiers"}, tiers=parsed)
        if not parsed:
            QueueTier(queue.min_nodes, queue.max_nodes, queue.walltime_h).check(where)
        _check_type(f"{where}.max_jobs_per_user", queue.max_jobs_per_user, int, "must be an integer >= 0 (0 = no limit)")
        if queue.max_jobs_per_user < 0:
            raise ConfigError(f"{where}.max_jobs_per_user = {queue.max_jobs_per_user}: must be >= 0 (0 = no limit)")
        return queue

    def all_tiers(self) -> dict[str, QueueTier]:
        return self.tiers or {"": QueueTier(self.min_nodes, self.max_nodes, self.walltime_h)}

    def tier(self, nodes: int) -> QueueTier | None:
        """The tier that takes a job of ``nodes`` nodes (the queue itself when it has none)."""
        return next((t for t in self.all_tiers().values() if t.fits(nodes)), None)

    def describe(self) -> str:
        parts = [f"{f'{n} ' if n else ''}{t.min_nodes}-{t.max_nodes} nodes <= {t.walltime_h:g}h"
                 for n, t in self.all_tiers().items()]
        return ", ".join(parts)


@dataclass(frozen=True)
class GpuAffinity:
    """Which accelerator each rank of a node sees: local rank r (the first of ``local_rank_env``
    set by the launcher) gets ``variable`` = ``value`` with {gpu} = r // tiles_per_gpu,
    {tile} = r % tiles_per_gpu, {local_rank} = r. E.g. CUDA_VISIBLE_DEVICES={local_rank}, or on
    Aurora a flat ZE_AFFINITY_MASK={local_rank}; a {gpu}.{tile} mask is for COMPOSITE mode only
    (the frameworks module's FLAT mode skips it: the rank sees no device, and says so at start).
    Aurora's site uses none: each rank binds tile <local rank> itself (optimus_core.device)."""

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


@dataclass(frozen=True)
class AtScale:
    """Settings a job takes only from ``min_nodes`` nodes up: ``env`` exported and ``init`` lines
    run after the site's worker_init (oneCCL's settings for scale and Copper's imports, which
    ALCF prescribes for large jobs only); ``why`` says whose prescription it is."""

    min_nodes: int
    env: dict[str, str] = field(default_factory=dict)
    init: list[str] = field(default_factory=list)
    why: str = ""

    @classmethod
    def from_dict(cls, i: int, data: Any) -> "AtScale":
        where = f"site.at_scale[{i}]"
        if isinstance(data, AtScale):
            return data
        known = {"min_nodes", "env", "init", "why"}
        if not isinstance(data, dict) or "min_nodes" not in data or set(data) - known:
            raise ConfigError(f"{where} = {data!r}: needs min_nodes, and may have env (a mapping), init (a list of "
                              f"shell lines) and why")
        _check_type(f"{where}.min_nodes", data["min_nodes"], int, "must be an integer >= 1")
        if data["min_nodes"] < 1:
            raise ConfigError(f"{where}.min_nodes = {data['min_nodes']}: must be >= 1")
        env, init = data.get("env") or {}, data.get("init") or []
        if not isinstance(env, dict) or not all(_ENV_NAME.fullmatch(str(k)) for k in env):
            raise ConfigError(f"{where}.env = {env!r}: must map environment variable names to values")
        if not isinstance(init, list) or not all(isinstance(line, str) for line in init):
            raise ConfigError(f"{where}.init = {init!r}: must be a list of shell lines")
        return cls(data["min_nodes"], {str(k): str(v) for k, v in env.items()}, list(init), str(data.get("why", "")))


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_AFFINITY_VALUE = re.compile(r"([A-Za-z0-9_.,:-]|\{(gpu|tile|local_rank)\})*")


@dataclass(frozen=True)
class SiteConfig:
    """One execution site. ``kind``: ``local`` (LocalProvider) or ``pbspro`` (PBSProProvider)."""

    name: str
    kind: str = "local"
    account: str = ""
    queue: str = "auto"  # a name of ``queues`` or "auto": the first queue that fits nodes and walltime
    queues: dict[str, Queue] = field(default_factory=dict)
    queues_source: str = ""  # where the queue table was copied from, and when (it changes)
    max_jobs_per_project: int = 0  # jobs of the project running at once (0 = no limit); ours never exceed it
    slots_dir: str = ""  # where our launchers count their jobs per queue (workflow/queue_slots.py); "" = default
    device: str = "auto"  # the trainer's device type on the compute nodes (train.device): cuda | xpu | cpu | auto
    checkpoint_every_minutes: float = 0.0  # train.checkpoint_every_minutes of its runs: its interrupts' interval (0: the run's)
    tiles_per_node: int = 1  # ranks per node: Aurora 12 (6 PVC GPUs x 2 tiles)
    cpus_per_node: int = 1  # PBS `select=N:ncpus=C`
    select_options: str = ""  # appended to the select line, e.g. "ngpus=4"
    filesystems: str = ""  # `-l filesystems=...`
    place: str = ""  # `-l place=...`
    scheduler_options: list[str] = field(default_factory=list)  # further `#PBS` lines
    worker_init: list[str] = field(default_factory=list)  # module loads, venv activation
    env: dict[str, str] = field(default_factory=dict)  # exported in the job (oneCCL / xccl, ...)
    at_scale: list[AtScale] = field(default_factory=list)  # env and init lines of jobs of at least min_nodes nodes
    mpiexec: str = ""  # template: {ranks} {nodes} {ppn} {cpu_bind} {hostfile}; empty = no MPI launcher
    spare_nodes: int = 0  # nodes a job holds beyond its run's: a host a run names faulty is left out of the next job
    master_addr: str = ""  # with a {hostfile}: MASTER_ADDR from its first host, {host} its short name ("" = not set)
    compile_cache: str = ""  # shared Triton / Inductor caches, filled by `optimus warm-cache` ("" = each rank its own)
    node_local: str = "/tmp"  # each node's own storage, where a job's ranks copy the compile cache
    cpu_bind: str = ""  # "list:A:B:...": local rank i runs on the i-th core set (one per rank of a node)
    gpu_affinity: Optional[GpuAffinity] = None  # which GPU (tile) each rank sees; None = all of them
    cpu_executor: CpuExecutor = field(default_factory=CpuExecutor)  # CPU fan-out (tokenization)
    optimus: str = "optimus"  # the command on the compute nodes
    retries: int = 1  # extra attempts for a failed task (beyond those a multi-job run needs)
    walltime_h: float = 1.0  # per job, for runs that do not come from the registry
    startup_h: float = 0.0  # hours a job spends before its first step (module load, imports, building the model)
    timed_margin: float = 0.25  # room a timed run's walltime leaves over its estimate
    address: str = ""  # interchange address the workers connect to; empty: by address_interface, else Parsl's guess
    address_interface: str = ""  # the submit host's network interface the workers reach (Aurora: hsn0)
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
        if self.checkpoint_every_minutes < 0:
            bad("checkpoint_every_minutes", "must be >= 0 (0: the run's own setting)")
        if self.startup_h < 0 or self.timed_margin < 0:
            bad("startup_h" if self.startup_h < 0 else "timed_margin", "must be >= 0")
        if not (0 < self.mfu <= 1) or self.peak_tflops_per_tile <= 0:
            bad("mfu", "must be in (0, 1], with peak_tflops_per_tile > 0")
        if self.kind == "pbspro" and not self.queues:
            bad("queues", "a PBS site needs its queue table (name: {min_nodes, max_nodes, walltime_h} or {tiers})")
        if self.device not in ("auto", "cpu", "cuda", "xpu"):
            bad("device", "must be one of auto, cpu, cuda, xpu")
        if self.max_jobs_per_project < 0:
            bad("max_jobs_per_project", "must be >= 0 (0 = no limit)")
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
                self.mpiexec.format(ranks=1, nodes=1, ppn=1, cpu_bind="", hostfile="")
            except (KeyError, IndexError) as e:
                bad("mpiexec", f"unknown placeholder {e}; allowed: {{ranks}} {{nodes}} {{ppn}} {{cpu_bind}} "
                               f"{{hostfile}}")
        if self.spare_nodes < 0:
            bad("spare_nodes", "must be >= 0")
        if self.spare_nodes and "{hostfile}" not in self.mpiexec:
            bad("spare_nodes", "spare nodes need an mpiexec line with a {hostfile} placeholder (the ranks' hosts, "
                               "the faulty ones left out)")
        if self.master_addr and ("{host}" not in self.master_addr or "{hostfile}" not in self.mpiexec):
            bad("master_addr", "a template with {host} (the first host of the job's hostfile), for an mpiexec line "
                               "with a {hostfile} placeholder")


def at_scale(site: "SiteConfig", nodes: int) -> tuple[dict[str, str], list[str]]:
    """(env, init lines) of a job of ``nodes`` nodes: the site's env, then every at_scale entry's
    the job is large enough for (later entries win), and those entries' init lines in order."""
    env, init = dict(site.env), []
    for entry in site.at_scale:
        if nodes >= entry.min_nodes:
            env.update(entry.env)
            init += entry.init
    return env, init


def site_from_dict(data: dict[str, Any], **overrides: Any) -> SiteConfig:
    """A SiteConfig from a YAML ``site:`` block; ``overrides`` replace fields (tests, CLI)."""
    data = {**(data or {}), **overrides}
    known = {f.name for f in fields(SiteConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"site.{unknown[0]}: unknown field; allowed: {', '.join(sorted(known))}")
    if "name" not in data:
        raise ConfigError("site.name: missing")
    if not isinstance(data.get("queues") or {}, dict):
        raise ConfigError(f"site.queues = {data['queues']!r}: must be a mapping of queue name to its limits")
    queues = {str(qname): Queue.from_dict(qname, q) for qname, q in (data.get("queues") or {}).items()}
    data["queues"] = queues
    for f in fields(SiteConfig):  # a wrong type is named here, not as a TypeError later
        kind = _FIELD_TYPES.get(str(f.type))
        if kind is not None and f.name in data and data[f.name] is not None:
            value = [data[f.name]] if kind is list and isinstance(data[f.name], str) else data[f.name]
            _check_type(f"site.{f.name}", value, kind, _TYPE_WORDS[kind])
            data[f.name] = value
    if not data.get("account"):
        data["account"] = os.environ.get(ACCOUNT_ENV, "")
    data["env"] = {str(k): str(v) for k, v in (data.get("env") or {}).items()}
    scale = data.get("at_scale") or []
    if not isinstance(scale, list):
        raise ConfigError(f"site.at_scale = {scale!r}: must be a list of {{min_nodes, env, init, why}}")
    data["at_scale"] = [AtScale.from_dict(i, entry) for i, entry in enumerate(scale)]
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
    return SiteConfig(**data)


_FIELD_TYPES = {"int": int, "float": float, "str": str, "list[str]": list}
_TYPE_WORDS = {int: "must be an integer", float: "must be a number", str: "must be a string",
               list: "must be a list of strings"}


def load_site(name_or_path: str | Path, **overrides: Any) -> SiteConfig:
    """``local`` (built in), a name (``workflow/config/<name>.yaml``) or a YAML file's ``site:`` block."""
    if str(name_or_path) == "local":
        return site_from_dict({"name": "local", "kind": "local", "mpiexec": ""}, **overrides)
    path = Path(name_or_path)
    given = path.suffix in (".yaml", ".yml")  # a file the user names, not one of ours
    if not given:
        path = CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ["local", *sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if _has_site(p))]
        what = "no such file" if given else "unknown"
        raise ConfigError(f"site = {str(name_or_path)!r}: {what}; known: {', '.join(known)} or a YAML file with a "
                          f"site: block")
    import yaml

    text = path.read_text()
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context and start is not None and mark is not None and start.line != mark.line:
            problem += f"; {context} that starts at line {start.line + 1}"
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    block = doc.get("site") if isinstance(doc, dict) else None
    if not isinstance(block, dict):
        raise ConfigError(f"site: {path} has no site: block (a mapping under a top-level 'site:' key)")
    try:
        return site_from_dict(block, **overrides)
    except ConfigError as e:
        keys = _field_of(str(e))
        if keys and keys[0] in overrides:  # the value came from the caller, not from the file
            raise
        line = _line_of(text, ["site", *keys])
        raise ConfigError(f"{path}{f', line {line}' if line else ''}: {e}") from None


def _field_of(message: str) -> list[str]:
    """The field a site error names (``site.queues.debug.colour: ...`` or ``site NAME: device = ...``)."""
    m = re.match(r"site\.([\w.-]+)", message) or re.match(r"site [^:]*: ([\w.-]+) =", message)
    return m.group(1).split(".") if m else []


def _line_of(text: str, keys: list[str]) -> int | None:
    """The line (from 1) of the deepest of ``keys`` (a path of mapping keys) found in the YAML ``text``."""
    import yaml

    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            break
        found = next(((k, v) for k, v in node.value if getattr(k, "value", None) == key), None)
        if found is None:
            break
        line, node = found[0].start_mark.line + 1, found[1]
    return line


def _has_site(path: Path) -> bool:
    return "\nsite:" in "\n" + path.read_text()
