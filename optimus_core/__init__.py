"""Optimus trainer core: models, data, training, parallelism, results store.

Knows nothing of Snakemake, Parsl or plotting (house rule 1). Entry points:

    from optimus_core import presets, load_model
    from optimus_core.store import open_store
    model, cfg = load_model("results/runs/laptop-mula-7b-a1b")
"""
from __future__ import annotations

from pathlib import Path


def load_model(run_dir: str | Path, map_location: str = "cpu", *, with_step: bool = False):
    """The newest valid checkpoint of ``run_dir`` as ``(model, RunConfig)``, in eval mode.

    ``with_step=True`` returns ``(model, RunConfig, step)``: the step the checkpoint was saved at.
    """
    from .config import RunConfig, from_dict
    from .model.transformer import Transformer
    from .train.checkpoint import latest_valid

    found = latest_valid(Path(run_dir))
    if found is None:
        raise FileNotFoundError(f"{run_dir}: no valid checkpoint (expected checkpoints/step_*/ with meta.json)")
    cfg = from_dict(RunConfig, found.meta["config"])
    model = Transformer(cfg.model)
    model.load_state_dict(found.load_model_state(map_location))
    return (model.eval(), cfg, found.step) if with_step else (model.eval(), cfg)


__all__ = ["load_model"]
