"""Stage `evaluate`: held-out loss, perplexity and bits per byte of a run's newest checkpoint
(or of each kept checkpoint), and downstream tasks through lm-evaluation-harness.

    run_evaluate(EvaluateConfig(), EvaluateInputs(run_dir=Path("results/runs/x")),
                 EvaluateOutputs(eval_json=Path("results/runs/x/eval.json"), store=Path("results/store.zarr")))

Tasks:
    heldout        every held-out sequence of every source (up to ``max_batches`` batches per
                   source): loss, perplexity, bits per byte -> store table ``heldout``
    continuation   offline multiple-choice tasks built from the held-out split, one per source
                   (optimus_core.eval.tasks), run through lm-evaluation-harness
    docstring      offline multiple choice: a held-out Python function's docstring among four
                   (optimus_core.eval.docstring), run through lm-evaluation-harness
    <any other>    an lm-eval task by name: from ``task_dirs`` (local YAML) or lm-eval's registry
                   where its data is available offline
Downstream scores go to store table ``downstream`` (columns ``<metric>.<task>``) and to
``eval.json`` under ``downstream``. lm-eval is needed only for tasks other than ``heldout``
(``pip install -e '.[eval]'``).

    run_evaluate(EvaluateConfig(tasks=("heldout", "continuation", "docstring")), ...)

``all_checkpoints``: the held-out metrics of every valid checkpoint of the run (oldest first,
one ``heldout`` row each with its ``step`` and ``tokens``: eval-vs-tokens curves; listed under
``checkpoints`` in ``eval.json``); downstream tasks run on the newest checkpoint only, or on
each as well with ``downstream_all_checkpoints``. A rerun rewrites the same rows (the store
replaces rows from a re-logged step on), so it is idempotent.

With ``all_checkpoints`` each checkpoint's evaluation is kept as soon as it is made, beside
``eval.json`` (``<eval json>.parts/``): a rerun of an evaluation cut short (a job's walltime, a
failure) evaluates only the checkpoints it had not reached (_Parts).

Sharded: started as several ranks (mpiexec, torchrun, `optimus evaluate --nproc N`, or a site's
compute job through `--launcher parsl`), the held-out metrics run on the model sharded as the
trainer shards it (FSDP2, the run's EP degree), each rank loading only the rows it holds from the
checkpoint, on ``device``: how a paper-scale model that no one process can hold is evaluated.
Every rank runs the same batches; rank 0 writes the store and ``eval.json``. Downstream tasks
(lm-eval) need the whole model in one process: started as several ranks with them, the ranks
share the checkpoints instead (rank r the r-th of every N, one process each on its own device),
and rank 0 writes the results once every rank's parts are there.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from optimus_core.atomic import atomic_write
from optimus_core.config import ConfigError, ExecutionConfig, RunConfig, from_dict
from optimus_core.model.transformer import Transformer
from optimus_core.provenance import utc_now
from optimus_core.store import open_store
from optimus_core.train.checkpoint import MODEL_ONLY, Checkpoint, latest_valid, newest_meta, valid_checkpoints
from optimus_core.log import get_logger
from optimus_core.paths import missing
from optimus_core.train.evaluate import heldout_metrics

_log = get_logger(__name__)
BUILTIN_TASKS = ("heldout", "continuation", "docstring")  # anything else is handed to lm-eval by name


@dataclass
class EvaluateConfig:
    tasks: tuple[str, ...] = ("heldout",)
    batch_size: int = 16
    max_batches: int = 64
    dtype: str = "float32"
    task_dirs: tuple[str, ...] = ()  # extra directories of lm-eval task YAML files
    limit: int | None = None  # lm-eval: at most this many documents per task (None = all)
    n_items: int = 200  # continuation: items per source; docstring: items at most
    all_checkpoints: bool = False  # held-out metrics of every valid checkpoint, not only the newest
    downstream_all_checkpoints: bool = False  # with all_checkpoints: downstream tasks on each too
    # sharded (several ranks): each rank's device type; one process: "cuda" or "xpu" evaluates on
    # that device (one tile, weights in the evaluation's dtype: a bf16 model as an export runs it),
    # "auto" and "cpu" on the CPU
    device: str = "auto"

    def __post_init__(self):
        self.tasks = tuple(self.tasks)
        self.task_dirs = tuple(str(d) for d in self.task_dirs)
        # ConfigError (a ValueError): a wrong setting, exit 2 from the command line
        bad = [t for t in self.tasks if not isinstance(t, str) or not t.strip()]
        if not self.tasks or bad:
            raise ConfigError(f"tasks = {list(self.tasks)}: need one or more task names "
                              f"({', '.join(BUILTIN_TASKS)} or an lm-eval task)")
        for name in ("batch_size", "max_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)}: must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit = {self.limit}: must be None (all documents) or >= 1")
        if self.limit is not None and not self.downstream:
            raise ConfigError(f"limit = {self.limit}: it limits the documents of downstream tasks, and tasks = "
                              f"{list(self.tasks)} has none (it would be ignored)")
        if self.n_items < 4:
            raise ConfigError(f"n_items = {self.n_items}: must be >= 4 (one true continuation + 3 distractors)")
        if self.all_checkpoints and "heldout" not in self.tasks and not self.downstream_all_checkpoints:
            raise ConfigError(f"all_checkpoints = True with tasks = {list(self.tasks)}: it evaluates held-out "
                              "metrics per checkpoint; add 'heldout' to tasks (or set downstream_all_checkpoints)")
        if self.downstream_all_checkpoints and not self.all_checkpoints:
            raise ConfigError("downstream_all_checkpoints = True needs all_checkpoints = True")

    @property
    def downstream(self) -> tuple[str, ...]:
        return tuple(t for t in self.tasks if t != "heldout")


@dataclass
class EvaluateInputs:
    run_dir: Path
    data_dir: Path | None = None  # default: the data the run was trained on (its config)


@dataclass
class EvaluateOutputs:
    eval_json: Path
    store: Path | None = None


@dataclass
class EvaluateResult:
    run_id: str
    step: int  # the newest checkpoint's
    metrics: dict = field(default_factory=dict)  # of the newest checkpoint
    checkpoints: list[int] = field(default_factory=list)  # steps evaluated, oldest first
    # the held-out evaluation of the newest checkpoint: {"batches", "sequences"} (heldout_metrics)
    heldout_counts: dict = field(default_factory=dict)


def run_evaluate(config: EvaluateConfig, inputs: EvaluateInputs, outputs: EvaluateOutputs) -> EvaluateResult:
    run_dir = Path(inputs.run_dir)
    meta = _run_meta(run_dir)
    run_id = meta["run_id"]
    if outputs.store and Path(outputs.store).exists():  # its rows go to this run's record, never another's
        open_store(outputs.store, mode="r").check_owner(run_id, meta.get("uid"), run_dir)
    for task_dir in config.task_dirs:  # before any model loads
        if not Path(task_dir).is_dir():
            raise FileNotFoundError(f"task directory {task_dir}: "
                                    f"{missing(task_dir, 'directory')} "
                                    f"(of lm-eval task YAMLs)")
    from optimus_core.compile_cache import use_compile_cache
    from optimus_core.parallel.mesh import read_launch_env

    launch = read_launch_env()
    use_compile_cache(launch.local_rank)  # the site's warm kernels, before any compiles
    split = launch.world_size > 1 and bool(config.downstream)  # lm-eval: each rank its own checkpoints
    if launch.world_size > 1 and not split:
        return _run_sharded(config, inputs, outputs, run_id)
    if split and not config.all_checkpoints:
        raise ConfigError(f"tasks = {list(config.tasks)} on {launch.world_size} ranks: the ranks share a run's "
                          f"checkpoints (all_checkpoints); one checkpoint is evaluated by one process")
    device = "cpu"
    if config.device in ("cuda", "xpu"):  # one process on a GPU or a tile: said now if it is not here
        from optimus_core.device import resolve_device_type

        device = resolve_device_type(config.device, field="--device")
        if split:  # this rank's device of the node's (one each where the launcher shows only its own)
            import torch

            backend = getattr(torch, device)
            backend.set_device(launch.local_rank % backend.device_count())
    found = _checkpoints(run_dir, config.all_checkpoints)
    newest = found[-1]
    data_dir = _checked_data(inputs.data_dir or newest.cfg.data.path, run_dir)
    parts = _Parts(outputs.eval_json, config, data_dir) if config.all_checkpoints else None
    mine = _share(found, launch, run_id) if split else found
    done, counts = _evaluate(config, mine, newest, data_dir, device, run_id, parts)
    if split:
        if launch.rank != 0:  # rank 0 writes the store and eval.json once every part is there
            return EvaluateResult(run_id, newest.step, checkpoints=sorted(done))
        done = parts.wait_for(found, run_id)
    return _write_results(config, found, done, outputs, run_id, data_dir, counts)


HOST_SHARE = 0.8  # of a node's memory the ranks that share the checkpoints may fill


def _share(found: list[_Point], launch, run_id: str) -> list[_Point]:
    """This rank's checkpoints where the ranks share them: as many ranks of each node as its
    memory holds loading a checkpoint at once (the float32 state read and the float32 model it
    fills: 8 bytes a parameter, HOST_SHARE of the node's memory; the launch's ranks of a node are
    consecutive), the k-th of them every k-th checkpoint; none for the others."""
    import os

    per_node = launch.local_world or launch.world_size
    if launch.world_size % per_node:  # nodes of unequal ranks: counted as one
        per_node = launch.world_size
    node_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    each = 8 * found[-1].cfg.model.num_params()
    active = max(1, min(per_node, int(HOST_SHARE * node_bytes // each)))
    if launch.local_rank >= active:
        _log.info("%s: rank %d evaluates nothing: %d rank(s) of each node's %d do, each loading %.1f GiB of the "
                  "node's %.0f GiB", run_id, launch.rank, active, per_node, each / 2**30, node_bytes / 2**30)
        return []
    position, ranks = launch.rank // per_node * active + launch.local_rank, launch.world_size // per_node * active
    return found[position::ranks]


def _evaluate(config: EvaluateConfig, points: list[_Point], newest: _Point, data_dir: Path, device: str,
              run_id: str, parts: _Parts | None) -> tuple[dict[int, dict], dict]:
    """({step: record} of ``points``, the held-out counts of the last one evaluated here): each
    checkpoint's held-out metrics and (the newest's, or each with downstream_all_checkpoints)
    downstream scores, as a record (_Parts.record); one already in ``parts`` is kept, each new
    one written there as soon as it is made."""
    done: dict[int, dict] = {}
    todo: list[tuple[int, _Point]] = []
    for k, point in enumerate(points, 1):
        kept = parts.read(point) if parts is not None else None
        if kept is None:
            todo.append((k, point))
        else:
            done[point.step] = kept
            _log.info("%s: checkpoint %d of %d (step %d) evaluated before, kept (%s)", run_id, k, len(points),
                      point.step, parts.path(point))
    counts: dict = {}
    if not todo:
        return done, counts
    with tempfile.TemporaryDirectory(prefix="optimus-tasks-") as tmp:
        # The offline tasks are rebuilt per evaluation (seconds, deterministic), in a temporary
        # directory: nothing is left behind that could go stale against a re-tokenized corpus.
        names = _task_names(config, data_dir, Path(tmp)) if config.downstream else []
        manager = _task_manager(config, names, tmp) if names else None  # unknown names: before any model loads
        for k, point in todo:
            _log.info("%s: checkpoint %d of %d (step %d) loading", run_id, k, len(points), point.step)
            model = point.load(device, config.dtype)
            heldout = scores = None
            if "heldout" in config.tasks:
                counts = {}
                heldout = heldout_metrics(model, data_dir, seq_len=point.cfg.data.seq_len,
                                          batch_size=config.batch_size, max_batches=config.max_batches,
                                          dtype=config.dtype, device=device, counts=counts)
                _log.info("%s: step %d held-out loss %.4f over %d batches (%d sequences)", run_id, point.step,
                          heldout.get("loss", float("nan")), counts.get("batches", 0), counts.get("sequences", 0))
            if names and (point.step == newest.step or config.downstream_all_checkpoints):
                _log.info("%s: step %d downstream tasks %s", run_id, point.step, ", ".join(names))
                scores = _downstream(config, model, point.cfg, data_dir, names, manager, device)
            del model
            done[point.step] = _Parts.record(point, heldout, scores)
            if parts is not None:
                parts.write(point, done[point.step])
    return done, counts


def _write_results(config: EvaluateConfig, found: list[_Point], done: dict[int, dict], outputs: EvaluateOutputs,
                   run_id: str, data_dir: Path, counts: dict) -> EvaluateResult:
    """The store's rows and eval.json of the evaluated checkpoints ``found`` (their records in
    ``done``), oldest first: the store's rows stay in step order."""
    records = [done[p.step] for p in found]
    heldout_rows = [{"step": r["step"], "tokens": r["tokens"], **r["heldout"]} for r in records if r["heldout"]]
    down_rows = [{"step": r["step"], "tokens": r["tokens"],
                  **{f"{metric}.{task}": v for task, m in r["downstream"].items() for metric, v in m.items()}}
                 for r in records if r["downstream"]]
    if outputs.store:
        with open_store(outputs.store).run_writer(run_id) as writer:
            for row in heldout_rows:
                writer.log("heldout", row)
            for row in down_rows:
                writer.log("downstream", row)
            writer.update_attrs(evaluated=utc_now())
    newest = found[-1]
    base = {"step": newest.step, "tokens": newest.tokens}
    metrics = {k: v for k, v in (heldout_rows[-1] if heldout_rows else {}).items() if k not in base}
    doc = {"run_id": run_id, "data_dir": str(data_dir), **base, **metrics}
    scores = next((r["downstream"] for r in reversed(records) if r["downstream"]), None)
    if scores:
        doc["downstream"] = scores
    if config.all_checkpoints:
        doc["checkpoints"] = heldout_rows
        if config.downstream_all_checkpoints:
            doc["downstream_checkpoints"] = down_rows
    atomic_write(outputs.eval_json, json.dumps(doc, indent=2))
    down_row = {k: v for k, v in (down_rows[-1] if down_rows else {}).items() if k not in base}
    return EvaluateResult(run_id, newest.step, {**metrics, **down_row},
                          checkpoints=[r["step"] for r in heldout_rows or down_rows], heldout_counts=counts)


