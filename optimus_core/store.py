"""The results store: every metric of every run in one zarr v3 store, and its read API.

Every figure and table is drawn from here (house rule 8). Writing::

    store = open_store("results/store.zarr")
    with store.run_writer("mula-1b-laptop", attrs={"preset": "mula-1b-laptop",
                                                   "config": cfg.to_dict()}) as w:
        for step in range(n_steps):
            w.log("train", {"step": step, "tokens": tokens, "loss": loss})
    # a clean exit marked the run "completed", an exception "failed"

Reading (pandas)::

    store = open_store("results/store.zarr", mode="r")
    store.runs()                       # one row per run: run_id, experiment, preset, status, ...
    store.metrics("mula-1b-laptop")    # the train table, one row per logged step
    store.tables("mula-1b-laptop"), store.columns("mula-1b-laptop", "eval"), store.attrs(...)
    store.array("mula-7b-a1b-laptop", "train", "expert_load")   # (rows, layers, experts)

or with xarray: ``xr.open_zarr(path, group=f"{run_id}/train", consolidated=False)``.

Layout::

    store.zarr/zarr.json                  root group
    store.zarr/<run_id>/zarr.json         run group; attrs: run_id, experiment, preset, config,
                                          status, created, updated, git_rev, host, hardware, ...
    store.zarr/<run_id>/<table>/zarr.json table group; attrs: n_rows, columns (the commit record)
    store.zarr/<run_id>/<table>/<column>/ one array per column, first dimension ``step``

Rules:

* Tables are strictly increasing in ``step``; every row must carry ``step``. Logging a step
  that is not after the last one logged (a resumed run re-logging from its checkpoint)
  replaces: the table is cut back to the rows with a smaller step, buffered and committed
  alike, and the new rows follow. So a resumed run never duplicates a step.
* Values are numbers or numeric numpy arrays; a column's kind is fixed by its first value:
  floats are stored float64 (float32/float16 arrays as float32), ints int64, bools int8.
  A float column takes ints and bools, an int column takes ints and bools, a bool column
  only bools. Strings are refused: they belong in run attrs. ``None`` means "not logged".
* A missing value reads back as NaN: a column first seen after rows exist is backfilled,
  a row without a known column gets the column's fill value (NaN; INT64_MIN for ints, -1
  for bools), and readers turn those into NaN (making the column float).
* Crash safety: a flush writes the array data first and commits the table's ``n_rows``
  (and column list) last, in one atomic write of the table's zarr.json; readers trust
  ``n_rows``, not the array shapes. A writer killed at any point loses at most its unflushed
  rows; the next writer removes columns that were never committed. (zarr's local store writes
  every file to a temporary name and renames it; nothing is fsynced, so this holds for a
  killed process, not for a power cut.)
* One writer per run (the job's global rank 0). Writers of different runs, in different
  processes, may share a store: each run is its own directory and creating the root group
  is idempotent.
* ``runs()`` keeps the flat scalar attrs only; nested values (the config) are in ``attrs()``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import zarr
from zarr import AsyncArray
from zarr.core.sync import sync  # runs a coroutine on zarr's own loop, as zarr's sync API does

STATUSES = ("running", "completed", "failed", "interrupted")
RUN_COLUMNS = ["run_id", "experiment", "preset", "status", "created", "updated"]
INT_MISSING = np.iinfo(np.int64).min
_CHUNK_BYTES = 256 * 1024  # a flush rewrites the partial last chunk: keep that cheap
_MAX_CHUNK_ROWS = 4096


class StoreKeyError(KeyError):
    """A run, table or column is not in the store; the message lists what is."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class StoreDamagedError(ValueError):
    """A run group, table or column of the store cannot be read (metadata lost or not valid, a
    chunk that does not decode): the message names it and what to do. Never read as absent."""


