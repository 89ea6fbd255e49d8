"""Typed config trees: frozen dataclasses built from a composed, untyped mapping, with the full key in every error.

Each component owns one frozen `@dataclass(kw_only=True)`; a trainer's root nests them under verl's keys.
Hydra/OmegaConf compose YAML files and command-line overrides into plain values (interpolations resolved);
`build_config` turns those into the dataclass tree, checking every value against its annotation (`Literal`,
unions such as `str | list[str]`, `Optional`, lists, tuples, dicts, nested dataclasses) and running each
class's `__post_init__`. OmegaConf's own structured mode is not used: it rejects `Literal` and unions.

Field docstrings (a string literal under the field) are the `--help` text (`describe_fields`). A field whose
metadata holds `UNSUPPORTED` names a verl key whose feature hybridflow does not have yet: it keeps verl's
default, and any other value is refused with the reason instead of being accepted and ignored.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, Literal, Union

__all__ = [
    "ConfigFieldError",
    "FieldHelp",
    "UNSUPPORTED",
    "build_config",
    "check_at_least",
    "check_choice",
    "check_literal_fields",
    "check_mapping_keys",
    "check_positive",
    "check_range",
    "defaults_tree",
    "describe_fields",
    "unsupported",
]

UNSUPPORTED = "hybridflow_unsupported"
"""Field-metadata key: the reason a verl key accepts only its default value here."""


class ConfigFieldError(ValueError):
    """A bad value found by a component's `__post_init__`; the message starts with the field's name.

    `build_config` prefixes the section's key, so the user reads `actor_rollout_ref.actor.clip_ratio_c=...`.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def unsupported(default: Any, reason: str) -> Any:
    """A dataclass field for a verl key whose feature is missing: only `default` is accepted."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={UNSUPPORTED: reason})
    return dataclasses.field(default=default, metadata={UNSUPPORTED: reason})


def changed_leaves(key: str, value: Any, default: Any) -> list[tuple[str, Any, Any]]:
    """(key, value, default) of each leaf under the dotted `key` whose value differs from its default; a section (a
    dataclass) is walked field by field, so the keys named are the ones a command line sets."""
    if value == default:
        return []
    if dataclasses.is_dataclass(value) and type(value) is type(default):
        return [leaf for item in dataclasses.fields(value)
                for leaf in changed_leaves(f"{key}.{item.name}", getattr(value, item.name), getattr(default, item.name))]
    return [(key, value, default)]


# ----------------------------------------------------------------------------- value checks for __post_init__
def check_choice(field: str, value: Any, choices: tuple[Any, ...]) -> None:
    """Raise unless `value` is one of `choices`."""
    if value not in choices:
        raise ConfigFieldError(field, f"{field}={value!r} is not one of {list(choices)}")


def check_positive(field: str, value: float | int | None, allow_none: bool = False) -> None:
    """Raise unless `value` > 0 (or None when allowed)."""
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigFieldError(field, f"{field}={value!r} must be > 0")


def check_micro_batch(field: str, value: int | None, budget_field: str, cut_by_tokens: bool) -> None:
    """A micro-batch size in rows: > 0, or None (verl's default) where token budgets cut the micro-batches
    (`budget_field`=True) and the row count is not read."""
    if value is None and not cut_by_tokens:
        raise ConfigFieldError(
            field,
            f"{field}=None with {budget_field}=False: micro-batches are cut by rows, so give their size; set {field} "
            f"to a row count or {budget_field}=True (verl asks the same)",
        )
    check_positive(field, value, allow_none=True)


ROWS_UNREAD = 1
"""The engine's micro-batch rows where token budgets cut the micro-batches (a null size): never read there."""


def check_at_least(field: str, value: float | int, minimum: float | int, why: str = "") -> None:
    """Raise unless `value` >= `minimum`."""
    if value < minimum:
        raise ConfigFieldError(field, f"{field}={value!r} must be >= {minimum}{f' ({why})' if why else ''}")


def check_range(field: str, value: float, low: float, high: float, *, low_open: bool = False,
                high_open: bool = False) -> None:
    """Raise unless `value` lies in the interval from `low` to `high` (open ends where asked)."""
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigFieldError(field, f"{field}={value!r} must be in {interval}")


def check_mapping_keys(data: Any, where: str, allowed: set[str], required: set[str] = frozenset()) -> None:
    """Raise ValueError unless `data` is a mapping with all `required` and only `allowed` keys (a YAML entry or
    schema: `where` names it)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}: {data!r}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; allowed keys are {sorted(allowed)}")
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"{where} is missing keys {missing}; add them")


def check_literal_fields(instance: Any) -> None:
    """Raise unless every `Literal` field (and every entry of a `list[Literal]` field) of a dataclass instance
    holds one of its choices; `build_config` checks this too, this covers configs built directly in Python."""
    for name, tp in _hints(type(instance)).items():
        value = getattr(instance, name)
        if typing.get_origin(tp) is list and typing.get_args(tp):
            tp, values = typing.get_args(tp)[0], list(value)
        else:
            values = [value]
        if typing.get_origin(tp) is Literal:
            for entry in values:
                check_choice(name, entry, typing.get_args(tp))


# ----------------------------------------------------------------------------- defaults and building
def _field_default(item: dataclasses.Field) -> Any:
    if item.default is not MISSING:
        return item.default
    if item.default_factory is not MISSING:
        return item.default_factory()
    return MISSING


def _plain(value: Any) -> Any:
    """Dataclass instances, tuples and nested containers as dicts and lists (what OmegaConf stores)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {item.name: _plain(getattr(value, item.name)) for item in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(entry) for entry in value]
    if isinstance(value, Mapping):
        return {key: _plain(entry) for key, entry in value.items()}
    return value


def defaults_tree(cls: type) -> dict[str, Any]:
    """Every field's default as a nested dict of plain values (required fields are left out)."""
    tree = {}
    for item in dataclasses.fields(cls):
        default = _field_default(item)
        if default is not MISSING:
            tree[item.name] = _plain(default)
    return tree


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def build_config(cls: type, values: Mapping[str, Any], key: str = "") -> Any:
    """The frozen `cls` from plain `values`; a ValueError names the full key (`key.field`) and the fix.

    Missing fields take their defaults; unknown ones are refused.
    """
    if not isinstance(values, Mapping):
        raise ValueError(f"{key or 'config'} must be a mapping of keys to values, got {values!r}")
    hints, fields = _hints(cls), {item.name: item for item in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown key {_join(key, unknown[0])}; known keys of {key or 'the config'}: {sorted(fields)} "
            "(`--help` lists them with their docs)"
        )
    kwargs = {}
    for name, item in fields.items():
        full = _join(key, name)
        if name not in values:
            if _field_default(item) is MISSING:
                raise ValueError(f"{full} is required; set {full}=<value>")
            continue
        value = _convert(hints[name], values[name], full)
        reason = item.metadata.get(UNSUPPORTED)
        if reason is not None and value != _field_default(item):
            raise ValueError(
                f"{full}={values[name]!r} is not supported by hybridflow yet: {reason}; leave it at its default "
                f"{_plain(_field_default(item))!r}"
            )
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigFieldError as err:
        raise ValueError(_qualify(str(err), key, fields)) from None


def _qualify(message: str, key: str, fields: Mapping[str, Any]) -> str:
    """A section's message with every `field=` of that section written as its full key."""
    if not key:
        return message
    names = "|".join(sorted((re.escape(name) for name in fields), key=len, reverse=True))
    return re.sub(rf"(?<![\w.\[])({names})(?=[=\[])", rf"{key}.\1", message)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _convert(tp: Any, value: Any, key: str) -> Any:
    """`value` checked (and minimally coerced) against the annotation `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else build_config(tp, value, key)
    if origin in (Union, types.UnionType):
        return _convert_union(args, value, key)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{key}={value!r} is not one of {list(args)}")
        return value
    if tp is type(None):
        if value is not None:
            raise ValueError(f"{key} must be null, got {value!r}")
        return None
    if origin in (list, tuple):
        return _convert_sequence(tp, origin, args, value, key)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
        value_type = args[1] if args else Any
        return {name: _convert(value_type, entry, f"{key}.{name}") for name, entry in value.items()}
    return _convert_scalar(tp, value, key)


def _convert_union(args: tuple[Any, ...], value: Any, key: str) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise ValueError(f"{key} may not be null")
    errors = []
    for option in (arg for arg in args if arg is not type(None)):
        try:
            return _convert(option, value, key)
        except ValueError as err:
            errors.append(str(err))
    raise ValueError(f"{key}={value!r} matches none of {[_type_name(arg) for arg in args]} ({errors[-1]})")


def _convert_sequence(tp: Any, origin: type, args: tuple[Any, ...], value: Any, key: str) -> Any:
    item_types = [args[0]] if origin is list or (len(args) == 2 and args[1] is Ellipsis) else list(args)
    if isinstance(value, str) and len(item_types) == 1 and _is_text(item_types[0]):
        value = [value]  # verl accepts `data.train_files=/path/train.parquet` for a one-file list
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} must be a list ({_type_name(tp)}), got {value!r}")
    if len(item_types) > 1 and len(value) != len(item_types):
        raise ValueError(f"{key} needs {len(item_types)} entries ({_type_name(tp)}), got {list(value)}")
    types_per_item = item_types * len(value) if len(item_types) == 1 else item_types
    converted = [_convert(item, entry, f"{key}[{index}]") for index, (item, entry) in enumerate(zip(types_per_item, value))]
    return converted if origin is list else tuple(converted)


def _is_text(tp: Any) -> bool:
    """str, or a Literal of strings."""
    return tp is str or (typing.get_origin(tp) is Literal and all(isinstance(arg, str) for arg in typing.get_args(tp)))


def _convert_scalar(tp: Any, value: Any, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads `1e-5` (no dot) as a string
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `trainer.experiment_name=42` arrives as an int
    else:
        raise TypeError(f"{key}: config fields of type {tp!r} are not supported by build_config")
    raise ValueError(f"{key}={value!r} must be {_type_name(tp)}")


# ----------------------------------------------------------------------------- --help
@dataclass(frozen=True)
class FieldHelp:
    """One key of a config tree, as `--help` prints it."""

    key: str
    type_name: str
    default: Any
    doc: str
    unsupported: str | None = None


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is Literal:
        return " | ".join(repr(arg) if isinstance(arg, str) else str(arg) for arg in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join('...' if arg is Ellipsis else _type_name(arg) for arg in args)}]"
    return getattr(tp, "__name__", str(tp))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of `cls` and its bases (the string literal after the annotation)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for statement, following in zip(body, body[1:]):
            is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and is_doc:
                docs[statement.target.id] = " ".join(str(following.value.value).split())
    return docs


def describe_fields(cls: type, prefix: str = "", derived: Mapping[str, str] | None = None,
                    defaults: Mapping[str, Any] | None = None) -> Iterator[FieldHelp]:
    """Every leaf key below `cls` with type, default (an interpolation where `derived` names one) and doc.

    `defaults` are the section's own defaults when its parent sets them (e.g. the critic's learning rate).
    """
    derived = derived or {}
    defaults = defaults_tree(cls) if defaults is None else defaults
    hints, docs = _hints(cls), field_docs(cls)
    for item in dataclasses.fields(cls):
        key, tp = _join(prefix, item.name), hints[item.name]
        if dataclasses.is_dataclass(tp):
            yield from describe_fields(tp, key, derived, defaults.get(item.name))
            continue
        default = derived.get(key, defaults.get(item.name, "<required>"))
        yield FieldHelp(key, _type_name(tp), default, docs.get(item.name, ""), item.metadata.get(UNSUPPORTED))