def parts_dir(eval_json: Path) -> Path:
    """Where an evaluation of every checkpoint keeps each one's evaluation as it is made (_Parts)."""
    return Path(eval_json).with_name(Path(eval_json).name + ".parts")


def checkpoints_kept(eval_json: Path) -> int:
    """Checkpoints whose evaluation is kept beside ``eval_json``: the progress of an evaluation of
    every checkpoint that a job cut short (workflow.launch)."""
    return len(list(parts_dir(eval_json).glob("step_*.json")))


class _Parts:
    """Each checkpoint's evaluation, kept as it is made beside the evaluation's output
    (``<eval json>.parts/step_<step>.json``), so that an evaluation of many checkpoints cut short
    (a job's walltime, a failure) goes on from where it stopped, and ranks that share the
    checkpoints hand theirs to the rank that writes the results. A part counts only for the same
    checkpoint (the run's uid, step and tokens seen) evaluated the same way (tasks, their
    settings, the data); any other is evaluated again and replaced."""

    POLL_S = 10.0  # how often rank 0 looks for the other ranks' parts

    def __init__(self, eval_json: Path, config: EvaluateConfig, data_dir: Path):
        self.dir = parts_dir(eval_json)
        self.how = {"tasks": list(config.tasks), "limit": config.limit, "n_items": config.n_items,
                    "dtype": config.dtype, "batch_size": config.batch_size, "max_batches": config.max_batches,
                    "downstream_all_checkpoints": config.downstream_all_checkpoints,
                    "task_dirs": list(config.task_dirs), "data": str(Path(data_dir).resolve())}

    @staticmethod
    def record(point: _Point, heldout: dict | None, scores: dict | None) -> dict:
        """One checkpoint's evaluation: its step, tokens seen, held-out metrics and downstream
        scores ({task: {metric: value}}; None: not evaluated)."""
        return {"step": point.step, "tokens": point.tokens, "heldout": heldout, "downstream": scores}

    def path(self, point: _Point) -> Path:
        return self.dir / f"step_{point.step:08d}.json"

    def _identity(self, point: _Point) -> dict:
        return {"uid": point.found.meta.get("uid"), "step": point.step, "tokens": point.tokens}

    def read(self, point: _Point) -> dict | None:
        """``point``'s record, where a part of this evaluation of it is kept; else None."""
        try:
            part = json.loads(self.path(point).read_text())
        except (OSError, ValueError):  # none yet, or unreadable: evaluated (again)
            return None
        if not isinstance(part, dict) or part.get("how") != self.how or part.get("checkpoint") != self._identity(point):
            return None
        return part.get("record")

    def write(self, point: _Point, record: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path(point), json.dumps({"how": self.how, "checkpoint": self._identity(point),
                                                   "record": record}))

    def wait_for(self, points: list[_Point], run_id: str) -> dict[int, dict]:
        """{step: record} of every one of ``points``, waiting for the parts other ranks make (a
        rank that fails ends the job: its launcher stops the others)."""
        import time

        said = -1
        while True:
            done = {p.step: r for p in points if (r := self.read(p)) is not None}
            if len(done) == len(points):
                return done
            if len(done) != said:
                _log.info("%s: %d of %d checkpoints evaluated; waiting for the other ranks' parts", run_id,
                          len(done), len(points))
                said = len(done)
            time.sleep(self.POLL_S)


