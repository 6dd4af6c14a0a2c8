"""Checkpoints: one directory per step, checksummed, published atomically; the newest valid one is resumed.

    run_dir/checkpoints/step_000120/   __0_0.distcp [__0_1.distcp ... __1_0.distcp ...] .metadata
                                       state.pt meta.json manifests/rank_00000.json [rank_00001.json ...]
    run_dir/checkpoints/invalid/       step directories a resume found invalid, set aside
    run_dir/model_checkpoints/step_000500/   a model-only checkpoint (train.model_checkpoint_every):
                                       the model/ keys alone, the same files otherwise, never pruned

Every layout writes the same format (torch.distributed.checkpoint): each rank writes the rows it
holds (optimus_core.parallel.layout), nothing is gathered or copied on the device (the writers
read pinned host copies: optimus_core.train.staging), under keys that name whole parameters, so a
checkpoint of any world size, EP degree, optimizer mode or one process loads on any other:

    model/<parameter>               the whole parameter (its rows: expert weights as (E * rows, cols))
    model/<buffer>                  persistent buffers (the routers' balancing bias), replicated
    optim/<parameter>/exp_avg       AdamW's moments, laid out as the parameter
    optim/<parameter>/exp_avg_sq
    optim/<parameter>/step          the parameter's AdamW step count (replicated)
    rng/torch, rng/device           every rank's RNG states, one row per rank

``meta.json`` holds the resolved config, step, tokens seen, the data-loader position, the format,
the uid of the run that wrote it (a checkpoint of another run is never resumed: optimus_core.
train.loop), the world size, a save id and the sha256 of the shared files (.metadata, state.pt);
each rank's manifest, written by that rank, the sha256 of the files it wrote, with the save id
and step (a part copied in from another checkpoint, of this run or another, does not validate).
So a save hashes in parallel (each rank its own part, read back once), and a resume validates in
parallel: rank r of a world of W checks the shared files and the manifests i = r, r + W, ...
(each of the saving ranks' files once, whatever the two world sizes), and the ranks agree, with
one small all-reduce per candidate, on the newest step that every rank found valid
(``latest_valid``), or fall back together to an older one. ``state.pt`` (tensors and plain
values only: loaded with ``weights_only=True``) the loader position and what the loop needs to
decide as it would have uninterrupted (the loss guard's window, the batches skipped). A step
directory appears only complete (optimus_core.atomic.atomic_dir), so a crash mid-save leaves the
previous ones as they were; there is no pointer file to disagree with them. On load, a checkpoint
whose files are missing, fail their checksum or come from another save is skipped with a warning
naming the file and why, and the previous one is used.

This is the one format read: a checkpoint of another (``format`` and ``version`` in meta.json;
``optimus``, the revision that wrote it) is refused in one line that names them
(CheckpointFormatError), never skipped or set aside as if it were damaged.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
import shutil
import sys
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..atomic import atomic_dir, atomic_write
from ..config import RunConfig, from_dict
from ..provenance import git_revision
from ..model.transformer import Transformer
from .disk_space import bytes_to_write, space_errors_named
from .staging import HostStaging

STEP_DIR = re.compile(r"^step_(\d{6,})$")
FORMAT, VERSION = "dcp", 3  # meta.json's "format" and "version": what save_checkpoint writes and reads
MANIFESTS = "manifests"
INVALID = "invalid"  # checkpoints/invalid/: step directories a resume found invalid (set_aside)
REQUIRED_FILES = (".metadata", "state.pt")
MODEL, OPTIM, RNG = "model/", "optim/", "rng/"  # key prefixes (module doc)
MOMENTS = ("exp_avg", "exp_avg_sq")


WRITE_THREADS = 8  # DCP writer threads (and so files) per rank, at most
BYTES_PER_FILE = 2**30  # ... and at least this much a file, so a small part is one file, not many
HASH_THREADS = 8  # files hashed at once (hashlib and file reads release the GIL)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _sha256_files(paths: list[Path]) -> dict[str, str]:
    """The sha256 of each of ``paths``, by file name, several files at a time."""
    import concurrent.futures

    if len(paths) <= 1:
        return {p.name: _sha256(p) for p in paths}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(paths))) as pool:
        return dict(zip((p.name for p in paths), pool.map(_sha256, paths)))


@functools.lru_cache(maxsize=1)
def _writer() -> str:
    """meta.json's "optimus": the revision of the Optimus that writes a checkpoint."""
    return f"Optimus {git_revision()}"


