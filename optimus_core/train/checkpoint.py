"""Checkpoints: one directory per step, checksummed, published atomically, ``latest`` written last.

    run_dir/checkpoints/step_000120/   model.pt  optim.pt  state.pt  meta.json           (1 process)
    run_dir/checkpoints/step_000120/   __0_0.distcp __1_0.distcp .metadata state.pt meta.json   (N ranks)
    run_dir/checkpoints/latest         "step_000120"

``meta.json`` holds the resolved config, step, tokens seen, the data-loader position, the format
("torch" or "dcp") and the sha256 of every file; ``state.pt`` the loader position and the RNG
states of every rank. A step directory appears only complete (optimus_core.atomic.atomic_dir),
and ``latest`` moves only after it, so a crash mid-save never leaves a ``latest`` pointing at a
partial checkpoint. On load, a checkpoint whose files are missing or fail their checksum is
skipped with a warning and the previous one is used.

A run of several ranks writes its checkpoint sharded with torch.distributed.checkpoint: every
rank writes its own shards at once (expert weights split over EP, optimizer moments split as the
sharded optimizer holds them), nothing is gathered to one rank. Keys are layout-free (``model/<
parameter>``: the full logical tensor; ``optim/...``: see ShardedAdamW.state_dict), so a
checkpoint of W ranks with ep e loads on W' ranks with ep e': each rank reads the pieces it needs.
``Checkpoint.load_model_state`` reads the full model of either format on one process (export,
evaluation).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import atomic_dir, atomic_write

STEP_DIR = re.compile(r"^step_(\d{6,})$")
FILES = ("model.pt", "optim.pt", "state.pt")  # format "torch"
SHARDED_FILES = (".metadata", "state.pt")  # format "dcp", besides one or more *.distcp
MODEL, OPTIM = "model/", "optim/"  # key prefixes of a sharded checkpoint


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Checkpoint:
    path: Path
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def sharded(self) -> bool:
        return self.meta.get("format", "torch") == "dcp"

    def load_model_state(self, map_location="cpu") -> dict:
        """The full (unsharded) model state dict, whatever the format, read by this process alone."""
        if self.sharded:
            return {k[len(MODEL):]: v.to(map_location) for k, v in read_full(self.path, MODEL).items()}
        return torch.load(self.path / "model.pt", map_location=map_location, weights_only=True)

    def load_optim_state(self, map_location="cpu") -> dict:
        if self.sharded:
            raise ValueError(f"{self.path} is a sharded checkpoint: its optimizer state loads through "
                             f"load_sharded() on the ranks of a distributed run")
        return torch.load(self.path / "optim.pt", map_location=map_location, weights_only=True)

    def load_state(self) -> dict:
        return torch.load(self.path / "state.pt", map_location="cpu", weights_only=False)


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, *, model_state: dict, optim_state: dict, state: dict,
                    meta: dict, keep: int = 2, keep_every: int = 0) -> Path:
    """Write checkpoint ``step`` and point ``latest`` at it; keep the newest ``keep`` and, for
    the evaluation curves of a long run, every step that is a multiple of ``keep_every``."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    _sweep(root)
    final = root / f"step_{step:06d}"
    with atomic_dir(final) as tmp:
        torch.save(model_state, tmp / "model.pt")
        torch.save(optim_state, tmp / "optim.pt")
        torch.save(state, tmp / "state.pt")
        full_meta = dict(meta, step=step, files={name: _sha256(tmp / name) for name in FILES})
        (tmp / "meta.json").write_text(json.dumps(full_meta, indent=2, sort_keys=True))
    atomic_write(root / "latest", final.name)
    _prune(run_dir, keep, keep_every)
    return final