def _group_damage(path: Path) -> str | None:
    """Why the group directory ``path`` cannot be read as a zarr group, or None."""
    meta = path / "zarr.json"
    if not meta.is_file():
        return "its zarr.json is missing"
    try:
        doc = json.loads(meta.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        return f"its zarr.json is not valid JSON ({e})"
    if not isinstance(doc, dict) or doc.get("node_type") not in ("group", "array"):
        return "its zarr.json is not a zarr node's"
    return None


def open_store(path: str | os.PathLike, mode: str = "a", skip_damaged: bool = False) -> "ResultsStore":
    """Open the results store at ``path``: mode "a" creates it if missing, "r" never writes.
    A damaged run (a group, table or column whose metadata is lost or broken) stops every read
    of the run table with StoreDamagedError naming it; ``skip_damaged`` reads the others and
    warns, naming each run left out."""
    path = Path(path)
    if mode not in ("r", "a"):
        raise ValueError(f"mode = {mode!r}: must be 'r' (read) or 'a' (read and write)")
    meta = path / "zarr.json"
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path} is a file, not a zarr store")
        if meta.exists():
            try:
                root = json.loads(meta.read_text())
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{meta}: not valid JSON ({e}): {path} is a damaged zarr store") from None
            if not isinstance(root, dict) or root.get("node_type") != "group":
                raise ValueError(f"{path} is a zarr array, not a results store (a zarr group)")
        elif (path / ".zgroup").exists():
            raise ValueError(f"{path} is a zarr v2 store; the results store is zarr v3")
        elif mode == "r" or any(path.iterdir()):
            raise ValueError(f"{path} exists but is not a zarr store (no zarr.json)")
    elif mode == "r":
        raise FileNotFoundError(f"no results store at {path}")
    if mode == "a" and not meta.exists():
        # Two runs may start at once on a fresh store. Each writes the root metadata by an
        # atomic rename, so a late one only replaces it by identical bytes; one that sees the
        # other's between its check and its write raises ContainsGroupError: also done.
        with contextlib.suppress(zarr.errors.ContainsGroupError):
            zarr.open_group(str(path), mode="a")
    return ResultsStore(path, mode, skip_damaged)


