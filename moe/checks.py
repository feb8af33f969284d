"""The error and the validators the typed configs share (moe/config.py re-exports them)."""

from __future__ import annotations

import dataclasses
from typing import Any


class ConfigError(ValueError):
    """A config.json (or ModelConfig) that is not a valid configuration of a supported MoE."""


def need(cond: bool, msg: str, error: type[Exception] = ConfigError) -> None:
    """Raise `error(msg)` unless `cond`: the one validator the typed configs share."""
    if not cond:
        raise error(msg)


def strict_kwargs(cls: type, d: Any, what: str | None = None,
                  error: type[Exception] = ConfigError) -> dict[str, Any]:
    """`d` checked as keyword arguments of dataclass `cls`: an unknown key raises `error`
    naming it and listing the valid ones ("<what>: unknown keys [...]; valid keys are [...]",
    `what` defaulting to the class name). Returns a copy to pass as `cls(**kw)`."""
    what = what or cls.__name__
    if not isinstance(d, dict):
        raise error(f"{what} must be a mapping, got {type(d).__name__}")
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in d if k not in valid)
    if unknown:
        raise error(f"{what}: unknown keys {unknown}; valid keys are {valid}")
    return dict(d)