def _run_sharded(config: EvaluateConfig, inputs: EvaluateInputs, outputs: EvaluateOutputs,
                 run_id: str) -> EvaluateResult:
    """Held-out metrics of each checkpoint on the model sharded over this job's ranks (module doc):
    the layout from the newest checkpoint's config, then each rank validates its share of the
    checkpoints (optimus_core.train.checkpoint.latest_valid) before reading its rows."""
    from optimus_core.parallel import init_distributed, shutdown

    from optimus_core.parallel.mesh import read_launch_env

    run_dir = Path(inputs.run_dir)
    meta = newest_meta(run_dir)
    if meta is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint (expected checkpoints/step_*/ with meta.json)")
    cfg = _eval_layout(from_dict(RunConfig, meta["config"]), read_launch_env().world_size)
    mesh = init_distributed(cfg.parallel, cfg.model.moe.n_experts if cfg.model.moe else None, config.device,
                            intel_extension=cfg.execution.intel_extension)
    rows = []
    try:
        found = _checkpoints(run_dir, config.all_checkpoints, (mesh.rank, mesh.world_size), mesh.all_max)
        data_dir = _checked_data(inputs.data_dir or found[-1].cfg.data.path, run_dir)
        counts: dict = {}
        for k, point in enumerate(found, 1):
            _log.info("%s: checkpoint %d of %d (step %d) loading", run_id, k, len(found), point.step)
            model = _load_sharded(point, mesh)
            counts = {}
            rows.append({"step": point.step, "tokens": point.tokens, **heldout_metrics(
                model, data_dir, seq_len=point.cfg.data.seq_len, batch_size=config.batch_size,
                max_batches=config.max_batches, dtype=config.dtype, device=mesh.device, counts=counts)})
            del model
    finally:
        shutdown(mesh)
    newest = rows[-1]
    metrics = {k: v for k, v in newest.items() if k not in ("step", "tokens")}
    if mesh.rank == 0:
        if outputs.store:
            with open_store(outputs.store).run_writer(run_id) as writer:
                for row in rows:
                    writer.log("heldout", row)
                writer.update_attrs(evaluated=utc_now())
        doc = {"run_id": run_id, "data_dir": str(data_dir), "step": newest["step"], "tokens": newest["tokens"],
               **metrics, "ranks": mesh.world_size}
        if config.all_checkpoints:
            doc["checkpoints"] = rows
        atomic_write(outputs.eval_json, json.dumps(doc, indent=2))
    return EvaluateResult(run_id, newest["step"], metrics, checkpoints=[r["step"] for r in rows],
                          heldout_counts=counts)


