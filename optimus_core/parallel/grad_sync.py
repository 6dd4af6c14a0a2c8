"""Gradient reduction overlapped with the backward: ShardedAdamW's buckets, reduced in chunks of
whole parameters as soon as the last micro-batch's backward has produced them.

    sync = OverlappedGradSync(buckets, order_of, chunk_bytes=128 << 20, global_ranks=ranks)
    sync.arm()           # before the last micro-batch's backward (earlier ones only accumulate)
    loss.backward()      # post-accumulate-grad hooks launch each finished chunk's reduction
    sync.finish()        # launches what is left and waits: every bucket's reduced_grad() is ready

Why reduce to owners instead of reduce-scatter: rank r's shard of a bucket is one contiguous 1/W
range of its flat buffer (the layout the optimizer state, the checkpoints and the all-gather
use), so a chunk of parameters lies in one or two ranks' shards. Each chunk is summed with one
``dist.reduce`` per owner, in place onto the owner's range of the gradient buffer (no extra
buffer). Every rank sends the same bytes as in a reduce-scatter; at 2 ranks a chunk uses one link
direction at a time, so the reduction takes up to twice as long, but it runs under the backward
instead of after it. Replicated buckets (ep_unaware experts) all-reduce each chunk. The chunks
are sums: ShardedAdamW divides by the world size in its update. Local buckets (groups of one
rank) have nothing to reduce and are not chunked.

Order: NCCL needs every rank to issue its collectives in the same order, and the order in which
autograd finishes gradients is not a contract. So chunks launch strictly in one fixed order, the
reverse of the parameters' registration order (how backward normally finishes them); a chunk
finished early waits for its predecessors. A chunk whose parameters get no gradient in this
backward (an unused parameter) launches in finish().
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Chunk:
    """A range [lo, hi) of one bucket's flat buffer: whole parameters, reduced together."""

    bucket: object  # optimizer.Bucket
    lo: int
    hi: int
    n_params: int
    first_param: int  # smallest registration index among its parameters: the last one backward finishes
    pending: int = 0  # parameters whose gradient this backward has not yet produced
    launched: bool = False
    works: list = field(default_factory=list)


def split_into_chunks(bucket, chunk_bytes: int, order_of: dict[int, int]) -> list[Chunk]:
    """Whole parameters, walked from the end of the flat buffer (backward's order), closed once
    a chunk holds ``chunk_bytes``; the buffer's padding rides with the top chunk."""
    offsets, offset = [], 0
    for p in bucket.params:
        offsets.append(offset)
        offset += p.numel()
    elem = bucket.flat_N.element_size()
    chunks, hi, members = [], bucket.flat_N.numel(), []
    for i in reversed(range(len(bucket.params))):
        members.append(i)
        lo = offsets[i]
        if (hi - lo) * elem >= chunk_bytes or i == 0:
            first = min(order_of[id(bucket.params[j])] for j in members)
            chunks.append(Chunk(bucket, lo, hi, len(members), first))
            hi, members = lo, []
    return chunks


class OverlappedGradSync:
    """Hook-driven, in-order, asynchronous reduction of ShardedAdamW's gradient buckets."""

    def __init__(self, buckets, order_of: dict[int, int], chunk_bytes: int,
                 global_ranks: dict[int, tuple[int, ...]]):
        """``order_of``: id(parameter) -> its index in model.parameters(); ``global_ranks``:
        id(bucket) -> the global rank of each rank of its group (dist.reduce's dst)."""
        self.global_ranks = global_ranks
        self.chunks: list[Chunk] = []
        self._chunk_of: dict[int, Chunk] = {}
        for bucket in buckets:
            if bucket.local:
                continue  # nothing to reduce
            for chunk in split_into_chunks(bucket, chunk_bytes, order_of):
                self.chunks.append(chunk)
        # Launch order: the chunk whose last-finished parameter comes latest in the model first.
        self.chunks.sort(key=lambda c: -c.first_param)
        self._lock = threading.Lock()
        self._next = 0
        self._armed = False
        self._hooks = []
        for chunk in self.chunks:
            offset = 0
            for p in chunk.bucket.params:
                if chunk.lo <= offset < chunk.hi:
                    self._chunk_of[id(p)] = chunk
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
                offset += p.numel()
        self._reset()

    def _reset(self) -> None:
        for chunk in self.chunks:
            chunk.pending, chunk.launched, chunk.works = chunk.n_params, False, []
        self._next, self._armed = 0, False

    def arm(self) -> None:
        """The next backward is the step's last: reduce each chunk as soon as it is complete."""
        with self._lock:
            self._armed = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        with self._lock:
            chunk = self._chunk_of[id(p)]
            chunk.pending -= 1
            self._launch_in_order(force=False)

    def _launch_in_order(self, force: bool) -> None:
        while self._next < len(self.chunks):
            chunk = self.chunks[self._next]
            if chunk.pending > 0 and not force:
                return
            self._launch(chunk)
            self._next += 1

    def _launch(self, chunk: Chunk) -> None:
        bucket = chunk.bucket
        grad = bucket.grad_N[chunk.lo:chunk.hi]
        if not bucket.sharded:
            chunk.works.append(dist.all_reduce(grad, group=bucket.group, async_op=True))
        else:
            shard_len = bucket.shard.numel()
            ranks = self.global_ranks[id(bucket)]
            for owner in range(chunk.lo // shard_len, -(-chunk.hi // shard_len)):
                lo, hi = max(chunk.lo, owner * shard_len), min(chunk.hi, (owner + 1) * shard_len)
                if hi > lo:
                    chunk.works.append(dist.reduce(bucket.grad_N[lo:hi], dst=ranks[owner], group=bucket.group,
                                                   async_op=True))
        chunk.launched = True

    def finish(self) -> None:
        """Launch every chunk not yet launched (in order) and wait for all reductions."""
        with self._lock:
            self._launch_in_order(force=True)
            for chunk in self.chunks:
                for work in chunk.works:
                    work.wait()
            self._reset()

    def settle(self) -> None:
        """Before the buffers are zeroed: finish a reduction this backward started (a step that
        was skipped after it), so nothing is in flight on them; nothing to do otherwise."""
        if self._armed or self._next:
            self.finish()

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
