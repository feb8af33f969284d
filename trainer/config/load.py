"""The experiment configuration file: YAML 1.2 reading, `--set` overrides, one-line errors.

The sections are strict pydantic models (trainer/config/sections.py); this module reads them from a
YAML file plus dotted overrides and writes them back:

    cfg = load_config("configs/toy_r3.yaml", overrides=["actor.lr=1e-4", "replay.mode=off"])

Sections: `model` (HF Qwen3-MoE fields, or `path` to an HF folder), `task`, `data` (prompt data
sets), `reward`, `rollout` (engine), `actor`, `replay`, `correction` (rollout correction, verl
semantics), `advantage`, `loss`, `warmstart`, `loop`, `cluster`. Every bad value is an
ExperimentConfigError whose one-line message names the dotted key: unknown keys with the list
of valid ones (and the closest), wrong types, values outside their bounds, choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError

from lockstep.moe.checkpoint import folder_config
from lockstep.trainer.config.experiment import ExperimentConfig
from lockstep.trainer.config.sections import (BOUND_REASONS,
                                              RolloutConfig)
from lockstep.trainer.config.types import ExperimentConfigError, need
from lockstep.trainer.objective.presets import expand_preset


# -- reading -------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """YAML 1.2 core-schema scalars: only true/false are booleans (so `mode: off` stays the
    string 'off'), `3e-4` is a number, and `1_5` / `1:30` stay strings (IcePop "1_5")."""


    def construct_mapping(self, node, deep=False):
        """Refuse duplicate keys (PyYAML silently keeps the last), naming key and lines."""
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                mark = key_node.start_mark
                try:
                    first = seen.setdefault(key, mark)
                except TypeError:
                    continue  # unhashable: the base class raises its own error
                if first is not mark:  # one line (a flow mapping, `--set a={k: 1, k: 2}`) too
                    where = (f"lines {first.line + 1} and {mark.line + 1}"
                             if first.line != mark.line else
                             f"line {mark.line + 1}, columns {first.column + 1} and "
                             f"{mark.column + 1}")
                    raise ExperimentConfigError(
                        f"duplicate key {key!r} at {where} (YAML would silently keep the last)")
        return super().construct_mapping(node, deep)


_STRICT = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in _STRICT]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _tag, _rx, _first in (
        ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
        ("tag:yaml.org,2002:int", r"^[-+]?[0-9]+$", "-+0123456789"),
        ("tag:yaml.org,2002:float",
         r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
         r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", "-+.0123456789")):
    _Loader.add_implicit_resolver(_tag, re.compile(_rx), list(_first))


def _yaml_load(text: str) -> Any:
    """Parse YAML text; any failure is an ExperimentConfigError (e.g. a bad date, deep nesting)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except ExperimentConfigError:
        raise
    except yaml.YAMLError as e:
        raise ExperimentConfigError(f"not valid YAML: {e}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise ExperimentConfigError(f"not valid YAML: {type(e).__name__}: {e}") from None


# -- the sections' types, by dotted key --------------------------------------------------------
def _inner(tp: Any) -> list[Any]:
    """The types inside Annotated / Optional / unions / lists of `tp`, `tp` first."""
    out, todo = [], [tp]
    while todo:
        t = todo.pop(0)
        out.append(t)
        if typing.get_origin(t) is not Literal:  # a Literal's arguments are values
            todo.extend(typing.get_args(t))
    return out


def _section_of(tp: Any) -> type[BaseModel] | None:
    """The section model a field of type `tp` holds (None for a plain value)."""
    return next((t for t in _inner(tp) if isinstance(t, type) and issubclass(t, BaseModel)),
                None)


def _choices(tp: Any) -> list[Any] | None:
    """The values a Literal / enum field takes (None last where it is optional)."""
    inner = _inner(tp)
    none = [None] if type(None) in inner else []
    for t in inner:
        if typing.get_origin(t) is Literal:
            return list(typing.get_args(t)) + none
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return [m.value for m in t] + none
    return None


def _walk(loc: tuple) -> tuple[str, Any, type[BaseModel] | None]:
    """(dotted key, field info of its last field, section model it points into) of an error
    location; union member tags in `loc` are skipped, list indices read `[i]`."""
    section: Any = ExperimentConfig
    key, info = "", None
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        elif section is not None and part in section.model_fields:
            info = section.model_fields[part]
            key = f"{key}.{part}" if key else part
            section = _section_of(info.annotation)
    return key, info, section


def _bounds(info: Any) -> str:
    """The interval a field's bounds enforce, open or closed at each end as they are."""
    lo = hi = None
    lo_open = hi_open = False
    for m in getattr(info, "metadata", ()):
        if isinstance(m, annotated_types.Ge):
            lo = m.ge
        elif isinstance(m, annotated_types.Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, annotated_types.Le):
            hi = m.le
        elif isinstance(m, annotated_types.Lt):
            hi, hi_open = m.lt, True
    lo_s = "(-inf, " if lo is None else f"{'(' if lo_open else '['}{lo}, "
    return lo_s + ("inf)" if hi is None else f"{hi}{')' if hi_open else ']'}")


_MESSAGES = {
    "must be an integer": ("int_type", "int_from_float", "int_parsing"),
    "must be a number": ("float_type", "float_parsing"),
    "must be true or false": ("bool_type", "bool_parsing"),
    "must be a string": ("string_type",),
    "must be a list": ("list_type",),
    "must be a mapping": ("model_type", "model_attributes_type", "dict_type", "dataclass_type"),
}
_KIND = {t: msg for msg, types in _MESSAGES.items() for t in types}
_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _closest(unknown: list[str], names: list[str], prefix: str) -> str:
    """'; did you mean 'a.b'?' for the valid key closest to each unknown one (none: '')."""
    near = [m[0] for k in unknown if (m := difflib.get_close_matches(k, names, n=1, cutoff=0.6))]
    return f"; did you mean {', '.join(repr(prefix + m) for m in near)}?" if near else ""


def _message(err: ValidationError) -> str:
    """The one line that names the first problem of a failed validation."""
    errors = err.errors()
    # a key that is not a string (YAML `1: 2`) is as unknown as a misspelled one
    extra = [e for e in errors if e["type"] in ("extra_forbidden", "invalid_key")]
    if extra:
        where, _, section = _walk(extra[0]["loc"][:-1])
        names = list(section.model_fields)
        unknown = sorted(str(e["loc"][-1]) for e in extra if e["loc"][:-1] == extra[0]["loc"][:-1])
        prefix = f"{where}." if where else ""
        return (f"unknown key(s) {[prefix + k for k in unknown]}; valid keys"
                f"{' in ' + where if where else ''} are {names}{_closest(unknown, names, prefix)}")
    e = errors[0]
    where, info, _ = _walk(e["loc"])
    kind, v = e["type"], e.get("input")
    if kind in _KIND:
        return f"{where} {_KIND[kind]}, got {v!r}"
    if kind == "missing":
        return f"{where} is required (no default)"
    if kind == "float_overflow":
        return f"{where}={v!r} is too large for a float"
    if kind in ("literal_error", "enum"):
        return f"{where}={v!r} is not one of {_choices(info.annotation) if info else '?'}"
    if kind in _BOUNDS:
        if isinstance(v, int) and float in _inner(info.annotation):
            v = float(v)
        why = BOUND_REASONS.get(where) if kind.startswith("greater") else None
        return f"{where}={v!r} is outside {_bounds(info)}{'; ' + why if why else ''}"
    if kind == "value_error" and isinstance(e.get("ctx", {}).get("error"), ExperimentConfigError):
        return str(e["ctx"]["error"])
    msg = str(e["ctx"]["error"]) if kind in ("section", "value_error") else e["msg"]
    return msg if where and msg.startswith(where + ".") else f"{where or 'config'}: {msg}"


def check(cls: type[BaseModel], data: Any) -> Any:
    """`cls` (a section, or the whole ExperimentConfig) validated from plain data; a bad value
    is an ExperimentConfigError with the one-line message."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ExperimentConfigError(_message(e)) from None


# -- overrides ----------------------------------------------------------------------------
def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a', 'b', 'c'], YAML-parsed value)."""
    key, sep, raw = text.partition("=")
    need(bool(sep) and bool(key.strip()), f"override {text!r} must look like key.sub=value")
    try:
        value = _yaml_load(raw) if raw.strip() else ""
    except ExperimentConfigError as e:
        raise ExperimentConfigError(f"override {text!r}: value is {e}") from None
    return key.strip().split("."), value


def _merge(old: Any, new: Any, section: type[BaseModel] | None) -> Any:
    """`--set section={...}` onto what the file gave: a section mapping is merged key by key
    (the file's other keys kept), anything else replaced."""
    if section is None or not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out = dict(old)
    for k, v in new.items():
        info = section.model_fields.get(k)
        out[k] = _merge(old.get(k), v, _section_of(info.annotation) if info else None)
    return out


def _apply_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node, section = data, ExperimentConfig
    for i, part in enumerate(path):
        names = list(section.model_fields) if section is not None else []
        need(part in names, f"override key {'.'.join(path)!r}: {part!r} is not a valid key of "
                            f"{'.'.join(path[:i]) or 'the config'}; valid keys are {names}"
                            f"{_closest([part], names, '.'.join(path[:i] + ['']))}")
        section = _section_of(section.model_fields[part].annotation)
        if i == len(path) - 1:
            node[part] = _merge(node.get(part), value, section)
            return
        node = node.setdefault(part, {})
        need(isinstance(node, dict), f"override {'.'.join(path)}: {part} is not a section")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                ) -> ExperimentConfig:
    """Read an experiment YAML (None = all defaults) and apply `key.sub=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        need(not path.is_dir(), f"{path} is a directory, not an experiment YAML file")
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ExperimentConfigError(f"no config file at {path}") from None
        except UnicodeDecodeError:
            raise ExperimentConfigError(f"{path} is not a text (UTF-8) file") from None
        except OSError as e:
            raise ExperimentConfigError(f"cannot read {path}: {e.strerror or e}") from None
        try:
            data = _yaml_load(text)
        except ExperimentConfigError as e:
            raise ExperimentConfigError(f"{path}: {e}") from None
        need(data is not None, f"{path} is empty (or only comments): refusing to start an "
                                f"all-defaults run; start from configs/toy_r3.yaml")
        need(isinstance(data, dict), f"{path}: top level must be a mapping of sections")
    # correction presets, one source at a time: the file's preset is expanded against the
    # file's fields, a `--set` one against the command line's, and the command line wins
    file_corr = _expanded_correction(data.pop("correction", None), f"{path}: ")
    for text in overrides or []:
        key, value = parse_override(text)
        if key == ["rollout", "api_key"]:
            _refuse_secrets({"rollout": {"api_key": value or "?"}}, None)
        _apply_override(data, key, value)
    cli_corr = _expanded_correction(data.pop("correction", None), "")
    if isinstance(file_corr, dict) and isinstance(cli_corr, dict):
        data["correction"] = {**file_corr, **cli_corr}
    elif cli_corr is not None or file_corr is not None:
        data["correction"] = cli_corr if cli_corr is not None else file_corr
    _refuse_secrets(data, path)
    if isinstance(data.get("model"), dict) and data["model"].get("path") is not None:
        data["model"] = _model_from_folder(data["model"])
    try:
        return check(ExperimentConfig, data)
    except ExperimentConfigError as e:
        raise ExperimentConfigError(f"{path}: {e}" if path else str(e)) from None


def _expanded_correction(section: Any, where: str) -> Any:
    """One source's `correction` mapping with its `preset` expanded to the preset's fields
    (a field of the same source that differs from the preset's is refused, naming both)."""
    if not isinstance(section, dict):
        return section
    try:
        return expand_preset(section)
    except ValueError as e:
        raise ExperimentConfigError(f"{where}{e}") from None


def _refuse_secrets(data: dict[str, Any], path: Path | None) -> None:
    """`rollout.api_key` is not a config field: a key in a file or on the command line would be
    saved in DIR/config.yaml and visible in `ps`. (A null one, as in run directories written
    by older versions, is dropped.)"""
    ro = data.get("rollout")
    if isinstance(ro, dict) and "api_key" in ro:
        need(ro["api_key"] is None,
              f"{str(path) + ': ' if path else ''}rollout.api_key: secrets are not taken from "
              f"config files or --set (they would be saved in the run directory and show in "
              f"`ps`); export LOCKSTEP_API_KEY or set rollout.api_key_file to a file holding it")
        ro.pop("api_key")


def rollout_api_key(ro: RolloutConfig) -> str | None:
    """The http backend's bearer token: the first line of `rollout.api_key_file`, else the
    LOCKSTEP_API_KEY environment variable, else None."""
    if ro.api_key_file:
        try:
            key = Path(ro.api_key_file).expanduser().read_text().strip().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ExperimentConfigError(f"rollout.api_key_file={ro.api_key_file!r}: cannot "
                                        f"read it ({getattr(e, 'strerror', None) or e})") from None
        need(bool(key) and bool(key[0].strip()),
              f"rollout.api_key_file={ro.api_key_file!r} is empty")
        return key[0].strip()
    return os.environ.get("LOCKSTEP_API_KEY") or None


def _model_from_folder(section: dict[str, Any]) -> dict[str, Any]:
    """The `model` section of `model.path: DIR`: the fields of DIR/config.json; fields given
    next to `path` must equal the folder's (a saved config repeats them all)."""
    path = section["path"]
    need(isinstance(path, str), f"model.path must be a string, got {path!r}")
    try:
        folder = dataclasses.asdict(folder_config(Path(path).expanduser()))
    except ValueError as e:
        raise ExperimentConfigError(f"model.path={path!r}: {e}") from None
    differ = [f"model.{k}={v!r} (the folder has {folder[k]!r})" for k, v in section.items()
              if k != "path" and k in folder and _plain(v) != _plain(folder[k])]
    need(not differ, f"model.path={path!r} gives the architecture, but {', '.join(differ)}; "
                      "drop those keys")
    return {**section, **{k: v for k, v in folder.items() if k != "path"}}


def _plain(v: Any) -> Any:
    return json.loads(json.dumps(v))


def save_config(cfg: ExperimentConfig, path: str | Path) -> None:
    """Write the resolved config (atomically); `load_config` reads it back to an equal config.
    It holds no secret (see `rollout_api_key`)."""
    d = json.loads(json.dumps(cfg.to_dict(), default=lambda o: getattr(o, "value", str(o))))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # a planted link there: replaced, never written through
    tmp.write_text(yaml.safe_dump(d, sort_keys=False))
    tmp.replace(path)
