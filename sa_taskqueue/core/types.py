"""Column types that read back the same on every dialect.

A task queue compares timestamps across processes and machines, so every
datetime it stores is UTC and every datetime it reads back is timezone-aware
UTC, whatever the database keeps.  Task parameters are JSON objects; the
database's native JSON type is used where SQLAlchemy and the driver round-trip
it faithfully, and a text column with explicit (de)serialisation elsewhere.
Which physical type each database gets is its backend's choice.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator, TypeEngine

from sa_taskqueue.backends import backend_for


def utcnow() -> datetime:
    """The current time as an aware UTC datetime (the only kind the queue stores)."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """An aware-UTC datetime with microsecond precision on every backend.

    Naive datetimes are refused on the way in: a naive value is ambiguous, and
    guessing its zone is how tasks run an hour early or late.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return backend_for(dialect).datetime_type()

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime, got {type(value).__name__}")
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware datetime (e.g. tzinfo=UTC)")
        value = value.astimezone(UTC)
        if backend_for(dialect).stores_naive_utc:
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class LongText(TypeDecorator[str]):
    """Text of any length a traceback may have (MEDIUMTEXT on MySQL and MariaDB, where TEXT stops at 64 KiB).

    The choice is made per dialect when the type is used, so the model, the
    migrations and ``create_all`` agree under every URL form.
    """

    impl = Text()
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return backend_for(dialect).long_text_type()


class JSONDocument(TypeDecorator[Any]):
    """A JSON value: the database's JSON type, or text serialised here where the backend says so."""

    impl = JSON(none_as_null=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return backend_for(dialect).json_type()

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if value is not None and backend_for(dialect).json_as_text:
            return json.dumps(value)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if isinstance(value, str) and backend_for(dialect).json_as_text:
            return json.loads(value)
        return value


__all__ = ["JSONDocument", "LongText", "UTCDateTime", "utcnow"]