def _eval_layout(cfg: RunConfig, world: int) -> RunConfig:
    """The run's layout on ``world`` ranks: its EP degree, its shard block where it divides the
    world (else the whole world), no HF import (the checkpoint's weights replace it), and the
    execution defaults of this machine: how the run executed where it trained (an explicit
    Triton choice, its memory budget) need not hold here, and does not change its weights."""
    block = cfg.parallel.dp_shard if cfg.parallel.dp_shard and world % cfg.parallel.dp_shard == 0 else 0
    # no pipeline stages: every rank evaluates the whole model's share (a checkpoint loads across them)
    return cfg.replace(parallel=cfg.parallel.replace(dp_shard=block, pp=1, pp_split=()),
                       train=cfg.train.replace(init_from=None), execution=ExecutionConfig())


def _load_sharded(point: "_Point", mesh) -> Transformer:
    """``point``'s model sharded over ``mesh``, each rank reading its rows of the checkpoint."""
    from optimus_core.train import checkpoint as ckpt
    from optimus_core.train.build import build_model

    model = build_model(_eval_layout(point.cfg, mesh.world_size), mesh)
    ckpt.load_tensors_(point.found, ckpt.model_tensors(model, mesh), mesh.distributed)
    return model.eval()


@dataclass
class _Point:
    """One checkpoint to evaluate: its step, tokens seen and config; the model loaded on demand."""

    found: Checkpoint
    cfg: RunConfig

    @property
    def step(self) -> int:
        return self.found.step

    @property
    def tokens(self) -> int:
        return int(self.found.meta.get("tokens", self.step * self.cfg.tokens_per_step))

    def load(self, device: str = "cpu", dtype: str = "float32") -> Transformer:
        """The checkpoint's model in eval mode on ``device``; on a GPU with ``dtype`` bfloat16 its
        weights in bf16 (half the memory: a 20B model on one 64 GiB tile)."""
        model = Transformer(self.cfg.model)
        model.load_state_dict(self.found.load_model_state("cpu"))
        if device != "cpu":
            import torch

            model = model.to(device, dtype=torch.bfloat16 if dtype == "bfloat16" else None)
        return model.eval()


