"""Launchers: run `optimus pretrain` here, or submit it through Parsl onto a site and wait.

The core is plain Python (Parsl's guide: write the logic without Parsl, wrap it last):

    >>> from workflow.launch import pretrain_argv, command_line
    >>> argv = pretrain_argv({"experiment": "scaling-mula-220b-a10b-384", "scale": "paper",
    ...                       "data": "/data/tokens", "out": "/runs/x", "quiet": True})
    >>> argv[:4]
    ['optimus', 'pretrain', '--experiment', 'scaling-mula-220b-a10b-384']

``command_line(job, argv)`` prefixes the site's mpiexec line (one rank per tile, each bound to
its cores) and GPU affinity wrapper (each rank sees only its tile), and
``submit(site, job, command, ...)`` is the only function that imports Parsl: a ``bash_app``
through the site's Parsl ``Config`` (workflow/parsl_sites.py), blocking until the job's task ends.
The ranks find their rank / local rank in the launcher's environment (PMI / PALS), so the
command on the nodes is the same `optimus pretrain` a laptop runs, with ``--launcher local``.
"""
from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from optimus_core.config import ConfigError
from optimus_core.log import get_logger
from optimus_core.train.node_faults import FAULTS_FILE, NODE_FAULT_EXIT_CODE
from workflow.parsl_sites import parsl_config
from workflow.plan import HOSTFILE_VARIABLE, JobPlan
from workflow.sites import SiteConfig

_log = get_logger(__name__)

# Flags that choose *where* to run, or that describe this machine (its thread count): never
# forwarded to the command that runs there (the site's env sets the compute nodes' threads).
WHERE = {"launcher", "site", "nproc", "threads"}
CONFIG_ERROR = 2  # the `optimus` command's status for a configuration error
REPEATED = {"set", "task_dir"}  # flags given once per value (action="append"); other lists follow one flag


def pretrain_argv(options: dict[str, Any], optimus: str = "optimus") -> list[str]:
    """`optimus pretrain` with ``options``: ``command_argv("pretrain", ...)``."""
    return command_argv("pretrain", options, optimus)


def command_argv(command: str, options: dict[str, Any], optimus: str = "optimus") -> list[str]:
    """`optimus COMMAND` with ``options`` (flag name with '_' -> value): None / False dropped,
    True as a bare flag, a list repeated for the flags given once a value (REPEATED: ``set``),
    else its values after one flag (``tasks``), the launcher forced to ``local``."""
    argv = [*shlex.split(optimus), command]
    for key, value in options.items():
        if key in WHERE or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)) and key in REPEATED:
            for v in value:
                argv += [flag, str(v)]
        elif isinstance(value, (list, tuple)):  # one flag, its values after it (nargs="+")
            argv += [flag, *map(str, value)] if value else []
        else:
            argv += [flag, str(value)]
    return argv + ["--launcher", "local"]


def command_line(job: JobPlan, argv: list[str], hosts: tuple[str, Path, Path | None] | None = None) -> str:
    """The shell line the job runs: the mpiexec prefix (if any), the site's per-rank GPU affinity
    wrapper (if any: each rank sees only its tile) and the command. Where the mpiexec line names
    a hostfile, ``hosts`` = (the `optimus` command, a directory, the run's node-faults.json or
    None) writes it first on the job's head node, as ``hostfile.<PBS job id>`` in the directory:
    the job's nodes less those the run named faulty (`optimus hosts`, workflow/hostfile.py), so
    that a relaunch leaves them out."""
    cmd = shlex.join(argv)
    line = f"{job.launcher} {cmd}" if job.launcher else cmd
    if f"${HOSTFILE_VARIABLE}" not in job.mpiexec:
        return line
    if hosts is None:
        raise ValueError("command_line: the site's mpiexec line names a {hostfile}: give hosts=(optimus, dir, faults)")
    optimus, directory, faults = hosts
    write = [*shlex.split(optimus), "hosts", "--nodes", str(job.nodes)]
    write += ["--faults", str(faults)] if faults is not None else []
    steps = [f"export {HOSTFILE_VARIABLE}={shlex.quote(str(directory))}/hostfile.\"${{PBS_JOBID:-local}}\"",
             f"{shlex.join(write)} --out \"${HOSTFILE_VARIABLE}\""]
    if job.master_addr:  # rank 0 runs on the hostfile's first host, which need not be the node file's
        addr = job.master_addr.replace("{host}", "$(head -n 1 \"$" + HOSTFILE_VARIABLE + "\" | cut -d. -f1)")
        steps.append(f"export MASTER_ADDR={addr}")
    return " && ".join([*steps, line])


