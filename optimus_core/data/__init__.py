"""Token data: the shard format written by `optimus tokenize` and the loaders that read it.

    from optimus_core.data import TokenDataset, BatchLoader, training_loader, heldout_batches, load_manifest

The loaders are imported on first use: they need torch, and the tokenizer stage and its worker
processes, which only write the format, would otherwise each pay its import (~2 s).
"""
from optimus_core.data.shards import (
    IndexRow, Manifest, ShardError, TokenFile, Totals, load_manifest, open_tokens, read_index,
    token_dtype, verify,
)

_LOADER_NAMES = ("BatchLoader", "TokenDataset", "heldout_batches")

__all__ = [
    *_LOADER_NAMES, "training_loader",
    "IndexRow", "Manifest", "ShardError", "TokenFile", "Totals", "load_manifest", "open_tokens",
    "read_index", "token_dtype", "verify",
]


def __getattr__(name: str):
    if name in _LOADER_NAMES:
        from optimus_core.data import loader

        return getattr(loader, name)
    if name == "training_loader":  # the loader data.order names (optimus_core.data.windows)
        from optimus_core.data import windows

        return windows.training_loader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
