"""JSON for the frozen dataclass records, so that evidence and diagnoses are stored whole.

Enums become their values, datetimes ISO 8601 in UTC, tuples and frozensets lists, mappings
objects (string keys only); decoding walks the dataclass's type hints back, so a stored record
comes back equal to the one saved.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import Enum
from typing import Any, TypeVar, cast

T = TypeVar("T")

JsonValue = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]


class CodecError(ValueError):
    """A value that cannot be written as JSON, or JSON that does not fit the record asked for."""


def to_json(value: object) -> JsonValue:
    """A JSON-ready value for `value`; naive datetimes are refused, not guessed at."""
    if isinstance(value, Enum):
        return cast(JsonValue, value.value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise CodecError(f"naive datetime {value.isoformat()} has no time zone")
        return value.astimezone(UTC).isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: to_json(getattr(value, field.name)) for field in dataclasses.fields(value)
        }
    if isinstance(value, tuple | list):
        return [to_json(item) for item in value]
    if isinstance(value, frozenset | set):
        encoded = [to_json(item) for item in value]
        return sorted(encoded, key=repr)
    if isinstance(value, Mapping):
        return {_json_key(key): to_json(item) for key, item in value.items()}
    raise CodecError(f"cannot write {type(value).__name__} as JSON")


def _json_key(key: object) -> str:
    if isinstance(key, Enum):
        return str(key.value)
    if isinstance(key, str):
        return key
    raise CodecError(f"JSON object keys must be strings, not {type(key).__name__}")


def from_json(record_type: type[T], data: object) -> T:
    """The record of `record_type` that `to_json` wrote as `data`."""
    return cast(T, _decode(record_type, data, record_type.__name__))


def _decode(hint: Any, data: object, where: str) -> object:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if data is None and type(None) in options:
            return None
        errors: list[str] = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _decode(option, data, where)
            except CodecError as error:
                errors.append(str(error))
        raise CodecError(f"{where}: no type of {hint} fits: {'; '.join(errors)}")
    if origin is tuple:
        args = typing.get_args(hint)
        items = _expect_list(data, where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], item, f"{where}[{i}]") for i, item in enumerate(items))
        if len(args) != len(items):
            raise CodecError(f"{where}: expected {len(args)} items, found {len(items)}")
        return tuple(
            _decode(arg, item, f"{where}[{i}]")
            for i, (arg, item) in enumerate(zip(args, items, strict=True))
        )
    if origin is frozenset:
        (item_hint,) = typing.get_args(hint)
        items = _expect_list(data, where)
        return frozenset(_decode(item_hint, item, f"{where}[{i}]") for i, item in enumerate(items))
    if origin in (dict, Mapping):
        key_hint, item_hint = typing.get_args(hint)
        if key_hint is not str:
            raise CodecError(f"{where}: only string keys decode, not {key_hint!r}")
        if not isinstance(data, dict):
            raise CodecError(f"{where}: expected an object, found {type(data).__name__}")
        return {key: _decode(item_hint, item, f"{where}.{key}") for key, item in data.items()}
    if isinstance(hint, type):
        return _decode_class(hint, data, where)
    raise CodecError(f"{where}: cannot decode type {hint!r}")


def _decode_class(hint: type, data: object, where: str) -> object:
    if dataclasses.is_dataclass(hint):
        return _decode_dataclass(hint, data, where)
    if issubclass(hint, Enum):
        try:
            return hint(data)
        except ValueError as error:
            raise CodecError(f"{where}: {data!r} is not a {hint.__name__}") from error
    if hint is datetime:
        if not isinstance(data, str):
            raise CodecError(
                f"{where}: expected an ISO datetime string, found {type(data).__name__}"
            )
        try:
            parsed = datetime.fromisoformat(data)
        except ValueError as error:
            raise CodecError(f"{where}: {data!r} is not an ISO datetime") from error
        if parsed.tzinfo is None:
            raise CodecError(f"{where}: datetime {data!r} has no time zone")
        return parsed
    if hint is bool:
        if not isinstance(data, bool):
            raise CodecError(f"{where}: expected a boolean, found {type(data).__name__}")
        return data
    if hint is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise CodecError(f"{where}: expected an integer, found {type(data).__name__}")
        return data
    if hint is float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise CodecError(f"{where}: expected a number, found {type(data).__name__}")
        return float(data)
    if hint is str:
        if not isinstance(data, str):
            raise CodecError(f"{where}: expected a string, found {type(data).__name__}")
        return data
    raise CodecError(f"{where}: cannot decode type {hint.__name__}")


def _decode_dataclass(record_type: type, data: object, where: str) -> object:
    if not isinstance(data, dict):
        raise CodecError(f"{where}: expected an object, found {type(data).__name__}")
    hints = typing.get_type_hints(record_type)
    fields = {field.name: field for field in dataclasses.fields(record_type) if field.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise CodecError(f"{where}: unknown fields {', '.join(unknown)}")
    values: dict[str, object] = {}
    for name, field in fields.items():
        if name in data:
            values[name] = _decode(hints[name], data[name], f"{where}.{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise CodecError(f"{where}: missing field {name}")
    return record_type(**values)


def _expect_list(data: object, where: str) -> list[object]:
    if not isinstance(data, list):
        raise CodecError(f"{where}: expected a list, found {type(data).__name__}")
    return data
