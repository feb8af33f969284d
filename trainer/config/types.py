"""The building blocks of the experiment config's section models (trainer/config/sections.py): one
error type, strict section models, float fields that take numeric strings, and the strict
reading of the sections that are dataclasses of lower folders (`dataclass_section`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WrapValidator, create_model
from pydantic_core import PydanticCustomError

from lockstep.moe.checks import ConfigError
from lockstep.replay import ReplayMode


class ExperimentConfigError(ConfigError):
    """An experiment YAML file or override that does not describe a valid experiment (the
    one error type of a bad config: a ConfigError, as a bad model config.json is)."""


def need(cond: bool, msg: str) -> None:
    if not cond:
        raise ExperimentConfigError(msg)


_NUMBER = re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$")


def _number(v: Any) -> Any:
    """A float field also takes a numeric string (YAML 1.1 writers quote `3e-4`) and refuses
    an integer too large for a float by name."""
    if isinstance(v, str) and _NUMBER.match(v.strip()):
        v = float(v)
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:
            raise PydanticCustomError("float_overflow", "too large for a float") from None
    return v


Float = Annotated[float, BeforeValidator(_number)]
STRICT = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True,
                    arbitrary_types_allowed=True)


class Section(BaseModel):
    """A config section: strict types, unknown keys refused, one docstring line per field."""

    model_config = STRICT


def _float_typed(tp: Any) -> Any:
    """`tp` with every `float` replaced by `Float` (inside unions and lists too)."""
    if tp is float:
        return Float
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        union = Union[tuple(_float_typed(a) for a in args)]
        if len([a for a in args if a is not type(None)]) == 1:
            return union
        # members tried in the written order (float before str: "2.0" is a number, "1_5" not)
        return Annotated[union, Field(union_mode="left_to_right")]
    if origin is list:
        return list[_float_typed(args[0])] if args else list
    return tp


@functools.cache
def _mirror(cls: type) -> type[BaseModel]:
    """A strict model with the fields, types and defaults of dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        default = (Field(default_factory=f.default_factory)
                   if f.default_factory is not dataclasses.MISSING else f.default)
        tp = _float_typed(hints[f.name])
        if isinstance(tp, type) and issubclass(tp, ReplayMode):
            tp = Annotated[tp, Field(strict=False)]
        fields[f.name] = (tp, default)
    return create_model(f"{cls.__name__}Fields", __config__=STRICT, **fields)


def dataclass_section(cls: type) -> Any:
    """Field type of a section that is dataclass `cls`: a mapping is checked as `cls`'s fields
    (strict, unknown keys refused, each error naming its key), then `cls(**given)` runs the
    class's own checks (a failure reads "<section>: <message>"); a `cls` instance passes."""

    def validate(value: Any, handler) -> Any:
        if isinstance(value, cls):
            return value
        given = handler(value)
        try:
            return cls(**{k: getattr(given, k) for k in given.model_fields_set})
        except (ValueError, TypeError, ArithmeticError, KeyError, IndexError) as e:
            raise PydanticCustomError("section", "{error}", {"error": str(e)}) from None

    return Annotated[_mirror(cls), WrapValidator(validate)]


# Saved-config compatibility, one rule. A field's metadata (pydantic `json_schema_extra`, a
# dataclass field's `metadata`) may hold:
#   "saved": "non_default"    left out of config.yaml (and so of the run hash) at its default:
#                             the fields added after the first release, so config files and
#                             run hashes written before them stay the same bytes
#   "saved": "family_default" the same, at the value its model family gives it
#                             (`ModelConfig.family_default`)
#   "saved": False            never saved (a preset: config.yaml holds the fields it set)
#   "hashed": "non_default"   left out of the run hash at its default (config.yaml keeps it)
#   "hashed": False           never in the run hash: it changes no number
# `compat_form` is the one pass that applies them; lower folders' dataclasses write the same
# plain dicts in their field metadata.
LATER = {"saved": "non_default"}
HASHED_LATER = {"hashed": "non_default"}
NOT_HASHED = {"hashed": False}


def _kept(obj: Any, name: str, default: Any, meta: Any, rules: tuple[str, ...]) -> bool:
    value = getattr(obj, name)
    for rule in rules:
        how = (meta or {}).get(rule)
        if how is False or (how == "non_default" and value == default) or (
                how == "family_default" and value == obj.family_default(name)):
            return False
    return True


def compat_form(obj: Any, *rules: str) -> Any:
    """`plain(obj)` without the fields whose `rules` ("saved", "hashed") leave them out, in
    every section and sub-section (the rule above)."""
    if isinstance(obj, BaseModel):
        return {k: compat_form(getattr(obj, k), *rules) for k, f in type(obj).model_fields.items()
                if _kept(obj, k, f.get_default(call_default_factory=True), f.json_schema_extra,
                         rules)}
    if dataclasses.is_dataclass(obj):
        d = dataclasses.asdict(obj)
        for f in dataclasses.fields(obj):
            default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                       else f.default)
            if not _kept(obj, f.name, default, f.metadata, rules):
                d.pop(f.name)
        return d
    return plain(obj)


def plain(obj: Any) -> Any:
    """Sections as nested dicts in field order (enums kept), as `dataclasses.asdict` gives."""
    if isinstance(obj, BaseModel):
        return {k: plain(getattr(obj, k)) for k in type(obj).model_fields}
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj
