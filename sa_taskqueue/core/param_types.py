"""Typed params: values JSON cannot hold, stored as plain JSON and handed back as their types.

A task's params are a JSON object in the database, so that SQL, the command
line and the dashboard read them.  Some values an application naturally
passes are not JSON: a `datetime`, a `Decimal`, a `UUID`, an `Enum` member.
Each is stored in one documented, readable encoding (`encode`), the same
value always to the same JSON, so unique and concurrency keys made from
params stay stable; the worker turns the JSON back into the type the task
function's annotation asks for (`converters_for`, read once per function).

The encodings (decoding accepts exactly what encoding writes, and a little more):

- ``datetime``: ISO 8601 with its UTC offset (``2026-05-01T09:30:00+02:00``);
  a naive datetime is refused at enqueue.  A stored string without an offset
  is read as UTC.
- ``date``: ``YYYY-MM-DD``; ``time``: ``HH:MM:SS[.ffffff][+HH:MM]``.
- ``timedelta``: an ISO 8601 duration in days, hours, minutes and seconds
  (``P1DT2H30M``, ``PT0.5S``, ``-PT1H``); read back from such a string or
  from a number of seconds.
- ``Decimal``: its string (``"12.50"``: the digits as given, exponent
  included); read back from that string or a JSON integer.
- ``UUID``: the canonical lower-case hyphenated string.
- an ``Enum`` member: its value (itself encoded); read back by ``EnumClass(value)``.
- a class registered with `register_type`: what its ``encode`` returns.

The registry is the process's: params are encoded wherever a row is made
(``session.add(Task(...))`` included, which knows no queue) and decoded in
every worker, so an application registers its types once, at import, in the
module both import.
"""

from __future__ import annotations

import inspect
import re
import threading
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal, InvalidOperation
from enum import Enum
from typing import Annotated, Any, Union, get_args, get_origin
from uuid import UUID

Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]
#: Turns one stored JSON value into what an annotation asks for; raises `ParamMismatch`.
Converter = Callable[[Any], Any]