class CheckpointFormatError(ValueError):
    """A checkpoint of another format than this Optimus writes: one line naming what wrote it."""


def check_format(path: Path, meta: dict) -> None:
    """CheckpointFormatError unless ``meta`` (``path``'s meta.json) is of FORMAT and VERSION."""
    found = (meta.get("format", "torch"), meta.get("version", 1))
    if found == (FORMAT, VERSION):
        return
    wrote = meta.get("optimus") or "an earlier Optimus"
    raise CheckpointFormatError(f"{path}: a checkpoint of format {found[0]!r} version {found[1]}, written by "
                                f"{wrote}; this Optimus reads format {FORMAT!r} version {VERSION} only: resume, "
                                f"evaluate or export it with the Optimus that wrote it")


@dataclass
class Checkpoint:
    path: Path
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def load_model_state(self, map_location="cpu") -> dict:
        """The whole (unsharded) model state dict, read by this process alone."""
        from .checkpoint_reader import read_full

        return {k[len(MODEL):]: v.to(map_location) for k, v in read_full(self.path, MODEL).items()}

    def load_state(self) -> dict:
        return torch.load(self.path / "state.pt", map_location="cpu", weights_only=True)


FULL, MODEL_ONLY = "checkpoints", "model_checkpoints"  # a run directory's two kinds of checkpoint


def checkpoints_dir(run_dir: Path, kind: str = FULL) -> Path:
    """Where a run's checkpoints of ``kind`` live: FULL (everything a resume needs, pruned) or
    MODEL_ONLY (the weights alone, for evaluation, all kept)."""
    return Path(run_dir) / kind


