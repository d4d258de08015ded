"""A claimed row's params: read as text by the claim, decoded here row by row.

A row written around the queue (raw SQL) may hold params that are a JSON
array or string, or JSON nested deeper than Python's parser can follow.  Had
the driver or SQLAlchemy decoded them while the claim's rows were fetched,
one such row would raise there, after the claim had committed: every task of
the batch would stay RUNNING with no worker knowing of it.  So the claim
reads the column as text (`params_as_text`: the same bytes on the wire, no
extra round trip), and `decode_params` turns each row's text into a dict or
into a description of what is wrong with it, for that task alone to fail.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import ColumnElement, Text
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.visitors import InternalTraversal

from sa_taskqueue.backends import backend_for

Loads = Callable[[str], Any]

_KINDS = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}


class ParamsAsText(ColumnElement[str]):
    """A JSON column as its text, which no driver decodes: ``CAST(params AS TEXT)`` where one would."""

    __visit_name__ = "sa_taskqueue_params_as_text"
    inherit_cache = True
    _traverse_internals = [("column", InternalTraversal.dp_clauseelement)]  # noqa: RUF012 - SQLAlchemy's protocol
    type = Text()

    def __init__(self, column: ColumnElement[Any]) -> None:
        self.column = column


@compiles(ParamsAsText)
def _compile_params_as_text(element: ParamsAsText, compiler: SQLCompiler, **kw: Any) -> str:
    inner = compiler.process(element.column, **kw)
    if backend_for(compiler.dialect).driver_decodes_json:
        return f"CAST({inner} AS TEXT)"
    return inner


def params_as_text(column: ColumnElement[Any]) -> ColumnElement[str]:
    """``column`` (a JSON document) read back as text, under the column's own name."""
    return ParamsAsText(column).label(column.key)


def json_loads(dialect: Any) -> Loads:
    """The engine's JSON decoder (``create_engine(json_deserializer=...)``), else ``json.loads``."""
    return getattr(dialect, "_json_deserializer", None) or json.loads


def decode_params(raw: Any, loads: Loads = json.loads) -> tuple[dict[str, Any], str | None]:
    """The params a task runs with, and None; or ``{}`` and what is wrong with ``raw``.

    ``raw`` is the column's text (bytes from some drivers), or a value already
    decoded by a strategy that reads rows another way.  SQL NULL and JSON
    ``null`` are no params, as they always were.
    """
    value = raw
    if isinstance(raw, bytes | bytearray | memoryview):
        try:
            value = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as error:
            return {}, f"params is not valid JSON: not UTF-8 ({error.reason})"
    if isinstance(value, str):
        try:
            value = loads(value)
        except RecursionError:
            return {}, "params is not valid JSON here: nested too deeply to decode"
        except (ValueError, TypeError) as error:
            return {}, f"params is not valid JSON: {error}"
    if value is None:
        return {}, None
    if isinstance(value, dict):
        return value, None
    kind = _KINDS.get(type(value), type(value).__name__)
    return {}, f"params is not a JSON object: got {kind}"


__all__ = ["ParamsAsText", "decode_params", "json_loads", "params_as_text"]