class ResultsStore:
    """Read access to every run, and ``run_writer`` to add one. Build with ``open_store``."""

    def __init__(self, path: Path, mode: str, skip_damaged: bool = False):
        self.path = path
        self.mode = mode
        self.skip_damaged = skip_damaged

    def damaged(self) -> dict[str, str]:
        """The store's parts that cannot be read, by path within it (a run, ``run/table`` or
        ``run/table/column``) -> why; {} for a healthy store. Metadata only: no chunk is read."""
        found = {}
        for run in sorted(p for p in self.path.iterdir() if p.is_dir() and not p.name.startswith(".")):
            why = _group_damage(run)
            if why:
                found[run.name] = why
                continue
            for table in sorted(p for p in run.iterdir() if p.is_dir() and not p.name.startswith(".")):
                why = _group_damage(table)
                if why:
                    found[f"{run.name}/{table.name}"] = why
                    continue
                for column in sorted(p for p in table.iterdir() if p.is_dir() and not p.name.startswith(".")):
                    if not (column / "zarr.json").is_file():  # (a column's JSON is parsed when it is read)
                        found[f"{run.name}/{table.name}/{column.name}"] = "its zarr.json is missing"
        return found

    def _damaged_runs(self) -> set[str]:
        """The runs with a damaged part: StoreDamagedError naming them, or (skip_damaged) a
        warning naming those left out, and their ids."""
        damaged = self.damaged()
        if not damaged:
            return set()
        parts = "; ".join(f"{self.path / name}: {why}" for name, why in damaged.items())
        runs = sorted({name.split("/")[0] for name in damaged})
        if not self.skip_damaged:
            raise StoreDamagedError(f"{parts}: the store's run(s) {', '.join(runs)} cannot be read whole; move "
                                    f"them out of the store, or pass --skip-damaged to read the others")
        warnings.warn(f"left out damaged run(s) {', '.join(runs)} ({parts})", stacklevel=3)
        return set(runs)

    def __repr__(self) -> str:
        return f"ResultsStore({str(self.path)!r}, mode={self.mode!r})"

    # ------------------------------------------------------------------ reading
    def _root(self) -> zarr.Group:
        # Opened afresh on every call: other processes add runs and rows while we read.
        return zarr.open_group(str(self.path), mode="r")

    def _run(self, run_id: str) -> zarr.Group:
        root = self._root()
        if (self.path / run_id).is_dir() and _group_damage(self.path / run_id):
            raise StoreDamagedError(f"{self.path / run_id}: {_group_damage(self.path / run_id)}: run {run_id!r} "
                                    f"cannot be read; move it out of the store")
        if run_id not in root or not isinstance(root[run_id], zarr.Group):
            known = ", ".join(sorted(root.group_keys())) or "none"
            raise StoreKeyError(f"no run {run_id!r} in {self.path}; known runs: {known}")
        return root[run_id]

    def _table(self, run_id: str, table: str) -> zarr.Group:
        run = self._run(run_id)
        where = self.path / run_id / table
        if where.is_dir() and _group_damage(where):
            raise StoreDamagedError(f"{where}: {_group_damage(where)}: table {table!r} of run {run_id!r} cannot "
                                    f"be read; move the run out of the store")
        if table not in run or not isinstance(run[table], zarr.Group):
            known = ", ".join(sorted(run.group_keys())) or "none"
            raise StoreKeyError(f"run {run_id!r} has no table {table!r}; its tables: {known}")
        return run[table]

    def runs(self) -> pd.DataFrame:
        """One row per run, sorted by creation: the RUN_COLUMNS, then every flat scalar attr."""
        rows = []
        skipped = self._damaged_runs()
        root = self._root()
        with warnings.catch_warnings():  # zarr's word for a damaged group: _damaged_runs said it
            warnings.filterwarnings("ignore", message=".*not recognized as a component")
            run_ids = [run_id for run_id in root.group_keys() if run_id not in skipped]
        for run_id in run_ids:
            attrs = root[run_id].attrs.asdict()
            rows.append({k: v for k, v in attrs.items()
                         if v is None or isinstance(v, (str, int, float, bool))})
        frame = pd.DataFrame(rows)
        extra = sorted(c for c in frame.columns if c not in RUN_COLUMNS)
        frame = frame.reindex(columns=RUN_COLUMNS + extra)
        return frame.sort_values(["created", "run_id"], kind="stable", ignore_index=True)

    def runs_of_kind(self, kind: str) -> list[str]:
        """The ids of the runs whose ``kind`` attr is ``kind``, in creation order."""
        table = self.runs()
        return table.loc[table["kind"] == kind, "run_id"].tolist() if "kind" in table else []

    def attrs(self, run_id: str) -> dict:
        return self._run(run_id).attrs.asdict()

    def check_owner(self, run_id: str, uid: str | None, run_dir: str | os.PathLike) -> None:
        """FileExistsError (one line) if this store holds a run ``run_id`` of another run: one whose
        ``uid`` (drawn when a run starts, kept in its meta.json, so a moved run directory is the
        same run) differs, or, without uids, whose recorded run directory is another. One run id is
        one run, and its record is never another's."""
        root = self._root()
        if run_id not in root:
            return
        held = root[run_id].attrs.asdict()
        if held.get("uid") and uid:
            other = held["uid"] != uid
        else:
            other = bool(held.get("run_dir")) and Path(held["run_dir"]) != Path(run_dir).resolve()
        if other:
            raise FileExistsError(f"{self.path} already holds run {run_id!r} of another run (trained in "
                                  f"{held.get('run_dir')}), not of {run_dir}: give this run another --run-id "
                                  f"(nothing was changed)")

    def tables(self, run_id: str) -> list[str]:
        return sorted(self._run(run_id).group_keys())

    def columns(self, run_id: str, table: str = "train") -> list[str]:
        return list(self._table(run_id, table).attrs["columns"])

    def metrics(self, run_id: str, table: str = "train") -> pd.DataFrame:
        """The 1-D columns of a table, one row per step in step order (N-D columns: ``array``)."""
        group = self._table(run_id, table)
        n = group.attrs["n_rows"]
        data = {}
        for name in group.attrs["columns"]:
            arr = self._column(group, run_id, table, name)
            if arr.ndim == 1:
                data[name] = _decode(self._read(arr, n, run_id, table, name), arr.attrs.get("kind"))
        return pd.DataFrame(data)

    def _column(self, group: zarr.Group, run_id: str, table: str, name: str):
        try:
            return group[name]
        except (KeyError, ValueError, OSError) as e:
            raise StoreDamagedError(f"{self.path / run_id / table / name}: column {name!r} of {run_id}/{table} "
                                    f"cannot be opened ({type(e).__name__}: {e}); move the run out of the "
                                    f"store") from None

    def _read(self, arr, n: int, run_id: str, table: str, name: str) -> np.ndarray:
        """``arr[:n]``; a chunk that does not decode is a StoreDamagedError naming the column."""
        try:
            return arr[:n]
        except Exception as e:  # noqa: BLE001  (any codec's error: the bytes on disk are damaged)
            raise StoreDamagedError(f"{self.path / run_id / table / name}: column {name!r} of {run_id}/{table} "
                                    f"does not decode ({type(e).__name__}: {e}); move the run out of the "
                                    f"store") from None

    def array(self, run_id: str, table: str, column: str) -> np.ndarray:
        """One column as a numpy array of shape (rows, ...), missing rows as NaN."""
        group = self._table(run_id, table)
        columns = group.attrs["columns"]
        if column not in columns:
            raise StoreKeyError(f"table {run_id}/{table} has no column {column!r}; "
                                f"its columns: {', '.join(columns) or 'none'}")
        arr = self._column(group, run_id, table, column)
        return _decode(self._read(arr, group.attrs["n_rows"], run_id, table, column), arr.attrs.get("kind"))

    # ------------------------------------------------------------------ writing
    def run_writer(self, run_id: str, attrs: Optional[Mapping[str, Any]] = None, *,
                   flush_every: int = 50, flush_seconds: float = 10.0) -> "RunWriter":
        """Create run ``run_id`` or reopen it (keeping its rows); ``attrs`` are merged in.

        A new run starts with status "running"; a reopened one keeps its status unless
        ``attrs`` sets one (a resumed training run passes ``{"status": "running"}``, the
        evaluate stage adding a table to a completed run passes none).
        """
        if self.mode == "r":
            raise PermissionError(f"{self.path} is open read-only; open_store(path, mode='a') to write")
        _check_name("run id", run_id)
        if flush_every < 1 or flush_seconds < 0:
            raise ValueError(f"flush_every = {flush_every}, flush_seconds = {flush_seconds}: "
                             f"must be >= 1 and >= 0")
        return RunWriter(self.path, run_id, dict(attrs or {}), flush_every, flush_seconds)