def _run_meta(run_dir: Path) -> dict:
    """``run_dir``'s meta.json, which names its run id; FileNotFoundError / ValueError naming the file."""
    meta_path = run_dir / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e}): not a readable run directory") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("run_id"), str):
        raise ValueError(f"{meta_path}: not a run's meta.json (no run_id)")
    return meta


def _checkpoints(run_dir: Path, every: bool, share: tuple[int, int] = (0, 1),
                 all_max=None) -> list[_Point]:
    """The newest valid checkpoint, or (``every``) each valid one, oldest first, the run's
    model-only checkpoints among them (a full one where both hold a step); several ranks
    (``share``, ``all_max``: optimus_core.train.checkpoint.latest_valid) each check their share."""
    collective = {"share": share, **({"all_max": all_max} if all_max else {})}
    if every:
        by_step = {c.step: c for c in valid_checkpoints(run_dir, kind=MODEL_ONLY, **collective)}
        by_step.update({c.step: c for c in valid_checkpoints(run_dir, **collective)})
        found = [by_step[step] for step in sorted(by_step)]
    else:
        newest = latest_valid(run_dir, **collective)
        found = [newest] if newest is not None else []
    if not found:
        raise FileNotFoundError(f"{run_dir}: no valid checkpoint (expected checkpoints/step_*/ with meta.json)")
    return [_Point(c, from_dict(RunConfig, c.meta["config"])) for c in found]


