"""Initial weights that do not depend on how the model is laid out over ranks.

    init_parameter_(p_local, "blocks.3.attn.w_q.weight", first_row=0, seed=0, cfg=model_cfg)

Every matrix (a parameter of two or more dims, seen as rows x its last dim) is N(0, std),
truncated at ``ModelConfig.init_truncation`` std (OLMo-core's OLMoE init: 3) or not
(transformers' init, the paper's runs), drawn in blocks of ``ROWS_PER_DRAW`` rows: block ``b`` of the parameter called
``name`` comes from a generator of its own, seeded from (seed, name, b). A rank that holds rows
[first_row, first_row + n) of a parameter (its share under expert parallelism and sharding,
optimus_core.parallel.layout) draws only the blocks that cover them, and gets the values the
one-process init gives those rows, bit for bit. Vectors (norm scales) are ones. The embedding's
padding row (``ModelConfig.pad_token_id``) is zero.

The draws run in float32 on the parameter's device, with that device's generator (the CPU's
Mersenne Twister, CUDA's Philox): the same layout-free values on every device of a kind, and
different values on a CPU and a GPU (a CPU draw of a 7B model takes minutes: ~45 M values/s
on one core). At most ``STAGE_ELEMENTS`` values are drawn at a time, never a whole parameter.
"""
from __future__ import annotations

import hashlib

import torch

from ..config import ModelConfig

ROWS_PER_DRAW = 64  # rows per generator: a shard wastes at most two partial blocks of draws
STAGE_ELEMENTS = 1 << 22  # values drawn at a time (16 MiB of float32), then copied into the parameter


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of row block ``block`` of parameter ``name`` (stable across runs,
    Python versions and machines: a hash, not Python's ``hash``)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def draw_rows(name: str, first_row: int, n_rows: int, n_cols: int, *, seed: int, std: float,
              truncation: float | None = 3.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rows [first_row, first_row + n_rows) of parameter ``name``'s init, (n_rows, n_cols) float32.

    Each row block is N(0, std) from its own generator; with ``truncation`` c, the values beyond
    c std (~0.27% at 3) are redrawn from the same generator until none is left (exactly the
    truncated distribution). The blocks of one call are redrawn together, one device sync per
    round, in the order a block drawn alone would use, so a block's values do not depend on its
    neighbours. ``truncation`` None: the plain normal draw.
    """
    device = torch.device(device)
    first_block, last_block = first_row // ROWS_PER_DRAW, (first_row + n_rows - 1) // ROWS_PER_DRAW
    n_blocks = max(0, last_block - first_block + 1)
    drawn = torch.empty(n_blocks, ROWS_PER_DRAW * n_cols, dtype=torch.float32, device=device)
    generators = []
    for i in range(n_blocks):
        generators.append(torch.Generator(device=device).manual_seed(block_seed(seed, name, first_block + i)))
        drawn[i].normal_(0.0, std, generator=generators[i])
    limit = float("inf") if truncation is None else truncation * std
    bad = (drawn.abs() > limit).nonzero()  # (block, position) pairs, ascending within each block
    while bad.numel():
        block_ids, positions = bad[:, 0], bad[:, 1]
        per_block = torch.bincount(block_ids, minlength=n_blocks).tolist()
        fresh = torch.empty(positions.numel(), dtype=torch.float32, device=device)
        at = 0
        for i, count in enumerate(per_block):
            if count:
                fresh[at:at + count].normal_(0.0, std, generator=generators[i])
                at += count
        drawn[block_ids, positions] = fresh
        bad = bad[fresh.abs() > limit]
    rows = drawn.view(n_blocks * ROWS_PER_DRAW, n_cols)
    offset = first_row - first_block * ROWS_PER_DRAW
    return rows[offset:offset + n_rows]


EMBEDDING = "embed.weight"  # the parameter whose padding row is zero


@torch.no_grad()
def init_parameter_(local: torch.Tensor, name: str, first_row: int = 0, *, seed: int, cfg: ModelConfig) -> None:
    """Fill ``local``, rows [first_row, first_row + len(local)) of parameter ``name`` of a model
    of ``cfg``, with its initial values (module doc). ``local`` is a plain tensor on any device
    and dtype."""
    if local.ndim < 2:
        local.fill_(1.0)
        return
    n_cols = local.shape[-1]
    rows_RC = local.view(-1, n_cols)
    step = max(ROWS_PER_DRAW, STAGE_ELEMENTS // max(1, n_cols) // ROWS_PER_DRAW * ROWS_PER_DRAW)
    for lo in range(0, rows_RC.shape[0], step):
        hi = min(lo + step, rows_RC.shape[0])
        rows_RC[lo:hi].copy_(draw_rows(name, first_row + lo, hi - lo, n_cols, seed=seed, std=cfg.init_std,
                                       truncation=cfg.init_truncation, device=local.device))
    pad = cfg.pad_token_id
    if name == EMBEDDING and pad is not None and first_row <= pad < first_row + rows_RC.shape[0]:
        rows_RC[pad - first_row].zero_()