class RunWriter:
    """Buffers rows of one run's tables and flushes them; the run's only writer.

    Flushes after ``flush_every`` buffered rows or when ``flush_seconds`` have passed at the
    time of a ``log`` (there is no background thread), and on ``flush``/``close``. As a context
    manager: an exception sets "failed" (KeyboardInterrupt and other BaseExceptions
    "interrupted"); a clean exit sets "completed" if this writer started the run or set it
    "running" and nobody changed that since (a writer that only adds a table to a run, like
    the evaluate stage, leaves the status alone). ``close(status)`` and ``set_status`` win.
    """

    def __init__(self, path: Path, run_id: str, attrs: dict, flush_every: int, flush_seconds: float):
        self.run_id = run_id
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        root = zarr.open_group(str(path), mode="r+")
        now = _now()
        exists = run_id in root
        old = root[run_id].attrs.asdict() if exists else {
            "status": "running", "created": now, "host": socket.gethostname()}
        merged = {**old, **_jsonable(attrs), "run_id": run_id, "updated": now}
        _check_status(merged["status"])
        self._started = merged["status"] == "running" and (not exists or attrs.get("status") == "running")
        if exists:
            self._group = root[run_id]
            self._group.attrs.update(merged)
        else:
            self._group = root.create_group(run_id, attributes=merged)
        self._tables: dict[str, _Table] = {}
        self._pending = 0
        self._last_flush = time.monotonic()
        self._closed = False

    def log(self, table: str, row: Mapping[str, Any],
            dims: Optional[Mapping[str, Sequence[str]]] = None) -> None:
        """Buffer one row; ``dims`` names the extra dimensions of N-D columns on first sight."""
        if self._closed:
            raise RuntimeError(f"run writer for {self.run_id!r} is closed")
        if table not in self._tables:
            _check_name("table name", table)
            self._tables[table] = _Table(self._group, table)
        self._tables[table].add(row, dims or {})
        self._pending += 1
        if self._pending >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Write every buffered row, then mark the run updated."""
        if self._pending:
            for tab in self._tables.values():
                tab.flush()
            self._group.attrs.update({"updated": _now()})
        self._pending = 0
        self._last_flush = time.monotonic()

    def update_attrs(self, **attrs: Any) -> None:
        if "status" in attrs:
            _check_status(attrs["status"])
            self._started = attrs["status"] == "running"
        self._group.attrs.update({**_jsonable(attrs), "updated": _now()})

    def set_status(self, status: str) -> None:
        self.update_attrs(status=status)

    @property
    def status(self) -> str:
        return self._group.attrs["status"]

    def close(self, status: Optional[str] = None) -> None:
        """Flush, and set ``status`` if given. Closing twice is harmless."""
        if self._closed:
            return
        try:
            self.flush()
        finally:  # a failing flush must not leave a dead run marked "running"
            if status is not None:
                self.set_status(status)
            self._closed = True

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.close("completed" if self._started and self.status == "running" else None)
        else:
            self.close("failed" if issubclass(exc_type, Exception) else "interrupted")


class _Column:
    """How one column is stored: kind (float | int | bool), dtype, per-row shape, fill value."""

    _STORAGE = {"float": (np.float64, np.nan), "int": (np.int64, INT_MISSING), "bool": (np.int8, -1)}
    _ACCEPTS = {"float": "biuf", "int": "biu", "bool": "b"}

    def __init__(self, kind: str, shape: tuple, dims: tuple, dtype: Optional[np.dtype] = None):
        self.kind, self.shape, self.dims = kind, shape, dims
        default, self.fill = self._STORAGE[kind]
        self.dtype = np.dtype(dtype or default)

    @classmethod
    def first(cls, name: str, value: np.ndarray, dims: Sequence[str]) -> "_Column":
        kind = {"b": "bool", "i": "int", "u": "int", "f": "float"}[value.dtype.kind]
        dtype = np.float32 if value.ndim and value.dtype in (np.float16, np.float32) else None
        dims = tuple(dims) or tuple(f"{name}_dim{i + 1}" for i in range(value.ndim))
        if len(dims) != value.ndim:
            raise ValueError(f"column {name!r}: dims {dims} do not match its shape {value.shape}")
        return cls(kind, value.shape, dims, dtype)

    @classmethod
    def of(cls, arr: zarr.Array) -> "_Column":
        return cls(arr.attrs["kind"], arr.shape[1:], tuple(arr.metadata.dimension_names[1:]), arr.dtype)

    def check(self, name: str, value: np.ndarray) -> None:
        if value.dtype.kind not in self._ACCEPTS[self.kind]:
            raise TypeError(f"column {name!r} holds {self.kind}s (fixed by its first value); "
                            f"got {value.dtype} {value.tolist()!r}")
        if value.shape != self.shape:
            raise ValueError(f"column {name!r} has rows of shape {self.shape}; got shape {value.shape}")

    def chunk_rows(self) -> int:
        row_bytes = self.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64))
        return int(np.clip(_CHUNK_BYTES // max(row_bytes, 1), 16, _MAX_CHUNK_ROWS))


class _Table:
    """One table of a run being written: the committed state, the schema and the row buffer."""

    def __init__(self, run: zarr.Group, name: str):
        if name in run:
            self.group = run[name]
        else:
            self.group = run.create_group(name, attributes={"n_rows": 0, "columns": []})
        self.n_rows = self.group.attrs["n_rows"]
        committed = self.group.attrs["columns"]
        for orphan in set(self.group.array_keys()) - set(committed):
            del self.group[orphan]  # created by a flush that died before its commit
        self.arrays = {c: self.group[c] for c in committed}
        self.schema = {c: _Column.of(a) for c, a in self.arrays.items()}
        self.last_step = int(self.arrays["step"][self.n_rows - 1]) if self.n_rows else None
        self.rows: list[tuple[int, dict[str, np.ndarray]]] = []
        self.truncate_from: Optional[int] = None

    def add(self, row: Mapping[str, Any], dims: Mapping[str, Sequence[str]]) -> None:
        if row.get("step") is None:
            raise ValueError(f"table {self.group.basename!r}: every row needs a 'step'")
        values, new = {}, {}
        for name in ["step", *(k for k in row if k != "step")]:  # step is the first column
            if row[name] is None:
                continue
            value = np.asarray(row[name])
            if value.dtype.kind not in "biuf":
                raise TypeError(f"column {name!r}: {value.dtype} values are not supported "
                                f"(numbers and numeric arrays only; put strings in run attrs)")
            col = self.schema.get(name)
            if col is None:
                _check_name("column name", name)
                col = new[name] = _Column.first(name, value, dims.get(name, ()))
            col.check(name, value)
            values[name] = value
        if values["step"].dtype.kind not in "iu" or values["step"].ndim:
            raise TypeError(f"'step' must be an integer; got {row['step']!r}")
        self.schema.update(new)  # only once the whole row is valid
        step = int(values["step"])
        if self.rows and step <= self.rows[-1][0]:
            self.rows = [r for r in self.rows if r[0] < step]
        if self.last_step is not None and step <= self.last_step:
            self.truncate_from = step if self.truncate_from is None else min(step, self.truncate_from)
        self.rows.append((step, values))

    def flush(self) -> None:
        if self.truncate_from is not None:
            self._truncate(self.truncate_from)
        if not self.rows:
            return
        start, stop = self.n_rows, self.n_rows + len(self.rows)
        blocks = {name: self._block(name) for name in self.schema
                  if name in self.arrays or any(name in values for _, values in self.rows)}
        for name in [c for c in blocks if c not in self.arrays]:  # in first-seen order
            # Rows before ``start`` read as the fill value: that is the backfill.
            col = self.schema[name]
            self.arrays[name] = self.group.create_array(
                name, shape=(stop, *col.shape), dtype=col.dtype, fill_value=col.fill,
                chunks=(col.chunk_rows(), *col.shape), dimension_names=("step", *col.dims),
                attributes={"kind": col.kind})
        # One event-loop round for all columns: they are separate files, written concurrently.
        sync(_put_all([(self.arrays[name].async_array, data) for name, data in blocks.items()],
                      start, stop))
        self._commit(stop)
        self.last_step = self.rows[-1][0]
        self.rows = []

    def _block(self, name: str) -> np.ndarray:
        col = self.schema[name]
        data = np.full((len(self.rows), *col.shape), col.fill, col.dtype)
        for i, (_, values) in enumerate(self.rows):
            if name in values:
                data[i] = values[name]
        return data

    def _truncate(self, step: int) -> None:
        steps = self.arrays["step"][: self.n_rows]
        keep = int(np.searchsorted(steps, step, side="left"))
        if keep < self.n_rows:
            # Commit the cut before rewriting those rows, so a crash mid-rewrite never
            # leaves a committed row mixing old and new values.
            self._commit(keep)
        self.last_step = int(steps[keep - 1]) if keep else None
        self.truncate_from = None

    def _commit(self, n_rows: int) -> None:
        # The single atomic write that makes rows visible: readers trust n_rows, not shapes.
        self.group.attrs.update({"n_rows": n_rows, "columns": list(self.arrays)})
        self.n_rows = n_rows


async def _put_all(items: list[tuple[AsyncArray, np.ndarray]], start: int, stop: int) -> None:
    await asyncio.gather(*(_put(arr, data, start, stop) for arr, data in items))


async def _put(arr: AsyncArray, data: np.ndarray, start: int, stop: int) -> None:
    """Write rows [start, stop) of ``arr``, resizing it (in place) to end at ``stop``."""
    if arr.shape[0] != stop:
        # A shrunken array may keep stale values past its end in its last chunk; every
        # row we grow into is written next, so none of them can show through.
        await arr.resize((stop, *arr.shape[1:]))
    await arr.setitem(slice(start, stop), data)


def _decode(values: np.ndarray, kind: Optional[str]) -> np.ndarray:
    """Stored values as the caller logged them; fill values (missing) become NaN."""
    if kind == "int" and (values == INT_MISSING).any():
        return np.where(values == INT_MISSING, np.nan, values)
    if kind == "bool":
        return np.where(values < 0, np.nan, values) if (values < 0).any() else values.astype(bool)
    return values


def _check_name(what: str, name: Any) -> None:
    # zarr node names: non-empty, no "/", not "." or "..", and "__" prefixes are reserved.
    if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or name.startswith("__"):
        raise ValueError(f"{what} {name!r}: must be a non-empty string without '/', "
                         f"not '.' or '..', not starting with '__'")


def _check_status(status: Any) -> None:
    if status not in STATUSES:
        raise ValueError(f"status = {status!r}: must be one of {', '.join(STATUSES)}")


def _jsonable(attrs: Mapping[str, Any]) -> dict:
    """attrs as plain JSON values (numpy scalars and arrays, paths converted), or a TypeError."""
    def convert(obj: Any) -> Any:
        if isinstance(obj, (np.generic, np.ndarray)):
            return obj.tolist()
        if isinstance(obj, os.PathLike):
            return os.fspath(obj)
        raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")

    out = {}
    for key, value in attrs.items():
        try:
            out[key] = json.loads(json.dumps(value, default=convert))
        except TypeError as err:
            raise TypeError(f"run attr {key!r}: {err}") from None
    return out


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")
