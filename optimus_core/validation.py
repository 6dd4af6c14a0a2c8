"""Validated dataclasses: every field type-checked against its annotation, then its own rules;
an error names the field, the bad value and what is allowed (optimus_core.config's concerns).

    class OptimConfig(Validated): _section = "optim"; lr: float = 4e-4; def check(self): ...
    from_dict(RunConfig, mapping)     # nested mappings to nested configs; unknown keys refused
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import fields
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and what is allowed."""


# ----------------------------------------------------------------------------- validation helpers

def fail(path: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{path} = {value!r}: {allowed}")


def _check_type(path: str, value: Any, tp: Any) -> Any:
    """Check (and where lossless, coerce) ``value`` against annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        candidates = [a for a in args if a is not type(None)]
        if len(candidates) == 1:  # Optional[X]: X's own message is the helpful one
            return _check_type(path, value, candidates[0])
        for arg in candidates:
            try:
                return _check_type(path, value, arg)
            except ConfigError:
                pass
        fail(path, value, f"must be {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            fail(path, value, f"must be one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (tuple,):
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            fail(path, value, f"must be a sequence of {len(args)} values")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check_type(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(value) != len(args):
            fail(path, value, f"must have exactly {len(args)} values")
        return tuple(_check_type(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return from_dict(tp, value, path)
        fail(path, value, f"must be a mapping for {tp.__name__}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        fail(path, value, "must be true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            fail(path, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(path, value, "must be a number")
        if not math.isfinite(value):
            fail(path, value, "must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(path, value, "must be a string")
        return value
    return value


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return getattr(tp, "__name__", str(tp))


class Validated:
    """Base: type-checks every field against its annotation, then calls ``check()``."""

    _section: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = _check_type(self._path(f.name), getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
        self.check()

    def _path(self, name: str) -> str:
        return f"{self._section}.{name}" if self._section else name

    def _require(self, ok: bool, name: str, allowed: str) -> None:
        if not ok:
            fail(self._path(name), getattr(self, name), allowed)

    def check(self) -> None:  # overridden per concern
        pass

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build ``cls`` from a mapping; unknown keys are an error that lists the known ones."""
    if not isinstance(data, dict):
        fail(path or cls.__name__, data, f"must be a mapping for {cls.__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        dotted = f"{path}.{unknown[0]}" if path else unknown[0]
        if dotted in MOVED or dotted in RETIRED:  # a config an earlier Optimus wrote
            now = f"is {MOVED[dotted]} now" if dotted in MOVED else f"is no longer a choice ({RETIRED[dotted]})"
            raise ConfigError(f"{dotted}: a field of an earlier Optimus's config, which {now}; this Optimus reads "
                              f"its own configs only: use the Optimus that wrote it, or a new run")
        raise ConfigError(f"unknown field {dotted} (in {cls.__name__}); known fields: {', '.join(sorted(known))}")
    return cls(**data)



# ----------------------------------------------------------------------------- former fields
# Names an earlier Optimus's configs used: a ``--set`` of one, or a stored config holding one, is
# refused in one line that says where the choice is now (MOVED) or what runs instead (RETIRED).
MOVED = {
    "train.dtype": "execution.dtype",
    "train.compile": "execution.compile",
    "model.moe.experts_backend": "execution.experts",
    "optim.implementation": "execution.adamw",
    "train.lm_loss_softmax": "execution.lm_loss",
    "train.activation_checkpointing": "execution.activation_checkpointing",
    "train.activation_checkpointing_every": "execution.activation_checkpointing_every",
    "train.memory_budget_gib": "execution.memory_budget_gib",
    "train.recast_expert_weights": "execution.recast_expert_weights",
    "parallel.dispatch": "execution.expert_exchange",
}
RETIRED = {  # old name -> what runs now
    "model.moe.weights_before_down": "the routing weights always scale the SwiGLU output",
    "optim.grad_norm_under_backward": "the clip's norm is always taken under the backward where it can be",
    "optim.grad_norm_from_dw": "the dW kernel's sums of squares are always used where they exist",
    "optim.update_beside_forward": "the update always runs beside the next forward where it can",
    "train.compile_mode": "blocks compile in torch.compile's default mode",
    "train.expert_weight_casts": "the optimizer keeps the experts' bf16 copies wherever they apply",
    "train.expert_grad_dtype": "expert gradients stay in bf16 on the copies wherever that holds",
    "train.fused_lm_loss": "the LM loss is always fused with the head",
    "parallel.grad_sync_chunk_mb": "gradients are reduce-scattered by FSDP2 as each unit's backward ends",
    "parallel.overlap_grad_sync": "gradients are reduce-scattered by FSDP2 as each unit's backward ends",
}
