"""Stage `pretrain`: train one run with the trainer core and record it in the results store.

    from stages.pretrain import PretrainConfig, PretrainInputs, PretrainOutputs, run_pretrain
    cfg = presets.get("mula-7b-a1b@laptop").run_config(**{"train.steps": 200})
    run_pretrain(PretrainConfig(cfg, run_id="laptop-mula-7b-a1b"),
                 PretrainInputs(data_dir=Path("results/data/tokens")),
                 PretrainOutputs(run_dir=Path("results/runs/laptop-mula-7b-a1b"), store=Path("results/store.zarr")))

The run directory holds ``meta.json`` (run id, status, config) from the first step on,
``checkpoints/``, and ``summary.json`` only once the run has finished: the file the workflow
declares as the stage's output, so an interrupted run never looks finished, and rerunning the
stage on the same directory resumes from the newest valid checkpoint.

A run directory belongs to one run, one process at a time: while a job trains into it, its
global rank 0 holds ``run.lock`` (optimus_core.train.run_lock: another job is refused, a lock
left by a dead or silent holder is taken over). A resume may change only the settings of
optimus_core.train.resumable.RESUMABLE (how and where it runs, its cadences, how long); any
other change is refused, and the allowed ones are recorded in meta.json's ``resumes``.

A new run starts from the seeded initialisation, or from the weights of a Hugging Face export
(``optimus export-hf``) with ``train.init_from`` (``--set train.init_from=DIR``; the preset's
architecture must match the export's, optimus_core.train.build checks it). A run
that resumes loads its checkpoint instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from optimus_core.atomic import atomic_write
from optimus_core.config import ConfigError, RunConfig
from optimus_core.device import device_info
from optimus_core.log import get_logger
from optimus_core.parallel import init_distributed, shutdown
from optimus_core.provenance import describe, software, utc_now
from optimus_core.train.loop import Trainer
from optimus_core.train.resilience import Preempted
from optimus_core.train.resumable import resume_changes
from optimus_core.train.run_lock import LOCK_NAME, TAKEOVER_NAME, RunLock

_log = get_logger(__name__)


@dataclass
class PretrainConfig:
    run: RunConfig
    run_id: str
    experiment: str = ""
    progress: bool = True
    start_over: bool = False  # a run directory whose checkpoints are all invalid: set them aside, train from 0

    def __post_init__(self):
        if not self.run_id or "/" in self.run_id or self.run_id.startswith("."):
            raise ConfigError(f"run_id = {self.run_id!r}: must be a non-empty name without '/' or a leading '.'")


@dataclass
class PretrainInputs:
    data_dir: Path


@dataclass
class PretrainOutputs:
    run_dir: Path
    store: Path | None = None  # None: metrics are not recorded (tests, quick experiments)


@dataclass
class PretrainResult:
    run_id: str
    run_dir: Path
    steps: int
    tokens: int
    resumed_from: int | None
    final_loss: float
    final_eval: dict = field(default_factory=dict)
    tokens_per_s: float = float("nan")
    wall_time_s: float = float("nan")
    already_finished: bool = False  # this call trained nothing: the run had finished (finished_result)


# What a run directory holds: the run's files, evaluate's eval.json, a Parsl launch's own
# directory and job logs (written before the run starts), the lock of the process training into
# it (and the short-lived lock of a take-over), and the temporary files of an atomic write of any
# of these that was interrupted (.meta.json.tmp-*). Anything else is not a run directory.
RUN_ENTRIES = {"meta.json", "summary.json", "checkpoints", "eval.json", "parsl", LOCK_NAME, TAKEOVER_NAME}
RUN_LOG_SUFFIXES = (".out", ".err", ".log")


def _is_run_entry(name: str) -> bool:
    return (name in RUN_ENTRIES or name.endswith(RUN_LOG_SUFFIXES)
            or any(name.startswith(f".{entry}.tmp-") for entry in RUN_ENTRIES))


def _check_run_dir(run_dir: Path, run_id: str, data_dir: Path | None = None) -> None:
    """A run directory belongs to one run: refuse to train another run into it, or into a file
    or a directory of other things (a dataset, the user's files), or into the data it reads (a
    rerun of `optimus tokenize` there replaces the whole directory, the run with it)."""
    if data_dir is not None:
        out, data = run_dir.resolve(), Path(data_dir).resolve()
        if out == data or data in out.parents:
            raise FileExistsError(f"--out {run_dir} is {'' if out == data else 'inside '}the data directory (--data "
                                  f"{data_dir}): a rerun of `optimus tokenize` there would delete the run; use an "
                                  f"--out outside it")
    if run_dir.exists() and not run_dir.is_dir():
        raise FileExistsError(f"--out {run_dir} is a file, not a run directory: use another --out")
    meta_path = run_dir / "meta.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{meta_path}: not valid JSON ({e}): a damaged run directory (nothing was changed); "
                             f"repair or remove it, or use another --out") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{meta_path}: not a run's meta.json (a JSON {type(meta).__name__}, not an object); "
                             f"nothing was changed: use another --out")
        existing = meta.get("run_id")
        if existing != run_id:
            raise ValueError(f"{run_dir} holds run {existing!r}, not {run_id!r}: use another --out, or --run-id "
                             f"{existing} to resume it (a run directory renamed keeps its run id)")
    elif run_dir.is_dir():
        others = sorted(p.name for p in run_dir.iterdir() if not _is_run_entry(p.name))
        if others:
            shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            raise FileExistsError(f"--out {run_dir} holds {shown} and no run's meta.json: not a run directory "
                                  f"(nothing was changed); use an empty or new --out")


def finished_result(run_dir: Path, cfg: RunConfig) -> PretrainResult | None:
    """The result of ``run_dir``'s finished run when ``cfg`` asks for no more steps than it took
    (a re-run is then a no-op: no file or store row is touched); None when there is training to
    do. A run is never shortened: fewer steps than its newest checkpoint is an error."""
    from optimus_core.train.checkpoint import newest_meta

    saved = newest_meta(run_dir)
    if saved is not None and saved["step"] > cfg.train.steps:
        raise ValueError(f"{run_dir} has a checkpoint at step {saved['step']}; train.steps = {cfg.train.steps} is "
                         f"fewer, and a run is never shortened: ask for {saved['step']} or more, or use another --out")
    try:
        meta = json.loads((run_dir / "meta.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("status") != "completed" or summary.get("steps") != cfg.train.steps:
        return None
    fields = {f.name for f in dataclasses.fields(PretrainResult)}
    return PretrainResult(**dict({k: v for k, v in summary.items() if k in fields}, run_dir=run_dir,
                                 already_finished=True))


def run_pretrain(config: PretrainConfig, inputs: PretrainInputs, outputs: PretrainOutputs) -> PretrainResult:
    """Train on this process's rank: a world of one, or one rank of a torchrun / mpiexec / local
    launch (optimus_core.parallel.init_distributed reads which). Every rank trains; global rank
    0 alone writes meta.json, the store and summary.json; the others return the same result."""
    from optimus_core.compile_cache import use_compile_cache
    from optimus_core.parallel.mesh import read_launch_env

    use_compile_cache(read_launch_env().local_rank)  # the site's warm kernels, before any compiles
    cfg = config.run.replace(data=config.run.data.replace(path=str(Path(inputs.data_dir).resolve())))
    if cfg.train.init_from:  # recorded as an absolute path, like the data
        cfg = cfg.replace(train=cfg.train.replace(init_from=str(Path(cfg.train.init_from).resolve())))
    mesh = init_distributed(cfg.parallel, cfg.model.moe.n_experts if cfg.model.moe else None, cfg.train.device,
                            intel_extension=cfg.execution.intel_extension)
    try:
        return _run_rank(config, inputs, outputs, cfg, mesh)
    finally:
        shutdown(mesh)


def _run_rank(config: PretrainConfig, inputs: PretrainInputs, outputs: PretrainOutputs, cfg: RunConfig,
              mesh) -> PretrainResult:
    lead = mesh.rank == 0
    run_dir = Path(outputs.run_dir)
    _check_run_dir(run_dir, config.run_id, inputs.data_dir)  # every rank, reading only: the same refusal everywhere
    done = finished_result(run_dir, cfg)
    if done is not None:  # a no-op: takes no lock, touches no file
        if lead:
            _log.info("%s finished at step %d already: nothing to do (ask for more train.steps to continue it)",
                      config.run_id, done.steps)
        return done
    # Global rank 0 alone takes the run directory's lock, for its whole job, before anything is
    # written; the ranks then agree on whether it did (the collective is also the barrier after
    # which the other ranks may look for checkpoints in run_dir: rank 0 has made it).
    lock = RunLock(run_dir, config.run_id, uid=_read_meta(run_dir).get("uid"))  # a resumed run's identity
    failed: BaseException | None = None
    made = lead and not run_dir.exists()  # a run refused before it writes anything leaves no directory behind
    if lead:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except BaseException as e:  # noqa: BLE001  (re-raised below, once the other ranks know)
            failed = e
    if mesh.all_max([float(failed is not None)])[0]:
        if failed is not None:
            raise failed
        # the same sentence as rank 0's, whichever rank's error the launcher shows
        raise lock.refusal("rank 0 could not take the run directory's lock (its error says why)")
    try:
        return _train(config, inputs, outputs, cfg, mesh, run_dir)
    finally:
        lock.release()  # a no-op on the ranks that did not take it
        if made and not (run_dir / "meta.json").exists():  # refused before the run's first write
            _remove_empty(run_dir)


def _remove_empty(root: Path) -> None:
    """Remove ``root`` if it holds only empty directories: what a run refused before its first
    write made (os.rmdir removes no file, so nothing written can be lost)."""
    for path in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            path.rmdir()
    with contextlib.suppress(OSError):
        root.rmdir()


def _drawn_uid(mesh) -> str:
    """A new run's uid, drawn on rank 0 and the same on every rank (one small all-reduce)."""
    mine = float(uuid.uuid4().int >> 76) if mesh.rank == 0 else 0.0  # 52 random bits: exact in a float
    return f"{int(mesh.all_max([mine])[0]):013x}"


