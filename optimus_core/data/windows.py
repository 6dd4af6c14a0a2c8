"""The paper's data order: every file cut into windows, one permutation of all windows.

    windows = FileWindows(data_dir, "train", seq_len=2048)
    loader = WindowLoader(windows, global_batch=3072, seed=42, rank=r, world_size=D)
    x = loader.next_batch()          # LongTensor (3072 // D, 2048): inputs x[:, :-1], targets x[:, 1:]
    loader.epoch_steps               # whole global batches in one epoch (the paper's decay horizon)
    training_loader(data_dir, cfg.data, global_batch, rank, world)   # the loader data.order names

As the paper's code reads OLMoE-mix (GitHub IntelLabs/Optimus-LM, ``optimus/datasets.py`` and
``scripts/generate_metadata.py``, read 2026-12-06):

- each token file of the split is cut into non-overlapping windows of ``seq_len`` tokens, its
  tail shorter than a window dropped; a window never crosses a file. Window ``j`` of file ``f``
  is tokens ``[j * seq_len, (j + 1) * seq_len)``, numbered after the windows of the files before
  it in the manifest's order, by source then file name: the order of the authors' download list
  (their scripts/generate_urls.py), whose files are those of six sources (algebraic-stack, dclm,
  open-web-math, pes2o, starcoder, wiki): `optimus corpus --files-list` indexes a download
  restricted to such a list, so that the same files are numbered; our held-out split, which the
  authors do not have, takes its documents out of the train files' windows;
- the windows are visited in one permutation, numpy's legacy generator
  ``np.random.RandomState(seed).permutation(N)`` (what ``np.random.seed(42)`` then
  ``np.random.permutation`` draws);
- step ``s`` takes the block of ``global_batch`` windows ``order[s * G : (s + 1) * G]`` and data
  rank ``r`` of ``D`` gets its positions ``s * G + i * D + r`` for ``i < G / D`` (every D-th);
- a window is the model's input and its own target, shifted by one inside it: ``seq_len - 1``
  predicted tokens per window.

The paper trains one epoch. A run longer than that continues with the generator's next
permutation (the authors' "order 2"). The order is the same on any number of ranks, so a run
resumes on another world size; the loader's state is the epoch and the position in its order.

Where the order was drawn once into a file beside the tokens (``optimus window-order``:
optimus_core.data.window_order), each rank memory-maps it and reads only its positions; else each
rank draws it in memory when it starts: 8 bytes a window, 0.75 GiB and seconds of one CPU core
for 1e8 windows, ~15 GiB and minutes for OLMoE-mix's ~2e9 windows of 2048 tokens, which is why
the authors draw theirs once, offline (``generate_metadata.py``), and a paper run reads a file.
"""
from __future__ import annotations

import operator
from pathlib import Path
from typing import TYPE_CHECKING, Union

import numpy as np
import torch

from optimus_core.data.loader import BatchLoader, TokenDataset, check_layout, check_resumable
from optimus_core.data.shards import ShardError, load_manifest, open_tokens
from optimus_core.data.window_order import draw_order, read_order

if TYPE_CHECKING:
    from optimus_core.config import DataConfig