def _lm_eval(config: EvaluateConfig | None = None):
    try:
        from optimus_core.eval import docstring, lm, tasks
    except ImportError as e:
        other = [t for t in config.downstream if t not in BUILTIN_TASKS] if config else []
        if other:  # a typo of a built-in name, or an lm-eval task: neither is known here
            from optimus_core.config import ConfigError

            raise ConfigError(f"tasks = {other}: unknown; known: {', '.join(BUILTIN_TASKS)} (any other name is an "
                              f"lm-eval task, and lm-evaluation-harness is not installed here: {e})") from None
        raise ValueError(f"downstream tasks need lm-evaluation-harness ({e}); "
                         "install the eval extra: pip install -e '.[eval]'") from None
    return docstring, lm, tasks


def _checked_data(data_dir, run_dir: Path) -> Path:
    """``data_dir``, once it is known to be tokenized with the tokenizer the run trained with."""
    from optimus_core.data.identity import check_tokenizer, trained_tokenizer

    check_tokenizer(data_dir, trained_tokenizer(newest_meta(run_dir) or {}), f"run {run_dir}")
    return Path(data_dir)


def _task_names(config: EvaluateConfig, data_dir: Path, tmp: Path) -> list[str]:
    """The lm-eval task names of ``config.downstream``, the offline ones written into ``tmp``."""
    docstring, _, tasks = _lm_eval(config)
    names: list[str] = []
    for task in config.downstream:
        if task == "continuation":
            names += tasks.build_continuation_tasks(data_dir, tmp, n_items=config.n_items)
        elif task == "docstring":
            names.append(docstring.build_docstring_task(data_dir, tmp, n_items=config.n_items))
        else:
            names.append(task)
    return names


def _task_manager(config: EvaluateConfig, names: list[str], tmp):
    """lm-eval's index of ``names`` (the offline tasks written into ``tmp``, then the user's task
    dirs and lm-eval's registry), or an UnknownTaskError naming what is known: the built-in
    tasks and the user's task dirs (the temporary one is ours, never shown)."""
    _, _, tasks = _lm_eval(config)
    return tasks.task_manager(names, task_dirs=[tmp, *config.task_dirs], shown_dirs=config.task_dirs,
                              also_known=BUILTIN_TASKS)


def _downstream(config: EvaluateConfig, model, cfg, data_dir: Path, names: list[str], manager,
                device: str = "cpu") -> dict[str, dict]:
    """lm-eval scores ``{task: {metric: value, "n": docs}}`` of the downstream tasks."""
    _, lm, tasks = _lm_eval(config)
    adapter = lm.OptimusLM.for_model(model, cfg, data_dir, batch_size=config.batch_size, device=device)
    return tasks.run_lm_eval(adapter, names, limit=config.limit, manager=manager)