class ParamMismatch(Exception):
    """A stored value that cannot become its annotated type; ``path`` says where inside the param."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str] = []


@dataclass(frozen=True)
class ParamType:
    """How one class is stored in params (``encode``: value to JSON) and read back (``decode``)."""

    cls: type[Any]
    encode: Encode
    decode: Decode


# ---------------------------------------------------------------------------------------------
# Encoding


def _encode_datetime(value: datetime) -> str:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"datetimes must be timezone-aware, got naive {value.isoformat()}")
    return value.isoformat()


def _encode_timedelta(value: timedelta) -> str:
    """``value`` as an ISO 8601 duration: one string per value, so keys made from it are stable."""
    sign = "-" if value < timedelta(0) else ""
    value = abs(value)
    days = value.days
    seconds = value.seconds
    hours, rest = divmod(seconds, 3600)
    minutes, whole = divmod(rest, 60)
    text = f"{sign}P"
    if days:
        text += f"{days}D"
    clock = ""
    if hours:
        clock += f"{hours}H"
    if minutes:
        clock += f"{minutes}M"
    if whole or value.microseconds or (not days and not clock):
        fraction = f".{value.microseconds:06d}".rstrip("0") if value.microseconds else ""
        clock += f"{whole}{fraction}S"
    return text + (f"T{clock}" if clock else "")


def _encode_decimal(value: Decimal) -> str:
    return str(value)


_BUILTIN: dict[type[Any], ParamType] = {}


def _builtin(cls: type[Any], encode: Encode, decode: Decode) -> None:
    _BUILTIN[cls] = ParamType(cls, encode, decode)


_registered: dict[type[Any], ParamType] = {}
_lock = threading.Lock()
#: Counts registrations: a task's converters are rebuilt when it has moved on since they were made.
_version = 0


def register_type(cls: type[Any], *, encode: Encode, decode: Decode) -> None:
    """Let params hold instances of ``cls``: stored as ``encode(value)``, handed back as ``decode(json)``.

    ``encode`` must return a JSON value (None, a bool, a number, a string, or
    lists and dicts of these, or any value this registry encodes); the same
    value should always give the same JSON, as unique keys are made from it.
    ``decode`` receives that JSON value when a task function's parameter is
    annotated ``cls`` (or ``list[cls]``, ``cls | None``, ...); an exception
    it raises fails the task, naming the task and the param.  Subclasses of
    ``cls`` are encoded by ``cls``'s ``encode`` unless registered themselves.

    The registry belongs to the process: register at import time, in a module
    both the enqueuing code and the workers import.  Registering a class
    again replaces its encoder and decoder.  The built-in types (datetime,
    date, time, timedelta, Decimal, UUID, Enum) cannot be replaced.
    """
    global _version
    if not isinstance(cls, type):
        raise TypeError(f"register_type takes a class, got {cls!r}")
    if not callable(encode) or not callable(decode):
        raise TypeError(f"encode and decode must be callables, got {encode!r} and {decode!r}")
    if cls in _BUILTIN or issubclass(cls, Enum) or cls in _JSON_TYPES:
        raise ValueError(f"{cls.__qualname__} is stored by sa_taskqueue itself and cannot be registered")
    with _lock:
        _registered[cls] = ParamType(cls, encode, decode)
        _version += 1


def registry_version() -> int:
    """A number that changes with every `register_type`."""
    return _version


_JSON_TYPES = frozenset({str, int, float, bool, type(None), list, tuple, dict})


def param_type_of(cls: type[Any]) -> ParamType | None:
    """How instances of ``cls`` are stored, or None when params cannot hold them."""
    found = _BUILTIN.get(cls) or _registered.get(cls)
    if found is not None:
        return found
    for base in cls.__mro__[1:]:
        found = _BUILTIN.get(base) or _registered.get(base)
        if found is not None:
            return found
    return None


def encode(value: Any) -> tuple[bool, Any]:
    """``(True, json)`` for a value of a known type (an Enum member: its value), else ``(False, None)``.

    The JSON may itself hold values of known types (an Enum whose values are
    dates, a registered encoder returning a dict of Decimals): the caller
    checks and encodes the result again.  An encoder's error propagates.
    """
    if isinstance(value, Enum):
        return True, value.value
    param_type = param_type_of(type(value))
    if param_type is None:
        return False, None
    return True, param_type.encode(value)


# ---------------------------------------------------------------------------------------------
# Decoding


def _expecting(name: str, value: Any, why: str | None = None) -> ParamMismatch:
    shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:60]}..."
    return ParamMismatch(f"cannot be read as {name} from {shown}" + (f": {why}" if why else ""))


def _decode_datetime(value: Any) -> datetime:
    if not isinstance(value, str):
        raise _expecting("a datetime", value, "expected an ISO 8601 string")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError as error:
        raise _expecting("a datetime", value, str(error)) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _decode_date(value: Any) -> date:
    if not isinstance(value, str):
        raise _expecting("a date", value, "expected an ISO 8601 string YYYY-MM-DD")
    try:
        return date.fromisoformat(value)
    except ValueError as error:
        raise _expecting("a date", value, str(error)) from None


def _decode_time(value: Any) -> time:
    if not isinstance(value, str):
        raise _expecting("a time", value, "expected an ISO 8601 string HH:MM:SS")
    try:
        return time.fromisoformat(value)
    except ValueError as error:
        raise _expecting("a time", value, str(error)) from None


_DURATION = re.compile(
    r"(?P<sign>[-+])?P(?:(?P<weeks>\d+(?:\.\d+)?)W)?(?:(?P<days>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<hours>\d+(?:\.\d+)?)H)?(?:(?P<minutes>\d+(?:\.\d+)?)M)?(?:(?P<seconds>\d+(?:\.\d+)?)S)?)?"
)


def _decode_timedelta(value: Any) -> timedelta:
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return timedelta(seconds=value)
        except OverflowError as error:
            raise _expecting("a timedelta", value, str(error)) from None
    if not isinstance(value, str):
        raise _expecting("a timedelta", value, "expected an ISO 8601 duration or a number of seconds")
    match = _DURATION.fullmatch(value)
    if match is None or value.rstrip("T").endswith("P") or value.endswith("T"):
        raise _expecting("a timedelta", value, "expected an ISO 8601 duration such as 'P1DT2H30M'")
    parts = {unit: float(amount) for unit, amount in match.groupdict().items() if unit != "sign" and amount}
    try:
        duration = timedelta(**parts)
    except OverflowError as error:
        raise _expecting("a timedelta", value, str(error)) from None
    return -duration if match["sign"] == "-" else duration


def _decode_decimal(value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise _expecting("a Decimal", value, "expected a decimal string")
    try:
        # (A float goes through its shortest repr: 0.1 becomes Decimal('0.1'), not its binary expansion.)
        return Decimal(repr(value) if isinstance(value, float) else value)
    except InvalidOperation:
        raise _expecting("a Decimal", value) from None


def _decode_uuid(value: Any) -> UUID:
    if not isinstance(value, str):
        raise _expecting("a UUID", value, "expected a string")
    try:
        return UUID(value)
    except ValueError as error:
        raise _expecting("a UUID", value, str(error)) from None


_builtin(datetime, _encode_datetime, _decode_datetime)
_builtin(date, date.isoformat, _decode_date)
_builtin(time, time.isoformat, _decode_time)
_builtin(timedelta, _encode_timedelta, _decode_timedelta)
_builtin(Decimal, _encode_decimal, _decode_decimal)
_builtin(UUID, str, _decode_uuid)


def _enum_converter(cls: type[Enum]) -> Converter:
    def convert(value: Any) -> Enum:
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(repr(member.value) for member in cls)
            raise _expecting(cls.__qualname__, value, f"not one of its values ({known})") from None

    return convert


def _class_converter(param_type: ParamType) -> Converter:
    decode = param_type.decode
    if param_type.cls in _BUILTIN:
        return decode  # (raises ParamMismatch itself)
    name = param_type.cls.__qualname__

    def convert(value: Any) -> Any:
        try:
            return decode(value)
        except Exception as error:  # noqa: BLE001 - an application's decoder may raise anything
            raise _expecting(name, value, f"{type(error).__name__}: {error}") from None

    return convert


def converter_for(hint: Any) -> Converter | None:
    """What turns a stored value into ``hint``'s type, or None where the JSON value is already it.

    Understood: the built-in and registered classes, Enums, ``X | None`` and
    other unions (members tried in the order written), ``list[X]``,
    ``tuple[X, ...]``, ``set[X]``, ``frozenset[X]``, ``dict[str, X]``, and
    ``Annotated[X, ...]`` (its metadata ignored).  Anything else is left as
    JSON, as are untyped params.
    """
    origin = get_origin(hint)
    if origin is Annotated:
        return converter_for(get_args(hint)[0])
    if origin is Union or origin is types.UnionType:
        return _union_converter(get_args(hint))
    if origin in (list, tuple, set, frozenset, typing.Sequence, typing.AbstractSet):
        return _sequence_converter(origin, get_args(hint))
    if origin is dict or origin is Mapping or origin is typing.Mapping:
        args = get_args(hint)
        item = converter_for(args[1]) if len(args) == 2 else None
        return None if item is None else _dict_converter(item)
    if isinstance(hint, type):
        if issubclass(hint, Enum):
            return _enum_converter(hint)
        param_type = param_type_of(hint)
        if param_type is not None:
            return _class_converter(param_type)
    return None


def _union_converter(members: tuple[Any, ...]) -> Converter | None:
    takes_none = type(None) in members
    others = [member for member in members if member is not type(None)]
    converters = [converter_for(member) for member in others]
    if all(converter is None for converter in converters):
        return None
    if len(others) == 1:
        only = converters[0]
        assert only is not None

        def optional(value: Any) -> Any:
            return None if value is None and takes_none else only(value)

        return optional
    # Members left as JSON accept a value already of their kind; the others try to convert it.
    tries: list[tuple[type[Any] | None, Converter | None]] = [
        (_json_kind(member), converter) for member, converter in zip(others, converters, strict=True)
    ]

    def first_fitting(value: Any) -> Any:
        if value is None and takes_none:
            return None
        problems = []
        for kind, converter in tries:
            if converter is None:
                if kind is None or isinstance(value, kind):
                    return value
                continue
            try:
                return converter(value)
            except ParamMismatch as mismatch:
                problems.append(mismatch.problem)
        raise ParamMismatch("fits none of its annotation's types: " + "; ".join(problems))

    return first_fitting


def _json_kind(hint: Any) -> type[Any] | None:
    """The Python class a JSON value must be to fit ``hint`` left unconverted; None: any value fits."""
    origin = get_origin(hint) or hint
    if origin is Annotated:
        return _json_kind(get_args(hint)[0])
    if origin is float:
        return float | int  # type: ignore[return-value]  # (JSON's 1 fits a float)
    return origin if isinstance(origin, type) else None


def _sequence_converter(origin: Any, args: tuple[Any, ...]) -> Converter | None:
    if not args:
        return None
    item_hint = args[0]
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        return _fixed_tuple_converter(args)
    item = converter_for(item_hint)
    if item is None:
        return None
    build: Callable[[Any], Any] = {tuple: tuple, set: set, frozenset: frozenset}.get(origin, list)

    def convert(value: Any) -> Any:
        if not isinstance(value, list):
            raise _expecting("a list", value)
        converted = []
        for index, element in enumerate(value):
            try:
                converted.append(item(element))
            except ParamMismatch as mismatch:
                mismatch.path.append(f"[{index}]")
                raise
        return build(converted)

    return convert


def _fixed_tuple_converter(args: tuple[Any, ...]) -> Converter | None:
    items = [converter_for(arg) for arg in args]
    if all(item is None for item in items):
        return None

    def convert(value: Any) -> Any:
        if not isinstance(value, list) or len(value) != len(items):
            raise _expecting(f"a tuple of {len(items)}", value)
        converted = []
        for index, (element, item) in enumerate(zip(value, items, strict=True)):
            try:
                converted.append(element if item is None else item(element))
            except ParamMismatch as mismatch:
                mismatch.path.append(f"[{index}]")
                raise
        return tuple(converted)

    return convert


def _dict_converter(item: Converter) -> Converter:
    def convert(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _expecting("a dict", value)
        converted = {}
        for key, element in value.items():
            try:
                converted[key] = item(element)
            except ParamMismatch as mismatch:
                mismatch.path.append(f"[{key!r}]")
                raise
        return converted

    return convert


def converters_for(func: Callable[..., Any]) -> dict[str, Converter]:
    """The converters of ``func``'s parameters whose annotations ask for one (most ask for none).

    Annotations are resolved with `typing.get_type_hints`; when that fails
    (a name imported only for type checking), each annotation that resolves
    on its own is used and the others are left as JSON.
    """
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: fall back to those that resolve
        hints = _hints_one_by_one(func)
    if not hints:
        return {}
    try:
        parameters = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return {}
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    converters: dict[str, Converter] = {}
    for name, hint in hints.items():
        parameter = parameters.get(name)
        if parameter is None or parameter.kind not in keyword:
            continue  # the return annotation, ``*args``, ``**kwargs``: no param is passed by that name
        converter = converter_for(hint)
        if converter is not None:
            converters[name] = converter
    return converters


def _hints_one_by_one(func: Callable[..., Any]) -> dict[str, Any]:
    annotations: dict[str, Any] = dict(getattr(func, "__annotations__", None) or {})
    scope = getattr(func, "__globals__", {})
    hints = {}
    for name, annotation in annotations.items():
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, scope)
            except Exception:  # noqa: BLE001 - left as JSON
                continue
        hints[name] = annotation
    return hints


def convert_params(converters: Mapping[str, Converter], params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with each value a converter is given for turned into its type (a new dict).

    Raises `ParamMismatch` with ``path`` ending in the param's name.
    """
    converted = dict(params)
    for name, converter in converters.items():
        if name in params:
            try:
                converted[name] = converter(params[name])
            except ParamMismatch as mismatch:
                mismatch.path.append(name)
                raise
    return converted


__all__ = [
    "Converter",
    "ParamMismatch",
    "ParamType",
    "convert_params",
    "converter_for",
    "converters_for",
    "encode",
    "param_type_of",
    "register_type",
    "registry_version",
]
