"""Training and evaluation batches from a token directory (see :mod:`optimus_core.data.shards`).

::

    ds = TokenDataset(data_dir, "train", seq_len=1024)
    loader = BatchLoader(ds, global_batch=64, seed=0, rank=rank, world_size=world)
    x = loader.next_batch()                    # LongTensor (64 // world, 1025)
    inputs, targets = x[:, :-1], x[:, 1:]      # the training loop shifts
    state = loader.state_dict()                # into the checkpoint's meta.json
    loader.load_state_dict(state)              # on resume: the same batches follow

    for x in heldout_batches(data_dir, "code", seq_len=1024, batch_size=8, max_batches=4): ...

A split's token files are one stream (sorted by path, never loaded into memory: memmaps);
example ``i`` is tokens ``[i * (seq_len + 1), (i + 1) * (seq_len + 1))`` of it, so examples
cross document boundaries (documents are separated by EOS) and never overlap.
"""
from __future__ import annotations

import hashlib
import operator
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch

from optimus_core.data.shards import ShardError, load_manifest, open_tokens

__all__ = ["TokenDataset", "BatchLoader", "heldout_batches"]


class TokenDataset:
    """Fixed-length examples of ``seq_len + 1`` tokens from one split (optionally only some
    sources) of a token directory. ``ds[i]`` is an int64 tensor; ``len(ds)`` counts full examples
    (the tail shorter than one example is not used)."""

    def __init__(self, data_dir: Union[str, Path], split: str = "train", seq_len: int = 4096,
                 sources: Optional[Sequence[str]] = None):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len = {seq_len!r}: must be an integer >= 1")
        self.manifest = load_manifest(data_dir)
        self.split, self.seq_len = split, seq_len
        self.files = self.manifest.files_for(split, sources)
        self._arrays = [open_tokens(self.manifest.root / f.tokens, self.manifest.dtype) for f in self.files]
        for f, a in zip(self.files, self._arrays):
            if len(a) != f.n_tokens:  # a truncated copy would otherwise shift every example
                raise ShardError(f"{self.manifest.root / f.tokens}: {len(a)} tokens, the manifest says {f.n_tokens}")
        # where each file starts in the split's stream
        self._starts = np.cumsum([0] + [len(a) for a in self._arrays])
        self.n_tokens = int(self._starts[-1])

    def __len__(self) -> int:
        return self.n_tokens // (self.seq_len + 1)

    def __getitem__(self, i: int) -> torch.Tensor:
        i = operator.index(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"example {i} out of range: the {self.split} split has {n} examples of {self.seq_len + 1} tokens")
        i %= n
        width = self.seq_len + 1
        return torch.from_numpy(self._read(i * width, (i + 1) * width))

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream as int64, gathered across file boundaries."""
        out = np.empty(stop - start, dtype=np.int64)
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        filled = 0
        while filled < len(out):
            lo = start + filled - int(self._starts[k])
            piece = self._arrays[k][lo: lo + len(out) - filled]
            out[filled: filled + len(piece)] = piece
            filled += len(piece)
            k += 1
        return out


class BatchLoader:
    """Deterministic, resumable batches of a TokenDataset for one rank of ``world_size``.

    Epoch ``e`` visits the examples in a pseudo-random order fixed by ``(seed, e)``; step after
    step it takes the next ``global_batch`` examples of that order, and this rank gets rows
    ``[rank * b, (rank + 1) * b)`` of them, ``b = global_batch // world_size``. The examples that
    do not fill a last global batch are left out of that epoch. The order depends neither on
    ``world_size`` nor on stops and restarts, so a run may resume on another number of ranks.
    """

    def __init__(self, dataset: TokenDataset, global_batch: int, seed: int, rank: int = 0, world_size: int = 1):
        check_layout(global_batch, rank, world_size)
        if len(dataset) < global_batch:
            raise ValueError(
                f"global_batch = {global_batch}: the {dataset.split} split has only {len(dataset)} examples of "
                f"{dataset.seq_len + 1} tokens ({dataset.n_tokens} tokens); lower global_batch or seq_len, or add data")
        self.dataset, self.global_batch, self.seed = dataset, global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0  # position: examples of this epoch's order already used
        self._order = _Permutation(len(dataset), seed, 0)

    def next_batch(self) -> torch.Tensor:
        """This rank's rows of the next global batch: LongTensor (global_batch // world_size, seq_len + 1)."""
        if self.position + self.global_batch > len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        if self._order.epoch != self.epoch:
            self._order = _Permutation(len(self.dataset), self.seed, self.epoch)
        rows = self.global_batch // self.world_size
        first = self.position + self.rank * rows
        indices = self._order(np.arange(first, first + rows, dtype=np.uint64))
        self.position += self.global_batch
        return torch.stack([self.dataset[int(i)] for i in indices])

    @property
    def batches_drawn(self) -> int:
        """Global batches handed out since the first: the run's batches seen, skipped ones included."""
        return self.epoch * (len(self.dataset) // self.global_batch) + self.position // self.global_batch

    def state_dict(self) -> dict:
        """JSON-serialisable; ``epoch`` and ``position`` say where the next batch starts, the rest
        guards against resuming on other data or another batch size."""
        return {"order": "stream", "epoch": self.epoch, "position": self.position, "seed": self.seed,
                "global_batch": self.global_batch, "examples": len(self.dataset),
                "seq_len": self.dataset.seq_len}

    @property
    def epoch_steps(self) -> int:
        """Whole global batches in one epoch."""
        return len(self.dataset) // self.global_batch

    def load_state_dict(self, state: dict) -> None:
        check_resumable(state, self.state_dict())
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def check_layout(global_batch: int, rank: int, world_size: int) -> None:
    """ValueError unless rank ``rank`` of ``world_size`` can take whole rows of ``global_batch``."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank = {rank}, world_size = {world_size}: need world_size >= 1 and 0 <= rank < world_size")
    if global_batch < 1 or global_batch % world_size:
        raise ValueError(f"global_batch = {global_batch}: must be >= 1 and divisible by world_size ({world_size})")


def check_resumable(state: dict, mine: dict) -> None:
    """ValueError unless a loader's saved ``state`` is of the same order, data and batch as
    ``mine`` (this loader's state_dict): only the epoch and position may differ."""
    for key in ("order", "seed", "global_batch", "examples", "seq_len"):
        theirs = state.get(key, "stream" if key == "order" else None)  # states before the order was named
        if theirs != mine[key]:
            raise ValueError(f"loader state {key} = {theirs!r}, but this loader has {mine[key]!r}: "
                             "resuming needs the same data, data.order, seq_len, global_batch and seed")


def heldout_batches(data_dir: Union[str, Path], source: str, seq_len: int, batch_size: int,
                    max_batches: Optional[int] = None) -> Iterator[torch.Tensor]:
    """The val split of one source in order, as LongTensors (<= batch_size, seq_len + 1): the same
    batches on every call. The last batch may be short; a source whose val split is shorter than
    one example yields nothing (the caller reports it). ``max_batches`` None = all."""
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size}: must be >= 1")
    dataset = TokenDataset(data_dir, "val", seq_len, [source])
    n = len(dataset) if max_batches is None else min(len(dataset), max_batches * batch_size)
    for lo in range(0, n, batch_size):
        yield torch.stack([dataset[i] for i in range(lo, min(lo + batch_size, n))])


class _Permutation:
    """A pseudo-random permutation of range(n) keyed by (seed, epoch), evaluated per position.

    A 6-round Feistel network on the smallest even-bit domain >= n, with cycle walking to stay
    below n. Unlike a stored shuffle it takes no memory (a paper-scale epoch has ~1e9 examples:
    8 GB per rank as an index array) and is the same on every numpy version.
    """

    _ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int):
        self.n, self.epoch = n, epoch
        bits = max(2, (n - 1).bit_length())
        self._half = np.uint64((bits + 1) // 2)
        self._mask = np.uint64((1 << int(self._half)) - 1)
        self._keys = [np.uint64(int.from_bytes(hashlib.blake2b(f"{seed}:{epoch}:{r}".encode(), digest_size=8).digest(), "little"))
                      for r in range(self._ROUNDS)]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = self._encrypt(np.asarray(positions, dtype=np.uint64))
        # cycle walking: re-encrypt what fell outside range(n); the domain is < 4n, so few rounds
        while (outside := x >= self.n).any():
            x[outside] = self._encrypt(x[outside])
        return x.astype(np.int64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix64(right ^ key) & self._mask)
        return (left << self._half) | right


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective scramble of uint64 (multiplications wrap mod 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
