"""What every supported database stores: the bounds `validation` holds a new task's values to.

A value one database takes and another refuses (or stores altered) would
make an application's enqueue depend on where it runs, and a refusal from
the database comes mid-transaction: it can abort the caller's own work.  So
each bound here is the narrowest of the databases', and a value outside it
is refused before any SQL is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import BigInteger, Integer, SmallInteger, String, Table

from sa_taskqueue.core.model import NAME_LENGTH, QUEUE_LENGTH, UNIQUE_KEY_LENGTH

#: How deeply params may nest arrays and objects, the params object itself
#: counting as the first level.  MariaDB's JSON check refuses 32 levels
#: (MySQL refuses more than 100).
MAX_PARAMS_DEPTH = 31

#: The integers params may hold: MySQL's JSON keeps integers to 64 bits and
#: turns larger ones into floating point.
PARAMS_INT_MIN = -(2**63)
PARAMS_INT_MAX = 2**64 - 1

#: The earliest and latest ``run_at`` (in UTC): MySQL's DATETIME covers the years 1000 to 9999.
EARLIEST_RUN_AT = datetime(1000, 1, 1, tzinfo=UTC)
LATEST_RUN_AT = datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC)

#: The range of an integer column, by its SQLAlchemy type (``Integer`` is 32 bits everywhere).
_INTEGER_BITS: tuple[tuple[type[Integer], int], ...] = ((SmallInteger, 16), (BigInteger, 64), (Integer, 32))


@dataclass(frozen=True)
class ColumnLimits:
    """The longest name, queue and unique key, and the integer ranges, one task table's columns hold."""

    name_length: int = NAME_LENGTH
    queue_length: int = QUEUE_LENGTH
    priority_range: tuple[int, int] = (-(2**31), 2**31 - 1)
    max_attempts_range: tuple[int, int] = (1, 2**31 - 1)
    attempts_range: tuple[int, int] = (0, 2**31 - 1)
    unique_key_length: int = UNIQUE_KEY_LENGTH

    @classmethod
    def of(cls, table: Table) -> ColumnLimits:
        """The limits of ``table``'s own columns (an application's `TaskMixin` table may differ)."""
        return cls(
            name_length=_length(table, "name", NAME_LENGTH),
            queue_length=_length(table, "queue", QUEUE_LENGTH),
            priority_range=_integer_range(table, "priority"),
            max_attempts_range=(1, _integer_range(table, "max_attempts")[1]),
            attempts_range=(0, _integer_range(table, "attempts")[1]),
            unique_key_length=_length(table, "unique_key", UNIQUE_KEY_LENGTH),
        )


DEFAULT_LIMITS = ColumnLimits()


def _length(table: Table, name: str, default: int) -> int:
    column_type = table.c[name].type
    length = column_type.length if isinstance(column_type, String) else None
    return length if length is not None else default


def _integer_range(table: Table, name: str) -> tuple[int, int]:
    column_type = table.c[name].type
    for kind, bits in _INTEGER_BITS:
        if isinstance(column_type, kind):
            return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return (-(2**31), 2**31 - 1)


__all__ = [
    "DEFAULT_LIMITS",
    "EARLIEST_RUN_AT",
    "LATEST_RUN_AT",
    "MAX_PARAMS_DEPTH",
    "PARAMS_INT_MAX",
    "PARAMS_INT_MIN",
    "ColumnLimits",
]
