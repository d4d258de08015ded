"""`insert_rows`: many task rows in one statement per chunk, returning their ids where the database can.

SQLAlchemy's multi-row INSERT writes one placeholder per value: 9,000 for
1,000 tasks.  On PostgreSQL, psycopg then spends most of the enqueue parsing
that statement (its placeholders are split out with a regular expression on
every run, as the statement is too long to cache).  There, the rows go as one
array per column instead, unpacked by ``unnest``: nine parameters whatever the
chunk size, and the statement is the same every time.  Elsewhere SQLAlchemy's
own multi-row INSERT is the fast path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Column, Connection, Integer, Table, insert
from sqlalchemy.engine import Dialect

from sa_taskqueue.backends import backend_for


def insert_rows(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> list[int] | None:
    """INSERT ``rows`` (all with the same keys) into ``table``; their new ids in order, or None.

    None where the database cannot return ids from a multi-row INSERT (MySQL;
    MariaDB 10.5+ can).  Runs on ``conn`` in its transaction; commits nothing.
    """
    if not rows:
        return []
    names = list(rows[0])
    ascending = _ids_ascend(table, names)
    backend = backend_for(conn.dialect)
    # The unnest statement is written with psycopg's placeholders; asyncpg
    # (numbered ``$1`` placeholders) takes SQLAlchemy's INSERT below.
    pyformat = conn.dialect.paramstyle == "pyformat"
    if backend.insert_from_arrays and pyformat and ascending and _unnest_can_insert(table, names):
        return _insert_unnested(conn, table, names, rows)
    statement = insert(table)
    if backend.multi_row_insert_ids_in_order and ascending:
        return sorted(conn.execute(statement.returning(table.c.id), rows).scalars())
    if backend.multi_row_insert_returning:
        result = conn.execute(statement.returning(table.c.id, sort_by_parameter_order=True), rows)
        return list(result.scalars())
    conn.execute(statement, rows)
    return None


def _ids_ascend(table: Table, names: list[str]) -> bool:
    """The database numbers new rows in the order one statement inserts them (identity, rowid)."""
    key = table.c.id
    return "id" not in names and isinstance(key.type, Integer) and key.default is None


def _unnest_can_insert(table: Table, names: list[str]) -> bool:
    # Client-side column defaults are SQLAlchemy's to apply; an application
    # table (TaskMixin) with such a column of its own takes the general path.
    provided = set(names)
    return all(column.name in provided or column.default is None for column in table.c)


def _insert_unnested(
    conn: Connection, table: Table, names: list[str], rows: Sequence[Mapping[str, Any]]
) -> list[int]:
    dialect = conn.dialect
    columns = [table.c[name] for name in names]
    sql = _unnest_sql(dialect, table, columns)
    arrays: dict[str, list[Any]] = {}
    for column in columns:
        processor = _array_element_processor(column, dialect)
        values = [row[column.name] for row in rows]
        arrays[f"u_{column.name}"] = [processor(value) for value in values] if processor else values
    # Identity values are drawn in insertion order, which is the ORDER BY
    # ordinality of the SELECT: ascending ids are the rows in order.
    return sorted(conn.exec_driver_sql(sql, arrays).scalars())


def _unnest_sql(dialect: Dialect, table: Table, columns: list[Column[Any]]) -> str:
    quote = dialect.identifier_preparer
    target = quote.format_table(table)
    listed = ", ".join(quote.format_column(column) for column in columns)
    arrays = ", ".join(f"%(u_{column.name})s::{_element_type(column, dialect)}[]" for column in columns)
    aliases = ", ".join(f"c{index}" for index in range(len(columns)))
    return (
        f"INSERT INTO {target} ({listed}) "
        f"SELECT {aliases} FROM unnest({arrays}) WITH ORDINALITY AS v({aliases}, n) ORDER BY n "
        f"RETURNING {quote.format_column(table.c.id)}"
    )


def _element_type(column: Column[Any], dialect: Dialect) -> str:
    return column.type.dialect_impl(dialect).compile(dialect=dialect)


def _array_element_processor(column: Column[Any], dialect: Dialect) -> Any:
    # JSON documents go as text and are cast to jsonb by the statement; every
    # other value as the column's own bind processing leaves it.
    impl = column.type.dialect_impl(dialect)
    if _element_type(column, dialect).upper() in ("JSON", "JSONB"):
        return lambda value: None if value is None else json.dumps(value)
    return impl.bind_processor(dialect)


__all__ = ["insert_rows"]