@dataclass
class Submitted:
    returncode: int
    stdout: Path
    stderr: Path
    seconds: float

    def last_line(self) -> str:
        text = self.stdout.read_text(errors="replace").strip() if self.stdout.is_file() else ""
        return text.splitlines()[-1] if text else ""

    def tail(self, n: int = 30) -> str:
        text = self.stderr.read_text(errors="replace") if self.stderr.is_file() else ""
        return "\n".join(text.splitlines()[-n:])


def submit(site: SiteConfig, job: JobPlan, command: str, run_dir: str | Path, name: str = "optimus") -> Submitted:
    """Run ``command`` as one Parsl bash_app on ``site`` (one PBS job of ``job.nodes`` nodes) and
    wait for it. Parsl's run directory (submit scripts, logs) is ``run_dir``; the app's stdout and
    stderr land in ``run_dir/<name>.out|.err`` (appended to by each attempt). Parsl does not retry
    the task: a new attempt is a new submit, so a new job (launch_chain)."""
    import parsl
    from parsl import bash_app

    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    out, err = run_dir / f"{name}.out", run_dir / f"{name}.err"

    @bash_app(executors=["optimus"])
    def optimus_job(cmd: str, stdout: tuple = (str(out), "a"), stderr: tuple = (str(err), "a")) -> str:
        return cmd

    t0 = time.time()
    dfk = parsl.load(parsl_config(site, job, run_dir / "parsl"))
    try:
        code = 0
        try:
            optimus_job(command).result()
        except Exception as e:  # BashExitFailure carries the exit code; a lost job (walltime, node) does not
            code = getattr(e, "exitcode", None) or 1
            with open(err, "a") as f:
                f.write(f"\n[optimus launch] {type(e).__name__}: {e}\n")
    finally:
        dfk.cleanup()  # ends the job (qdel), so that a next attempt gets a fresh one
        parsl.clear()
    return Submitted(code, out, err, time.time() - t0)


class LaunchError(ValueError):
    """A submitted job ended without success (its exit code and stderr tail in the message)."""


