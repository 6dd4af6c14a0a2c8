"""Which settings a resumed run may change, and the refusal of the others.

    changes = resume_changes(saved_config, cfg, "results/runs/r")   # ConfigError if not resumable
    # -> {"train.steps": (200, 400), "execution.compile": ("auto", False)}: record them

A run that resumes continues the same computation: the same model, data order, optimizer and
schedule. What may change is how and where it runs, how often it logs, evaluates and checkpoints,
and how long it goes on: the fields (or whole sections) of RESUMABLE. Any other field that differs
from the saved config is refused, all of them named in one sentence with their old and new
values. The run directory's meta.json records the changes that were allowed (stages/pretrain.py).
"""
from __future__ import annotations

import json
from typing import Any

from ..config import ConfigError, RunConfig

# A field, or a section (every field in it), that a resume may change, and why it may.
# Everything else is what the run computes and is refused: preset (the run's recorded identity),
# model.* (the checkpoint's shapes), optim.* and schedule.* (the update rule), train.global_batch
# and data.seq_len (the data each step sees and the loader's position), train.seed and data.seed
# (the initialisation and the data order), train.eval_batches (the held-out loss is measured on
# the same batches throughout, or its curve becomes two curves).
RESUMABLE: dict[str, str] = {
    "train.steps": "how long the run goes on (fewer steps than its newest checkpoint is refused "
                   "before this: a run is never shortened); the schedule is computed for the new length",
    "train.micro_batch": "the global batch split into other micro-batches: the same step up to rounding",
    "train.device": "where it runs: a checkpoint loads on any device",
    "train.log_every": "how often it logs",
    "train.eval_every": "how often it evaluates (on the same batches)",
    "train.checkpoint_every": "how often it checkpoints",
    "train.checkpoint_every_minutes": "how often it checkpoints",
    "train.keep_checkpoints": "which checkpoints are kept",
    "train.keep_every": "which checkpoints are kept",
    "train.async_checkpoint": "how checkpoints are written, not what they hold",
    "train.loss_spike_factor": "the loss guard's policy (what a fault does): loosened to get past one",
    "train.max_bad_steps": "the loss guard's policy (what a fault does)",
    "train.watchdog_timeout_s": "how long a hang is waited for",
    "train.watchdog_io_timeout_s": "how long a hang is waited for",
    "train.init_from": "ignored once the run has a checkpoint: the checkpoint is loaded",
    # data.path: the resolved absolute path of the tokens, which moves with the data (another file
    # system, a staged copy on the compute site); that it is the same data is checked where it
    # matters, against the checkpoint's tokenizer (optimus_core.data.identity).
    "data.path": "the same tokens at another place (their tokenizer is checked against the checkpoint's)",
    "parallel": "the rank layout: a checkpoint loads on any world size, EP degree, shard block and optimizer "
                "mode (optimus_core.train.checkpoint); the collectives' settings change rounding at most",
    "execution": "how it executes, not what it computes (ExecutionConfig): rounding at most",
}

_ABSENT = object()
_SHOWN = 8  # changed fields named in a refusal before "and N more"


def resumable(field: str) -> bool:
    """Whether ``field`` (dotted: ``train.steps``) is in RESUMABLE, itself or by its section."""
    parts = field.split(".")
    return any(".".join(parts[:i]) in RESUMABLE for i in range(1, len(parts) + 1))


def _plain(config: RunConfig | dict) -> dict:
    """A config as today's RunConfig reads it, JSON-plain (a former field: ConfigError naming it)."""
    cfg = config if isinstance(config, RunConfig) else RunConfig.from_json(json.dumps(config))
    return json.loads(json.dumps(cfg.to_dict()))


def _diff(old: Any, new: Any, path: str, out: dict) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            _diff(old.get(key, _ABSENT), new.get(key, _ABSENT), f"{path}.{key}" if path else key, out)
    elif old != new:
        out[path] = (old, new)


def config_changes(old: RunConfig | dict, new: RunConfig | dict) -> dict[str, tuple[Any, Any]]:
    """Every field whose value differs, dotted -> (old, new); a section present on one side only
    (``model.moe`` null -> {...}) is one entry, and a field missing on one side reads None."""
    out: dict = {}
    _diff(_plain(old), _plain(new), "", out)
    return {k: (None if a is _ABSENT else a, None if b is _ABSENT else b) for k, (a, b) in out.items()}


def show(value: Any, limit: int = 60) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resume_changes(saved: RunConfig | dict, cfg: RunConfig, where: str) -> dict[str, tuple[Any, Any]]:
    """The changes of ``cfg`` from the ``saved`` config of the run at ``where`` (a run directory),
    once all of them are resumable; otherwise ConfigError naming each field that is not."""
    changes = config_changes(saved, cfg)
    refused = [k for k in changes if not resumable(k)]
    if refused:
        named = ", ".join(f"{k} {show(changes[k][0])} -> {show(changes[k][1])}" for k in refused[:_SHOWN])
        more = f" and {len(refused) - _SHOWN} more" if len(refused) > _SHOWN else ""
        raise ConfigError(f"{where} holds checkpoints of a run with other settings, which a resume cannot change: "
                          f"{named}{more}; use another --out for these settings, or resume with the run's own")
    return changes