def _sweep(root: Path) -> None:
    """Remove step directories left half-written by a killed writer (never published, so never
    read); called before a save, when this run's previous write is finished."""
    for tmp in root.glob(".step_*.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _prune(run_dir: Path, keep: int, keep_every: int) -> None:
    """Keep the newest ``keep`` and, for the evaluation curves of a long run, every step that is
    a multiple of ``keep_every``."""
    for old in list_step_dirs(run_dir)[:-keep]:
        if not (keep_every and int(STEP_DIR.match(old.name).group(1)) % keep_every == 0):
            shutil.rmtree(old, ignore_errors=True)


def set_aside(run_dir: Path, newer_than: int) -> list[Path]:
    """Move the step directories newer than step ``newer_than`` (-1: all) into
    ``checkpoints/invalid/``, where no resume, evaluation or pruning looks, and return their new
    paths. For the checkpoints a resume found invalid: kept (a read error may have been
    transient), never counted among the ones pruning keeps, so it cannot delete the newest valid
    checkpoint in favour of a corrupt one."""
    moved = []
    for path in list_step_dirs(run_dir):
        if int(STEP_DIR.match(path.name).group(1)) > newer_than:
            aside = checkpoints_dir(run_dir) / INVALID / path.name
            aside.parent.mkdir(exist_ok=True)
            copy = 1
            while aside.exists():  # this step was set aside before too: both are kept
                aside, copy = aside.with_name(f"{path.name}.{copy}"), copy + 1
            path.rename(aside)
            moved.append(aside)
    return moved


def list_step_dirs(run_dir: Path, kind: str = FULL) -> list[Path]:
    """Step directories, oldest first (temporary and unrelated entries ignored)."""
    root = checkpoints_dir(run_dir, kind)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(dirs, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def manifest_name(rank: int) -> str:
    return f"{MANIFESTS}/rank_{rank:05d}.json"


def _check_files(path: Path, expected: dict[str, str], listed_in: str) -> None:
    for name in sorted(expected):
        if not (path / name).is_file():
            raise ValueError(f"{path}: {name} is missing (listed in {listed_in})")
    found = _sha256_files([path / name for name in sorted(expected)])
    for name, digest in sorted(expected.items()):
        if found[name] != digest:
            raise ValueError(f"{path}: {name} fails its sha256 checksum (listed in {listed_in})")


def validate(path: Path, share: tuple[int, int] = (0, 1)) -> dict:
    """The checkpoint's meta if the shared files and the manifests of ``share`` = (rank, world)
    with their files are present and match their checksums; else ValueError naming the file and
    why. The default (0, 1) checks everything: a single reader's share."""
    rank, world = share
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{path}: no meta.json (incomplete checkpoint)")
    meta = json.loads(meta_path.read_text())
    check_format(path, meta)
    listed = meta.get("files", {})
    missing = [name for name in REQUIRED_FILES if name not in listed]
    if missing:
        raise ValueError(f"{path}: meta.json lists no checksum for {', '.join(missing)}")
    _check_files(path, listed, "meta.json")
    for i in range(rank, int(meta["manifests"]), world):
        name = manifest_name(i)
        try:
            manifest = json.loads((path / name).read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: {name} is missing (meta.json lists {meta['manifests']} manifests)") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: {name} is not valid JSON ({e})") from None
        if (manifest.get("save_id"), manifest.get("step")) != (meta.get("save_id"), meta["step"]):
            raise ValueError(f"{path}: {name} is from another checkpoint (save {manifest.get('save_id')!r} of "
                             f"step {manifest.get('step')}; this one is save {meta.get('save_id')!r} of step "
                             f"{meta['step']})")
        _check_files(path, manifest["files"], name)
    return meta


def _no_collective(values: list[float]) -> list[float]:
    return values


def latest_valid(run_dir: Path, share: tuple[int, int] = (0, 1),
                 all_max: Callable[[list[float]], list[float]] = _no_collective, kind: str = FULL) -> Checkpoint | None:
    """The newest checkpoint that validates; None if there is none. Step directories are
    published whole; checksums catch the rest.

    Several ranks (a collective then: every rank calls it): ``share`` is (rank, world) and
    ``all_max`` the element-wise maximum of a list of numbers over the ranks. Each rank checks its
    share of each candidate (``validate``); a candidate is taken only if every rank found its
    share valid, else all fall back to the next older one together. The candidate each round is
    the newest step any rank sees, so a rank that lists the directory differently still agrees."""
    below = float("inf")
    while True:
        mine = [step for step in _steps(run_dir, kind) if step < below]
        step = int(all_max([float(max(mine, default=-1))])[0])
        if step < 0:
            return None
        found = _agreed(checkpoints_dir(run_dir, kind) / f"step_{step:06d}", share, all_max)
        if found is not None:
            return found
        below = step


def valid_checkpoints(run_dir: Path, share: tuple[int, int] = (0, 1),
                      all_max: Callable[[list[float]], list[float]] = _no_collective,
                      kind: str = FULL) -> list[Checkpoint]:
    """Every checkpoint of ``kind`` that validates, oldest first; ``share`` and ``all_max`` as for
    ``latest_valid`` (every rank then gets the same list)."""
    steps = _steps(run_dir, kind)
    most = all_max([float(len(steps))])[0]
    if all_max([float(len(steps) != most)])[0]:  # every rank raises, or none
        raise ValueError(f"{checkpoints_dir(run_dir, kind)}: the ranks see different step directories "
                         f"({len(steps)} here, {most:.0f} on another rank)")
    found = [_agreed(checkpoints_dir(run_dir, kind) / f"step_{step:06d}", share, all_max) for step in steps]
    return [c for c in found if c is not None]


def _steps(run_dir: Path, kind: str = FULL) -> list[int]:
    return [int(STEP_DIR.match(p.name).group(1)) for p in list_step_dirs(run_dir, kind)]


def _agreed(path: Path, share: tuple[int, int], all_max) -> Checkpoint | None:
    """``path``'s checkpoint if every rank found its share valid (one all-reduce), else None;
    a rank whose share is invalid warns with the file and why, rank 0 that another rank did."""
    rank, world = share
    try:
        found, why = Checkpoint(path, validate(path, share)), None
    except CheckpointFormatError:  # not damaged: another Optimus's (every rank reads the same meta.json)
        raise
    except (ValueError, json.JSONDecodeError, OSError) as e:
        found, why = None, e
    if why is not None:
        warnings.warn(f"skipping checkpoint{f' (rank {rank})' if world > 1 else ''}: {why}", stacklevel=3)
    if not all_max([float(found is None)])[0]:
        return found
    if found is not None and rank == 0:  # valid here, not on some other rank (which said why)
        warnings.warn(f"skipping checkpoint {path}: another rank found its part invalid", stacklevel=3)
    return None


def newest_meta(run_dir: Path) -> dict | None:
    """The meta.json of the newest step directory that has one, unchecked: a hint for planning
    (its world size, its config) that reads no checkpoint data."""
    for path in reversed(list_step_dirs(run_dir)):
        try:
            return json.loads((path / "meta.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return None


# ----------------------------------------------------------------------------- what is saved

def _adamw_state(optimizer, p: torch.Tensor) -> dict:
    """``p``'s AdamW state in ``optimizer`` (torch's or TritonAdamW, or one wrapping either as
    ``inner``), made (zeros, step 0) where the optimizer has not made it yet, so that a load can
    fill it before the first update."""
    from ..parallel.layout import local_tensor

    inner = getattr(optimizer, "inner", optimizer)
    state = inner.state[p]
    if not state:
        if hasattr(inner, "_state"):  # TritonAdamW: its own layout (moments of the local share)
            return inner._state(p)
        group = next(g for g in inner.param_groups if any(q is p for q in g["params"]))
        on_device = bool(group.get("fused") or group.get("capturable"))
        state["step"] = torch.zeros((), dtype=torch.float32, device=local_tensor(p).device if on_device else "cpu")
        for moment in MOMENTS:
            state[moment] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def training_tensors(model, optimizer, mesh) -> dict:
    """This rank's part of the checkpoint's tensors (module doc): views of the parameters, the
    moments and the buffers (nothing copied), DTensors of the whole shapes where sharded. The
    same dict, filled by ``load_tensors_``, loads them in place."""
    from ..parallel.layout import local_tensor, shares

    out = model_tensors(model, mesh)
    by_name = dict(model.named_parameters())
    for name, share in shares(model, mesh.stage).items():
        state = _adamw_state(optimizer, by_name[name])
        for moment in MOMENTS:
            out[f"{OPTIM}{name}/{moment}"] = share.like(local_tensor(state[moment])).dtensor()
        step = state["step"]
        if not torch.is_tensor(step):  # a plain number: made a tensor the load can fill
            state["step"] = step = torch.tensor(float(step), dtype=torch.float32)
        out[f"{OPTIM}{name}/step"] = step
    out.update(_rng_tensors(mesh))
    return out


def model_tensors(model, mesh) -> dict:
    """The model's part of ``training_tensors`` (its parameters' shares and its buffers): what
    an evaluation of a sharded model loads with ``load_tensors_``."""
    from ..parallel.layout import shares

    out = {MODEL + name: share.dtensor() for name, share in shares(model, mesh.stage).items()}
    for name, buf in model.named_buffers(remove_duplicate=True):
        if _persistent(model, name):
            out[MODEL + name] = buf
    return out


def _persistent(model, name: str) -> bool:
    module_name, _, buf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return buf not in module._non_persistent_buffers_set


def _rng_tensors(mesh) -> dict:
    """Every rank's CPU (and device) RNG state: one row per rank of a (world, bytes) tensor."""
    from ..parallel.layout import Share

    states = {"torch": torch.get_rng_state()}
    device = mesh.device
    if device.type in ("cuda", "xpu"):
        states["device"] = getattr(torch, device.type).get_rng_state(device)
    out = {}
    for key, state in states.items():
        row = state.reshape(1, -1).clone()
        if mesh.distributed:
            from torch.distributed.tensor import Shard

            world = mesh.device_meshes()["world"]
            share = Share(key, row, mesh.rank, (mesh.world_size, row.shape[1]), world, (Shard(0),))
            out[RNG + key] = share.dtensor()
        else:
            out[RNG + key] = row
    return out


def restore_rng(tensors: dict, mesh) -> None:
    """Set this rank's RNG states from filled ``training_tensors`` (``load_tensors_``)."""
    from ..parallel.layout import local_tensor

    if RNG + "torch" in tensors:
        torch.set_rng_state(local_tensor(tensors[RNG + "torch"]).reshape(-1).clone())
    if RNG + "device" in tensors and mesh.device.type in ("cuda", "xpu"):
        getattr(torch, mesh.device.type).set_rng_state(local_tensor(tensors[RNG + "device"]).reshape(-1).clone(),
                                                        mesh.device)


# ----------------------------------------------------------------------------- writing

class PendingSave:
    """A checkpoint still being written in the background. ``wait()`` (every rank) finishes it:
    rank 0 publishes the step directory; until then the run's newest valid
    checkpoint is the previous one. Returns the published path on rank 0."""

    def __init__(self, finish):
        self._finish, self._done, self.path = finish, False, None

    def wait(self) -> Path | None:
        if not self._done:
            self._done = True
            self.path = self._finish()
        return self.path


@contextlib.contextmanager
def finished_on_exit(finish):
    """Call ``finish()`` (say, publish a background checkpoint) when the block ends, however it
    ends. When the block raised, an error of ``finish`` is only warned about: the block's own
    error is the one to report."""
    try:
        yield
    except BaseException:
        try:
            finish()
        except BaseException as e:
            warnings.warn(f"the background checkpoint write failed as well: {e!r}", stacklevel=3)
        raise
    finish()


def checkpoint_group(mesh, timeout=None):
    """A gloo group for background checkpoint writes (train.async_checkpoint), made once
    (collective): DCP's planning runs its collectives there (on the host), and background writes
    must not interleave with the training's on the default group. It spans the world, and a gloo
    group connects every rank to every other: foreground writes use the default group instead.
    ``timeout``: a timedelta."""
    import torch.distributed as dist

    if getattr(mesh, "_checkpoint_group", None) is None:
        mesh._checkpoint_group = dist.new_group(backend="gloo", timeout=timeout)
    return mesh._checkpoint_group


def write_rank_manifest(tmp: Path, rank: int, save_id: str, step: int, written: dict | None = None) -> None:
    """This rank's manifest: the sha256 of the files it wrote (DCP names them ``__<rank>_<n>``),
    and ``written``: when it wrote them (WaveWriter.written: its wave, the wall-clock window)."""
    files = _sha256_files(sorted(tmp.glob(f"__{rank}_*.distcp")))
    (tmp / MANIFESTS).mkdir(exist_ok=True)
    atomic_write(tmp / manifest_name(rank), json.dumps({"save_id": save_id, "step": step, "rank": rank,
                                                        "files": files, **(written or {})}, indent=1, sort_keys=True))


def _wave_writer(path: Path, threads: int, wave: tuple[int, int], process_group, distributed: bool):
    """DCP's file writer, its writes in waves: rank r writes in wave ``wave[0]`` of ``wave[1]``,
    each wave after the one before has finished (a barrier over ``process_group`` between waves;
    every rank passes them all). ``written``: this rank's wave and wall-clock write window."""
    import time

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.futures import Future

    class WaveWriter(dcp.FileSystemWriter):
        written: dict = {}

        def write_data(self, plan, planner):
            mine, waves = wave
            results = None
            for w in range(waves):
                if w == mine:
                    start = time.time()
                    results = super().write_data(plan, planner).wait()
                    self.written = {"wave": mine, "waves": waves, "write_window": [start, time.time()]}
                if distributed and waves > 1:
                    dist.barrier(group=process_group)
            done = Future()
            done.set_result(results)
            return done

    return WaveWriter(path, thread_count=threads)


def concurrent_writers(path: Path) -> int:
    """The most ranks that wrote a checkpoint's files at once, from its manifests' write windows
    (0 where none records one)."""
    events = []
    for manifest in sorted((Path(path) / MANIFESTS).glob("rank_*.json")):
        window = json.loads(manifest.read_text()).get("write_window")
        if window:
            events += [(window[0], 1), (window[1], -1)]
    peak = now = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start at the same instant
        now += change
        peak = max(peak, now)
    return peak


def save_checkpoint(run_dir: Path, step: int, *, tensors: dict, state: dict, meta: dict, rank: int = 0,
                    distributed: bool = False, keep: int = 2, keep_every: int = 0, process_group=None,
                    asynchronous: bool = False, all_max: Callable[[list[float]], list[float]] | None = None,
                    staging: HostStaging | None = None, threads: int | None = None,
                    kind: str = FULL, wave: tuple[int, int] = (0, 1)) -> Path | None | PendingSave:
    """Write checkpoint ``step`` (collective when ``distributed``: every rank calls it, with
    ``all_max`` as for ``latest_valid``, e.g. ``Mesh.all_max``). Every rank writes its part of
    ``tensors`` (``training_tensors``) into one step directory and its manifest; once every
    rank's is written, rank 0 adds ``state.pt`` and ``meta.json``, publishes the directory whole
    and prunes. Returns the path on rank 0, None elsewhere. The tensors are written from host
    copies made by ``staging`` (optimus_core.train.staging; pinned, kept for the next save),
    by ``threads`` writers into as many files (default: WRITE_THREADS, fewer where the part has
    less than BYTES_PER_FILE for each); without a staging, a foreground write copies device
    tensors as it goes. With ``asynchronous`` the host copies are made now (by a staging made
    for the call where none is given) and written in the background (distributed: planned over
    ``process_group``, see checkpoint_group), and a PendingSave is returned: finish it before
    the next save with the same ``staging``. A rank that fails to write stops every rank (with
    its error there, a RuntimeError naming the step elsewhere) and nothing is published.
    ``kind``: FULL (pruned to ``keep`` and ``keep_every``) or MODEL_ONLY (``tensors`` the model's
    alone, ``model_tensors``; every one kept). ``wave`` = (w, W): this rank writes its files in
    wave w of W, after the waves before it (``_wave_writer``; its manifest records when)."""
    import torch.distributed as dist

    if distributed and all_max is None:
        raise ValueError("save_checkpoint(distributed=True) needs all_max (say, Mesh.all_max)")
    all_max = all_max or _no_collective
    world = dist.get_world_size() if distributed else 1
    root = checkpoints_dir(run_dir, kind)
    final = root / f"step_{step:06d}"
    stack = contextlib.ExitStack()
    tmp = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _sweep(root)
        tmp = stack.enter_context(atomic_dir(final))
    where = [str(tmp) if tmp is not None else None, uuid.uuid4().hex]
    if distributed:
        dist.broadcast_object_list(where, src=0)
    tmp, save_id = Path(where[0]), where[1]

    def write_manifest() -> BaseException | None:
        """This rank's manifest; its failure is returned, for ``publish`` to stop every rank."""
        try:
            write_rank_manifest(tmp, rank, save_id, step, writer.written)
        except OSError as e:
            return e
        return None

    def publish(error: BaseException | None) -> Path | None:
        with stack, space_errors_named(final, step):  # on an exception the temporary directory goes
            if all_max([float(error is not None)])[0]:
                if error is not None:
                    raise error
                raise RuntimeError(f"checkpoint step {step}: another rank failed to write its part "
                                   f"(its own error says why); nothing was published")
            if rank == 0:
                torch.save(state, tmp / "state.pt")
                files = {name: _sha256(tmp / name) for name in (".metadata", "state.pt")}
                full_meta = dict(meta, step=step, format=FORMAT, version=VERSION, optimus=_writer(), save_id=save_id,
                                 manifests=world, files=files)
                (tmp / "meta.json").write_text(json.dumps(full_meta, indent=2, sort_keys=True))
        if rank != 0:
            return None
        if kind == FULL:
            _prune(run_dir, keep, keep_every)
        return final

    threads = threads or max(1, min(WRITE_THREADS, bytes_to_write(tensors) // BYTES_PER_FILE))
    writer = _wave_writer(tmp, threads, wave, process_group, distributed)
    try:
        if asynchronous or staging is not None:
            tensors = (staging or HostStaging()).stage(tensors, snapshot=asynchronous)
        if asynchronous:
            future = _in_thread(lambda: _dcp_save(tensors, writer, process_group, distributed), f"checkpoint-{step}")
        else:
            with space_errors_named(final, step):
                _dcp_save(tensors, writer, process_group, distributed)
    except BaseException:
        stack.__exit__(*sys.exc_info())
        raise
    if not asynchronous:
        return publish(write_manifest())
    # The manifest's hashing reads back what was written: in the background too, after the write.
    def write_then_manifest() -> BaseException | None:
        future.result()
        return write_manifest()

    background = _in_thread(write_then_manifest, f"checkpoint-{step}-manifest")

    def finish() -> Path | None:
        try:
            error = background.result()
        except Exception as e:  # noqa: BLE001  (the write failed here: publish stops every rank with it)
            error = e
        return publish(error)

    return PendingSave(finish)


def _in_thread(fn, name: str):
    """``fn()`` in a background thread, as a Future."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def _dcp_save(tensors: dict, writer, process_group, distributed: bool) -> None:
    """dcp.save of this rank's ``tensors`` (planned over ``process_group`` when distributed)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(tensors, storage_writer=writer, process_group=process_group, no_dist=not distributed)


# ----------------------------------------------------------------------------- reading

def load_tensors_(found: Checkpoint, tensors: dict, distributed: bool) -> None:
    """Fill ``tensors`` (``training_tensors`` of this run's layout) in place from ``found``, each
    rank reading the rows it holds (collective when ``distributed``). A checkpoint of another
    world size has no RNG rows for this layout: those are left as they are."""
    import torch.distributed.checkpoint as dcp

    from .checkpoint_reader import ParallelFileReader

    if found.meta.get("world_size", 1) != _world_of(tensors):
        tensors = {k: v for k, v in tensors.items() if not k.startswith(RNG)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(tensors, storage_reader=ParallelFileReader(found.path), no_dist=not distributed)


def _world_of(tensors: dict) -> int:
    rng = tensors.get(RNG + "torch")
    return 1 if rng is None else int(rng.shape[0])


def load_model(run_dir: str | Path, map_location: str = "cpu", *, with_step: bool = False):
    """The newest valid checkpoint of ``run_dir`` as ``(model, RunConfig)``, in eval mode.

    ``with_step=True`` returns ``(model, RunConfig, step)``: the step the checkpoint was saved at.
    """
    found = latest_valid(Path(run_dir))
    if found is None:
        raise FileNotFoundError(f"{run_dir}: no valid checkpoint (expected checkpoints/step_*/ with meta.json)")
    cfg = from_dict(RunConfig, found.meta["config"])
    model = Transformer(cfg.model)
    model.load_state_dict(found.load_model_state(map_location))
    return (model.eval(), cfg, found.step) if with_step else (model.eval(), cfg)