def launch_chain(site: SiteConfig, job: JobPlan, command: str, run_dir: str | Path, name: str,
                 submit_fn=None, log=print, poll_s: float = 10.0, faults: Path | None = None,
                 progress: Callable[[], int] | None = None) -> Submitted:
    """Submit ``command`` as chained jobs until one ends with success: ``job.jobs`` jobs for a run
    longer than one walltime, each resuming from the newest checkpoint, plus ``site.retries`` for
    failures. Every attempt is a new PBS job, so a failed node is not given back to the run in the
    same allocation, and each holds a slot of its queue while it is queued or running
    (workflow/queue_slots.py: the queue's jobs-per-user limit). A timed run gets no second job for
    its length (it fits one), only the retries. A configuration error (status 2) ends the chain:
    the next job would refuse the same command. A node fault (status 76: the run named hosts in
    ``faults``, its node-faults.json) is said with the hosts; the next job leaves them out where
    it holds spare nodes (``site.spare_nodes``; command_line's hostfile). ``progress``: a count of
    the work done that the command keeps across jobs (an evaluation's checkpoints): a job that
    ends unfinished but raised it is followed by one more, not counted against the retries."""
    from workflow.queue_slots import queue_slots

    submit_fn = submit_fn or submit
    attempts = job.jobs + site.retries
    made = progress() if progress is not None else 0
    done, attempt = None, 0
    while attempt < attempts:
        attempt += 1
        with queue_slots(site, job.queue, wait_log=log, poll_s=poll_s):
            log(f"[optimus launch] {name}: job {attempt} of at most {attempts} (queue {job.queue or '-'}, "
                f"walltime {job.walltime})")
            done = submit_fn(site, job, command, run_dir, name=name)
        if done.returncode in (0, CONFIG_ERROR):  # success, or an error no new job fixes
            return done
        if progress is not None and (now := progress()) > made:
            log(f"[optimus launch] {name}: job {attempt} got from {made} to {now} before it ended: the next goes on")
            made, attempts = now, attempts + 1
        log(f"[optimus launch] {name}: job {attempt} ended with status {done.returncode}"
            + ("; submitting the next, which resumes from the newest checkpoint" if attempt < attempts else ""))
        if done.returncode == NODE_FAULT_EXIT_CODE and faults is not None:
            from optimus_core.train import node_faults

            hosts = ", ".join(node_faults.read(faults)["hosts"]) or "(none recorded)"
            log(f"[optimus launch] {name}: a node fault: host(s) {hosts} named in {faults}; "
                + (f"the next job leaves them out ({site.spare_nodes} spare node(s) a job)" if site.spare_nodes else
                   "the site holds no spare nodes (site.spare_nodes), so the next job runs without them only "
                   "if PBS gives it other nodes"))
    return done


def pretrain_on_site(options: dict[str, Any], run_id: str) -> Submitted:
    """`optimus pretrain --launcher parsl --site NAME ...`: plan the job (errors before anything is
    submitted), submit the same command with ``--launcher local`` under the site's mpiexec as
    chained jobs (launch_chain), wait.

    The job's ranks are the run's tiles for ``--experiment`` (at ``--scale``), else ``--nproc``;
    its walltime the run's per-job walltime, else the site's ``walltime_h``. The site's device
    type and checkpoint interval (``site.device``, ``site.checkpoint_every_minutes``) become
    ``--set train.device=...`` / ``--set train.checkpoint_every_minutes=...`` ahead of the user's
    own ``--set``s, which win."""
    from workflow.experiments import get
    from workflow.plan import plan
    from workflow.sites import load_site

    if not options.get("site"):
        raise ConfigError("--launcher parsl needs --site NAME (local, aurora, or a YAML file with a site: block)")
    site = load_site(options["site"])
    if options.get("experiment"):
        job = plan(get(options["experiment"]).scale(options.get("scale") or "laptop"), site)
    else:
        job = plan(None, site, ranks=int(options.get("nproc") or 1))
    forwarded = _forwarded(options, ("data", "out", "store"))
    forwarded["run_id"] = run_id
    site_sets = [f"train.device={site.device}"] if site.device != "auto" else []
    if site.checkpoint_every_minutes:
        site_sets.append(f"train.checkpoint_every_minutes={site.checkpoint_every_minutes:g}")
    forwarded["set"] = [*site_sets, *(forwarded.get("set") or [])]  # the user's own --set win
    return _run_on_site(site, job, "pretrain", forwarded, run_id)


def _forwarded(options: dict[str, Any], paths: tuple[str, ...]) -> dict[str, Any]:
    """The options the job's command gets, ``paths`` made absolute (its working directory is not ours)."""
    forwarded = {k: v for k, v in options.items() if k not in ("func", "command")}
    for key in paths:
        if forwarded.get(key) is not None:
            forwarded[key] = Path(forwarded[key]).resolve()
    return forwarded


