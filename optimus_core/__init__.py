"""Optimus trainer core: models, data, training, parallelism, results store.

Knows nothing of Snakemake, Parsl or plotting (the house rules: imports point one way). Entry points:

    from optimus_core import presets, load_model
    from optimus_core.store import open_store
    model, cfg = load_model("results/runs/laptop-mula-7b-a1b")
"""
from __future__ import annotations


def __getattr__(name: str):
    # load_model lives with the checkpoints it reads; imported on first use so that
    # `import optimus_core.config` does not pull in torch and the training code.
    if name == "load_model":
        from .train.checkpoint import load_model
        return load_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["load_model"]