class FileWindows:
    """The ``seq_len``-token windows of a split's files (module doc): ``len`` counts them,
    ``windows[w]`` is window ``w`` as an int64 tensor."""

    def __init__(self, data_dir: Union[str, Path], split: str = "train", seq_len: int = 2048):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len = {seq_len!r}: must be an integer >= 2")
        manifest = load_manifest(data_dir)
        self.split, self.seq_len, self.root = split, seq_len, manifest.root
        files = manifest.files_for(split)
        self.files = [(str(f.tokens), f.n_tokens) for f in files]  # the layout (window_order's digest)
        self._arrays = [open_tokens(manifest.root / f.tokens, manifest.dtype) for f in files]
        for f, a in zip(files, self._arrays):
            if len(a) != f.n_tokens:  # a truncated copy would otherwise shift every window
                raise ShardError(f"{manifest.root / f.tokens}: {len(a)} tokens, the manifest says {f.n_tokens}")
        self.n_tokens = sum(len(a) for a in self._arrays)
        # first window number of each file, and one past the last
        self._starts = np.cumsum([0] + [len(a) // seq_len for a in self._arrays])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, w: int) -> torch.Tensor:
        w = operator.index(w)
        if not 0 <= w < len(self):
            raise IndexError(f"window {w} out of range: the {self.split} split has {len(self)} windows "
                             f"of {self.seq_len} tokens")
        f = int(np.searchsorted(self._starts, w, side="right")) - 1
        lo = (w - int(self._starts[f])) * self.seq_len
        return torch.from_numpy(self._arrays[f][lo:lo + self.seq_len].astype(np.int64))


class WindowLoader:
    """This data rank's windows of each step, in the paper's order (module doc); the interface of
    optimus_core.data.loader.BatchLoader."""

    def __init__(self, windows: FileWindows, global_batch: int, seed: int, rank: int = 0, world_size: int = 1):
        check_layout(global_batch, rank, world_size)
        if len(windows) < global_batch:
            raise ValueError(
                f"global_batch = {global_batch}: the {windows.split} split has only {len(windows)} windows of "
                f"{windows.seq_len} tokens ({windows.n_tokens} tokens; each file's tail shorter than a window is "
                f"not used); lower global_batch or seq_len, or add data")
        self.dataset, self.global_batch, self.seed = windows, global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0  # position: windows of this epoch's order already used
        self._order, self._order_epoch = None, -1

    @property
    def epoch_steps(self) -> int:
        """Whole global batches in one epoch: the steps of one pass (the tail of the order that
        does not fill a batch is not used)."""
        return len(self.dataset) // self.global_batch

    def _order_of(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order: memory-mapped from its file where one was drawn, else drawn."""
        if self._order_epoch != epoch:
            order = read_order(self.dataset, self.seed, epoch)
            self._order = draw_order(len(self.dataset), self.seed, epoch) if order is None else order
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> torch.Tensor:
        """This rank's windows of the next step: LongTensor (global_batch // world_size, seq_len)."""
        if self.position + self.global_batch > len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order_of(self.epoch)
        picked = order[self.position + self.rank: self.position + self.global_batch: self.world_size]
        self.position += self.global_batch
        return torch.stack([self.dataset[int(w)] for w in picked])

    @property
    def batches_drawn(self) -> int:
        """Global batches handed out since the first, the skipped ones included."""
        return self.epoch * self.epoch_steps + self.position // self.global_batch

    def state_dict(self) -> dict:
        """JSON-serialisable: where the next batch starts, and what guards a resume against other
        data, another batch or another order."""
        return {"order": "file_windows", "epoch": self.epoch, "position": self.position, "seed": self.seed,
                "global_batch": self.global_batch, "examples": len(self.dataset), "seq_len": self.dataset.seq_len}

    def load_state_dict(self, state: dict) -> None:
        check_resumable(state, self.state_dict())
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def training_loader(data_dir: Union[str, Path], data: "DataConfig", global_batch: int, rank: int = 0,
                    world_size: int = 1):
    """The loader of the train split that ``data.order`` names, for data rank ``rank`` of
    ``world_size``: optimus_core.data.loader.BatchLoader ("stream") or WindowLoader
    ("file_windows", the paper's). Both give (global_batch // world_size, S) int64 rows whose
    first S - 1 tokens are the input and last S - 1 the targets."""
    if data.order == "file_windows":
        return WindowLoader(FileWindows(data_dir, "train", data.seq_len), global_batch, seed=data.seed,
                            rank=rank, world_size=world_size)
    return BatchLoader(TokenDataset(data_dir, "train", data.seq_len), global_batch, seed=data.seed,
                       rank=rank, world_size=world_size)