def _run_on_site(site: SiteConfig, job: JobPlan, subcommand: str, forwarded: dict[str, Any], name: str,
                 progress: Callable[[], int] | None = None) -> Submitted:
    """`optimus SUBCOMMAND` with ``forwarded`` under the job's launcher, as launch_chain's jobs
    (``progress``: theirs); LaunchError with the stderr's tail unless one ends with success."""
    argv = command_argv(subcommand, forwarded, optimus=site.optimus)
    if job.ranks > 1 and not job.mpiexec:  # no MPI launcher on this site: the command spawns its ranks
        argv[-2:-2] = ["--nproc", str(job.ranks)]
    run_dir = forwarded.get("out") if subcommand == "pretrain" else forwarded.get("run")
    faults = Path(run_dir) / FAULTS_FILE if run_dir is not None else None
    # one hostfile per PBS job, beside Parsl's files of this launch
    command = command_line(job, argv, hosts=(site.optimus, Path(site.run_dir).resolve() / name, faults))
    _log.info(f"launch on site {site.name}: {job.nodes} node(s), {job.ranks} rank(s), queue {job.queue or '-'}, "
              f"walltime {job.walltime}, up to {job.jobs} job(s)")
    _log.info(f"launch: {command}")
    return _succeeded(site, name, launch_chain(site, job, command, Path(site.run_dir).resolve() / name, name,
                                               log=_log.info, faults=faults, progress=progress))


def _succeeded(site: SiteConfig, name: str, done: Submitted) -> Submitted:
    """``done``, if its last job succeeded; else LaunchError with its status and stderr's tail."""
    if done.returncode != 0:
        raise LaunchError(f"{name}: the job on site {site.name} failed (exit {done.returncode}); "
                          f"stderr {done.stderr}:\n{done.tail()}")
    return done


def _one_process_job(site: SiteConfig) -> JobPlan:
    """A job of one node of ``site`` (planned as such: queue, walltime, account) that runs one
    process on its head node's first tile: no mpiexec, no affinity wrapper, no hostfile."""
    import dataclasses

    from workflow.plan import plan

    job = plan(None, site, ranks=site.tiles_per_node if site.kind == "pbspro" else 1)
    return dataclasses.replace(job, ranks=1, mpiexec="", gpu_affinity="")


def _downstream_evaluation(site: SiteConfig, options: dict[str, Any], run_dir: Path) -> Submitted:
    """`optimus evaluate --tasks ...` with lm-eval's tasks on a site (the model whole in each
    process, in bf16 where asked: up to a 20B model on a 64 GiB tile), on one node: the newest
    checkpoint by one process on one tile; every checkpoint (--all-checkpoints) by the node's
    tiles, one process each, sharing the checkpoints (as many at once as the node's memory holds:
    stages/evaluate.py), each checkpoint's scores kept as they are made, so that a job cut short by
    its walltime leaves them to the next, which goes on from there (launch_chain's progress)."""
    import json

    from workflow.plan import plan

    if int(options.get("nproc") or 1) > 1:
        raise ConfigError(f"--tasks {' '.join(options['tasks'])} with --nproc {options['nproc']} on a site: the "
                          f"site's job takes one node's tiles for every checkpoint (--all-checkpoints), one for "
                          f"the newest")
    every = bool(options.get("all_checkpoints") or options.get("downstream_all_checkpoints"))
    job = plan(None, site, ranks=site.tiles_per_node if site.kind == "pbspro" else 1) if every else \
        _one_process_job(site)
    forwarded = _forwarded(options, ("run", "data", "out", "store"))
    forwarded.pop("nproc", None)
    if site.device != "auto" and forwarded.get("device") in (None, "auto"):
        forwarded["device"] = site.device
    from stages.evaluate import checkpoints_kept

    out = Path(forwarded.get("out") or run_dir / "eval.json")
    return _run_on_site(site, job, "evaluate", forwarded,
                        f"downstream-{json.loads((run_dir / 'meta.json').read_text())['run_id']}",
                        progress=(lambda: checkpoints_kept(out)) if every else None)