def _sweep(root: Path) -> None:
    """Remove step directories left half-written by a killed writer (never published, so never
    read); called before a save, when this run's previous write is finished."""
    for tmp in root.glob(".step_*.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _prune(run_dir: Path, keep: int, keep_every: int) -> None:
    for old in list_step_dirs(run_dir)[:-keep]:
        if not (keep_every and int(STEP_DIR.match(old.name).group(1)) % keep_every == 0):
            shutil.rmtree(old, ignore_errors=True)


def list_step_dirs(run_dir: Path) -> list[Path]:
    """Step directories, oldest first (temporary and unrelated entries ignored)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(dirs, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def validate(path: Path) -> dict:
    """The checkpoint's meta if every file is present and matches its checksum; else raise."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{path}: no meta.json (incomplete checkpoint)")
    meta = json.loads(meta_path.read_text())
    listed = meta.get("files", {})
    required = SHARDED_FILES if meta.get("format", "torch") == "dcp" else FILES
    for name in sorted(set(required) | set(listed)):
        expected = listed.get(name)
        if not (path / name).is_file():
            raise ValueError(f"{path}: {name} is missing")
        if expected is None or _sha256(path / name) != expected:
            raise ValueError(f"{path}: {name} fails its sha256 checksum")
    return meta


def latest_valid(run_dir: Path) -> Checkpoint | None:
    """The newest checkpoint that validates; None if there is none.

    Step directories are published whole, so a complete one newer than ``latest`` (a crash
    between the two renames) is as good as the one ``latest`` names; checksums catch the rest.
    """
    for path in reversed(list_step_dirs(run_dir)):
        try:
            return Checkpoint(path, validate(path))
        except (ValueError, json.JSONDecodeError) as e:
            warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
    return None


# ----------------------------------------------------------------------------- sharded (several ranks)

def dcp_meshes(mesh):
    """(world, grid) DeviceMeshes of a distributed Mesh, made once (collective, every rank):
    ``world`` 1-D over all ranks; ``grid`` (expert-dp, ep), whose rows are the EP groups."""
    from torch.distributed.device_mesh import DeviceMesh

    cached = getattr(mesh, "_dcp_meshes", None)
    if cached is None:
        ranks = torch.arange(mesh.world_size)
        cached = (DeviceMesh(mesh.device.type, ranks),
                  DeviceMesh(mesh.device.type, ranks.reshape(mesh.world_size // mesh.ep, mesh.ep),
                             mesh_dim_names=("expert_dp", "ep")))
        mesh._dcp_meshes = cached
    return cached


def sharded_model_state(model, mesh) -> dict:
    """``model/<name>`` -> this rank's part: expert weights as DTensors of their full (n_experts,
    ...) shape split over EP and replicated over expert-dp, everything else as plain (replicated)
    tensors. Copies, so it can be filled by ``load_sharded`` and then applied."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ..parallel import expert_parallel

    _, grid = dcp_meshes(mesh)
    experts = expert_parallel.expert_parameter_names(model)
    out = {}
    for name, value in model.state_dict().items():
        value = value.detach().clone()
        if name in experts:
            shape = (value.shape[0] * mesh.ep, *value.shape[1:])
            value = DTensor.from_local(value, grid, [Replicate(), Shard(0)], run_check=False, shape=torch.Size(shape),
                                       stride=torch.empty(shape, device="meta").stride())
        out[MODEL + name] = value
    return out


def local_model_state(sharded: dict) -> dict:
    """The model part of a sharded state dict as this rank's ``model.load_state_dict`` input."""
    return {k[len(MODEL):]: (v.to_local() if hasattr(v, "to_local") else v)
            for k, v in sharded.items() if k.startswith(MODEL)}


class PendingSave:
    """A checkpoint still being written in the background. ``wait()`` (every rank) finishes it:
    rank 0 publishes the step directory and moves ``latest``; until then the run's newest valid
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
    """A gloo group for background checkpoint writes, made once (collective): their collectives
    must not interleave with the training's on the default group. ``timeout``: a timedelta."""
    import torch.distributed as dist

    if getattr(mesh, "_checkpoint_group", None) is None:
        mesh._checkpoint_group = dist.new_group(backend="gloo", timeout=timeout)
    return mesh._checkpoint_group


def _cpu_copy(tree):
    """The state (nested dicts / lists of tensors) copied to the CPU: what a background write
    may read while training changes the originals."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _cpu_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cpu_copy(v) for v in tree)
    return tree


def save_checkpoint_async(run_dir: Path, step: int, *, model_state: dict, optim_state: dict, state: dict,
                          meta: dict, keep: int = 2, keep_every: int = 0) -> PendingSave:
    """``save_checkpoint`` in a background thread, from a CPU copy taken now."""
    import threading

    staged = _cpu_copy({"model_state": model_state, "optim_state": optim_state, "state": state})
    outcome: dict = {}

    def write():
        try:
            outcome["path"] = save_checkpoint(run_dir, step, meta=meta, keep=keep, keep_every=keep_every, **staged)
        except BaseException as e:  # re-raised by wait(), in the training thread
            outcome["error"] = e

    thread = threading.Thread(target=write, name=f"checkpoint-{step}", daemon=False)
    thread.start()

    def finish():
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["path"]

    return PendingSave(finish)


def save_sharded_checkpoint(run_dir: Path, step: int, *, sharded_state: dict, state: dict, meta: dict, rank: int,
                            keep: int = 2, keep_every: int = 0, process_group=None,
                            asynchronous: bool = False) -> Path | None | PendingSave:
    """Collective: every rank writes its shards of ``sharded_state`` into one step directory;
    rank 0 adds ``state.pt`` and ``meta.json`` (checksums of every file), publishes the directory
    whole, then moves ``latest``. Returns the path on rank 0, None elsewhere; with
    ``asynchronous`` the shards are copied to the CPU now, written in the background (over
    ``process_group``: see checkpoint_group) and a PendingSave is returned."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    root = checkpoints_dir(run_dir)
    final = root / f"step_{step:06d}"
    stack = contextlib.ExitStack()
    tmp = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _sweep(root)
        tmp = stack.enter_context(atomic_dir(final))
    where = [str(tmp) if tmp is not None else None]
    dist.broadcast_object_list(where, src=0)
    tmp = Path(where[0])

    def publish() -> Path | None:
        with stack:  # on an exception the temporary directory goes, the previous checkpoints stay
            if rank == 0:
                torch.save(state, tmp / "state.pt")
                files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
                full_meta = dict(meta, step=step, format="dcp", files=files)
                (tmp / "meta.json").write_text(json.dumps(full_meta, indent=2, sort_keys=True))
        if rank != 0:
            return None
        atomic_write(root / "latest", final.name)
        _prune(run_dir, keep, keep_every)
        return final

    writer = dcp.FileSystemWriter(tmp)
    try:
        if asynchronous:
            future = dcp.async_save(sharded_state, storage_writer=writer, process_group=process_group)
            future = getattr(future, "upload_completion", future)  # an AsyncSaveResponse or a Future
        else:
            dcp.save(sharded_state, storage_writer=writer, process_group=process_group)
    except BaseException:
        stack.__exit__(*sys.exc_info())
        raise
    if not asynchronous:
        return publish()

    def finish() -> Path | None:
        try:
            future.result()
        except BaseException:
            stack.__exit__(*sys.exc_info())
            raise
        return publish()

    return PendingSave(finish)


def load_sharded(path: Path, target: dict) -> None:
    """Fill ``target`` (a sharded state dict of this run's layout) in place from ``path``, each
    rank reading the pieces it holds (collective when distributed)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(target, storage_reader=dcp.FileSystemReader(path))


def read_full(path: Path, prefix: str) -> dict:
    """Every tensor of a sharded checkpoint whose key starts with ``prefix``, whole, on this
    process alone (no collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    full = {k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(full, storage_reader=reader, no_dist=True)
    return full


def load_plain_optimizer(path: Path, model, optimizer: torch.optim.Optimizer) -> None:
    """Set a one-process torch AdamW's state (``model``: the whole model) from a sharded
    checkpoint's layout-free optimizer keys: a run of N ranks continues on one."""
    from ..parallel.optimizer import bucket_params

    full = read_full(path, OPTIM)
    on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    for name, params in bucket_params(model):
        kind = name.split(".")[0]
        bucket = f"{OPTIM}{name}"
        if f"{bucket}/step" not in full:
            raise ValueError(f"{path} has no optimizer state for {name}: another model?")
        step = full[f"{bucket}/step"].to(torch.float32).reshape(())
        offset = 0
        for i, p in enumerate(params):
            state = {"step": step.clone().to(p.device) if on_device else step.clone()}
            for moment in ("exp_avg", "exp_avg_sq"):
                if kind == "dense":  # one flat tensor for the bucket, parameters in order
                    value = full[f"{bucket}/{moment}"][offset:offset + p.numel()].view_as(p)
                else:
                    value = full[f"{bucket}/{i}/{moment}"]
                state[moment] = value.to(p.device, p.dtype).clone()
            offset += p.numel()
            optimizer.state[p] = state