def _read_meta(run_dir: Path) -> dict:
    try:
        meta = json.loads((run_dir / "meta.json").read_text())
    except FileNotFoundError:
        return {}
    return meta if isinstance(meta, dict) else {}


def _check_resume(run_dir: Path, cfg: RunConfig, old_meta: dict) -> dict:
    """The config changes since the run's saved config, where the run directory holds checkpoints
    to resume (all resumable, else ConfigError naming the others); {} for a run that starts."""
    from optimus_core.train.checkpoint import list_step_dirs, newest_meta

    if not list_step_dirs(run_dir):
        return {}  # nothing to resume: the run starts from step 0 under whatever it is given
    saved = old_meta.get("config") or (newest_meta(run_dir) or {}).get("config")
    if not saved:
        return {}
    return resume_changes(RunConfig.from_json(json.dumps(saved)), cfg, str(run_dir))  # a former field: refused


def _train(config: PretrainConfig, inputs: PretrainInputs, outputs: PretrainOutputs, cfg: RunConfig, mesh,
           run_dir: Path) -> PretrainResult:
    lead = mesh.rank == 0
    old_meta = _read_meta(run_dir)  # every rank: the same refusal everywhere; nobody writes it before the Trainer
    changes = _check_resume(run_dir, cfg, old_meta)
    uid = old_meta.get("uid") or _drawn_uid(mesh)  # this run, wherever its directory moves
    info = device_info(cfg.train.device, index=mesh.device.index or 0)
    if not lead:
        trainer = Trainer(cfg, inputs.data_dir, run_dir, writer=None, progress=False, device=info, mesh=mesh,
                          start_over=config.start_over, uid=uid)
        summary = trainer.fit()
        return PretrainResult(config.run_id, run_dir, summary.steps, summary.tokens, summary.resumed_from,
                              summary.final_loss, summary.final_eval, summary.tokens_per_s, summary.wall_time_s)
    attrs = {
        "run_id": config.run_id, "experiment": config.experiment, "preset": cfg.preset,
        "config": cfg.to_dict(), "run_dir": str(run_dir.resolve()),
        "n_params": cfg.model.num_params(), "n_active_params": cfg.model.num_active_params(),
        "flops_per_token": cfg.model.flops_per_token(cfg.data.seq_len),
        "tokens_per_step": cfg.tokens_per_step, "device": info.type, "world_size": mesh.world_size,
        **describe(info.name),
    }
    attrs["software"] = software(info.type, mesh.backend if mesh.distributed else info.backend)
    attrs["launch"] = {"world_size": mesh.world_size, "local_rank": mesh.local_rank, "device": str(mesh.device)}
    attrs["uid"] = uid
    meta = {k: attrs[k] for k in ("run_id", "uid", "experiment", "preset", "config", "software", "launch")}
    # Built before anything is written: a run directory whose checkpoints belong to another model
    # (or any other refusal) leaves its meta.json and its store run as they were.
    trainer = Trainer(cfg, inputs.data_dir, run_dir, writer=None, progress=config.progress, device=info, mesh=mesh,
                      start_over=config.start_over, uid=uid)
    plan = trainer.plan  # what every "auto" resolved to, why, and the memory it plans
    mode, every = plan.checkpointing
    budget = plan.budget_bytes
    attrs["memory"] = meta["memory"] = {
        "activation_checkpointing": mode, "activation_checkpointing_every": every,
        "model_gib_per_rank": plan.memory.peak_gib, "budget_gib": budget / 2**30 if budget else None}
    attrs["execution_plan"] = meta["execution_plan"] = plan.to_dict()
    # the resumes that changed a resumable setting (optimus_core.train.resumable), oldest first
    resumes = list(old_meta.get("resumes") or [])
    if changes and trainer.resumed_from is not None:
        resumes.append({"step": trainer.resumed_from, "at": utc_now(),
                        "changed": {k: [old, new] for k, (old, new) in changes.items()}})
        _log.info("%s resumes from step %d with %s", config.run_id, trainer.resumed_from,
                  ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items()))
    if resumes:
        meta["resumes"] = resumes
    store = None
    if outputs.store:  # zarr only where a store is written (a GPU node may train without one); a store that
        from optimus_core.store import open_store  # is not one is refused before meta.json says "running"

        store = open_store(outputs.store)
        store.check_owner(config.run_id, attrs["uid"], run_dir)  # another run's record is never replaced
    # the store's run opened first: a store that cannot be written (read-only, full) refuses the
    # run before meta.json says "running" (a new run directory then goes, as for any refusal)
    writer = store.run_writer(config.run_id, attrs) if store else None
    atomic_write(run_dir / "meta.json", json.dumps(dict(meta, status="running", started=utc_now()), indent=2))
    start = time.time()
    try:
        trainer.attach_writer(writer)
        if writer:
            writer.set_status("running")
        summary = trainer.fit()
    except BaseException as e:
        status = "interrupted" if isinstance(e, (KeyboardInterrupt, Preempted)) else "failed"
        if writer:
            writer.close(status=status)
        atomic_write(run_dir / "meta.json", json.dumps(dict(meta, status=status, error=repr(e)), indent=2))
        raise
    wall = time.time() - start
    result = PretrainResult(config.run_id, run_dir, summary.steps, summary.tokens, summary.resumed_from,
                            summary.final_loss, summary.final_eval, summary.tokens_per_s, wall)
    if writer:
        writer.update_attrs(wall_time_s=wall, tokens=summary.tokens, steps=summary.steps,
                            tokens_per_s=summary.tokens_per_s, finished=utc_now())
        writer.close(status="completed")
    atomic_write(run_dir / "meta.json", json.dumps(dict(meta, status="completed", finished=utc_now()), indent=2))
    summary_json = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(result).items()}
    atomic_write(run_dir / "summary.json", json.dumps(summary_json, indent=2))
    return result