def warm_cache_on_site(options: dict[str, Any]) -> Submitted:
    """`optimus warm-cache --site NAME`: the site's compile cache (``site.compile_cache``) filled
    once, by one process on one node of the site: `optimus rehearse` of every paper run given
    (default: all) on the site's device, compiling and autotuning each kernel on the runs' own
    shapes into the shared cache (optimus_core.compile_cache, OPTIMUS_COMPILE_CACHE_FILL=1), for
    every later job to start from. The cache directory is checked writable here, before
    anything is submitted."""
    import dataclasses

    from optimus_core.compile_cache import FILL, check_cache_dir
    from workflow.sites import load_site

    site = load_site(options["site"])
    if not site.compile_cache:
        raise ConfigError(f"site {site.name}: compile_cache = '': no shared compile cache to fill; set "
                          f"site.compile_cache to a directory every job can read")
    check_cache_dir(Path(site.compile_cache), "site.compile_cache")
    job = _one_process_job(site)
    job = dataclasses.replace(job, env={**job.env, FILL: "1"})
    argv = [*shlex.split(site.optimus), "rehearse", "--no-save", "--steps", str(options.get("steps") or 2),
            "--site", str(Path(options["site"]).resolve()) if Path(options["site"]).suffix in (".yaml", ".yml")
            else options["site"]]
    argv += ["--device", site.device] if site.device != "auto" else []
    argv += ["--experiment", *options["experiment"]] if options.get("experiment") else []
    name = "warm-cache"
    _log.info(f"warm-cache on site {site.name}: 1 node, queue {job.queue or '-'}, walltime {job.walltime}: "
              f"{shlex.join(argv)}")
    return _succeeded(site, name, launch_chain(site, job, shlex.join(argv), Path(site.run_dir).resolve() / name,
                                               name, log=_log.info))


def window_order_on_site(options: dict[str, Any]) -> Submitted:
    """`optimus window-order --launcher parsl --site NAME ...`: the window order drawn by one
    process on one node of the site and written beside the tokens on its shared file system,
    where a compute node's memory holds it (8 bytes a window while it is drawn: some 16 GiB for
    OLMoE-mix's windows), not the node that runs Snakemake."""
    from workflow.sites import load_site

    if not options.get("site"):
        raise ConfigError("--launcher parsl needs --site NAME (local, aurora, or a YAML file with a site: block)")
    site = load_site(options["site"])
    return _run_on_site(site, _one_process_job(site), "window-order", _forwarded(options, ("data",)),
                        f"window-order-s{options['seq_len']}-seed{options['seed']}")


def evaluate_on_site(options: dict[str, Any]) -> Submitted:
    """`optimus evaluate --launcher parsl --site NAME ...`: the held-out evaluation of a run as a
    compute job, on the model sharded as it was trained (stages/evaluate.py), so that a model no
    login node can hold is evaluated where it was trained. Ranks: ``--nproc`` if > 1, else the
    world size the newest checkpoint was written by; the site's device type; walltime the
    site's ``walltime_h``, its queue from the table."""
    import json

    from workflow.plan import plan
    from workflow.sites import load_site

    if not options.get("site"):
        raise ConfigError("--launcher parsl needs --site NAME (local, aurora, or a YAML file with a site: block)")
    site = load_site(options["site"])
    run_dir = Path(options["run"]).resolve()
    ranks = int(options.get("nproc") or 1)
    if set(options.get("tasks") or ["heldout"]) != {"heldout"}:  # lm-eval: the whole model in one process
        return _downstream_evaluation(site, options, run_dir)
    if ranks == 1:
        from optimus_core.train.checkpoint import newest_meta

        newest = newest_meta(run_dir)  # on the login node: its meta only, no checkpoint data read
        ranks = int(newest.get("world_size", 1)) if newest else 1
    job = plan(None, site, ranks=ranks)
    forwarded = _forwarded(options, ("run", "data", "out", "store"))
    if site.device != "auto" and forwarded.get("device") in (None, "auto"):
        forwarded["device"] = site.device
    return _run_on_site(site, job, "evaluate", forwarded,
                        f"evaluate-{json.loads((run_dir / 'meta.json').read_text())['run_id']}")
