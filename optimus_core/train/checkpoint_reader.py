"""DCP's file-system reader with the files of a checkpoint read at once, one thread a file.

    dcp.load(tensors, storage_reader=ParallelFileReader(step_dir))
    read_full(step_dir, "model/")          # every tensor under a key prefix, whole, in this process

torch.distributed.checkpoint's FileSystemReader reads the items of its load plan one after the
other, file by file, in the calling thread: one torch.load per item, measured well below the
threaded writer's rate on an H200 host reading tmpfs. This reader splits the plan by file and
hands each file's items to the parent's own read_data in a thread of its own (file reads,
torch.load's unpickling of tensor storage and the copies into the targets release the GIL for
their bulk). Each target tensor belongs to one item and each item to one file, so the threads
never write the same memory; the planner's resolve/commit calls of the default planners only
look up and fill entries of the state dict.
The result is the parent's, item for item: only the order of the reads differs.
"""
from __future__ import annotations

import dataclasses
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.futures import Future

READ_THREADS = 8  # files read at once: as many as a rank's part is written in (checkpoint.WRITE_THREADS)


class ParallelFileReader(FileSystemReader):
    """FileSystemReader whose read_data reads up to ``threads`` of the plan's files at once
    (default READ_THREADS, read when the reader is made)."""

    def __init__(self, path, threads: int | None = None):
        super().__init__(path)
        threads = READ_THREADS if threads is None else threads
        if threads < 1:
            raise ValueError(f"threads = {threads}: must be >= 1")
        self.threads = threads

    def read_data(self, plan, planner) -> Future:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if self.threads == 1 or len(by_file) < 2:
            return super().read_data(plan, planner)
        parts = [dataclasses.replace(plan, items=items) for items in by_file.values()]
        read = super().read_data
        with ThreadPoolExecutor(min(self.threads, len(parts)), thread_name_prefix="checkpoint-read") as pool:
            for done in [pool.submit(read, part, planner) for part in parts]:
                done.result().wait()  # the first error (a truncated file, say) is raised here
        finished: Future = Future()
        finished.set_result(None)
        return finished


def read_full(path: Path, prefix: str) -> dict:
    """Every tensor of a sharded checkpoint whose key starts with ``prefix``, whole, on this
    process alone (no collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = ParallelFileReader(path)
    metadata = reader.read_metadata()
    full = {k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(full, storage_reader=reader, no_dist=True)
    return full
