"""Column types that read back the same on every dialect.

A task queue compares timestamps across processes and machines, so every
datetime it stores is UTC and every datetime it reads back is timezone-aware
UTC, whatever the database keeps.  Task parameters are JSON objects; the
database's native JSON type is used where SQLAlchemy and the driver round-trip
it faithfully, and a text column with explicit (de)serialisation elsewhere.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Text
from sqlalchemy.dialects import mysql, oracle, postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator, TypeEngine

from sa_taskqueue.dialects import is_mysql_family


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
        if is_mysql_family(dialect):
            # MySQL and MariaDB DATETIME has no zone and whole seconds unless
            # asked for fsp=6; we keep UTC in it and mark it UTC on read.
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        if dialect.name == "oracle":
            # Oracle's DateTime(timezone=True) becomes DATE (whole seconds), and
            # python-oracledb binds an aware datetime as a plain TIMESTAMP that
            # the server shifts by the session time zone; a TIMESTAMP holding
            # the UTC wall time is the same on every session.
            return dialect.type_descriptor(oracle.TIMESTAMP())
        return dialect.type_descriptor(DateTime(timezone=True))

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime, got {type(value).__name__}")
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware datetime (e.g. tzinfo=UTC)")
        value = value.astimezone(UTC)
        if is_mysql_family(dialect) or dialect.name in ("sqlite", "oracle"):
            # None of these keeps the zone: store the UTC wall time.
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class LongText(TypeDecorator[str]):
    """Text of any length a traceback may have: MEDIUMTEXT (16 MiB) on MySQL and MariaDB, TEXT/CLOB elsewhere.

    MySQL's TEXT stops at 64 KiB.  The choice is made per dialect when the
    type is used, so the model, the migrations and ``create_all`` agree under
    every URL form (``mysql://`` and ``mariadb://`` alike).
    """

    impl = Text()
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if is_mysql_family(dialect):
            return dialect.type_descriptor(mysql.MEDIUMTEXT())
        return dialect.type_descriptor(Text())


class JSONDocument(TypeDecorator[Any]):
    """A JSON value: native JSONB on PostgreSQL and JSON on MySQL/SQLite, CLOB text on Oracle.

    Oracle before 21c has no JSON type and SQLAlchemy's Oracle support for it
    varies by version, so there the document is serialised to text by us.
    """

    impl = JSON(none_as_null=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.JSONB(none_as_null=True))
        if dialect.name == "oracle":
            return dialect.type_descriptor(oracle.CLOB())
        return dialect.type_descriptor(JSON(none_as_null=True))

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if dialect.name == "oracle" and value is not None:
            return json.dumps(value)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if dialect.name == "oracle" and isinstance(value, str):
            return json.loads(value)
        return value


__all__ = ["JSONDocument", "LongText", "UTCDateTime", "utcnow"]
