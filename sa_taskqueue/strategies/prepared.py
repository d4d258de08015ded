"""`PreparedStatement`: a hot statement compiled once, sent as driver SQL with processed values.

Executing a SQLAlchemy construct computes its cache key, looks the compiled
form up, and has the compiler build the parameters, every time: on this
project's benchmark machine that is about 40 µs a statement, as much as the
round trip to a local database.  Claims and completions run the same few
statements thousands of times a second, so they are compiled once per dialect
here and sent as driver SQL.  Where nothing listens to the engine's
statements (no ``before_cursor_execute`` handler, no echo), they go on a
cursor of the connection's own through the connection's cursor execution,
which keeps its error translation and disconnect handling and leaves out
the per-call result machinery: a result's column metadata, rebuilt from the
cursor's description on every execution, costs more than the driver's own
fetch for the one or few rows a claim returns, so rows come back as the
driver's tuples, processed by the column types found once.  Where something
listens (a tracer, a metrics hook, echo), they go through
`Connection.exec_driver_sql`, so that its handlers get the execution context
they are written for: tracing and metrics see every statement, as they
would any other.

The values still go through the columns' own types, in both directions: a
task row reads back the same as through any other SQLAlchemy path.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, CursorResult, Table
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError, StatementError

from sa_taskqueue.backends import backend_for

Processor = Callable[[Any], Any]


class DriverResult:
    """What a statement sent on the driver's cursor returned: its rows as tuples, and its row count.

    The part of `CursorResult` the strategies read, fetched at once so that
    the cursor is closed before this is handed back.
    """

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: Sequence[Sequence[Any]], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[Sequence[Any]]:
        return iter(self._rows)

    def scalar(self) -> Any:
        """The first column of the first row, or None without rows."""
        return self._rows[0][0] if self._rows else None

    def scalars(self) -> list[Any]:
        """The first column of every row."""
        return [row[0] for row in self._rows]


def send_driver_sql(conn: Connection, sql: str) -> None:
    """Send ``sql``, a statement without parameters or rows (BEGIN, COMMIT), the way a prepared one goes.

    Through the connection's cursor execution, so that events, echo and
    error translation see it, without building a result for it.
    """
    if observed(conn):
        conn.exec_driver_sql(sql)
        return
    if not conn.in_transaction():
        conn.begin()  # (as SQLAlchemy's own execution begins one: a no-op for the driver in autocommit)
    cursor = conn.connection.cursor()
    try:
        cursor_execute(conn, cursor, sql, ())
    finally:
        close_quietly(cursor)


def observed(conn: Connection) -> bool:
    """Whether something listens to ``conn``'s statements: an engine or connection event handler, or echo.

    Its handlers expect SQLAlchemy's own execution context (a tracer keeps its
    span there), and SQLAlchemy 2.0's echo of a bare cursor execution would
    not hide parameters as ``hide_parameters`` asks: such statements take the
    full path.
    """
    return bool(conn._has_events or conn.engine._has_events or conn._echo)


def close_quietly(cursor: Any) -> None:
    """Close ``cursor``; an error closing it (its connection lost and closed) must not hide the first."""
    with contextlib.suppress(Exception):
        cursor.close()


def cursor_execute(conn: Connection, cursor: Any, sql: str, params: Any) -> None:
    """Run ``sql`` on ``cursor`` through ``conn``'s own cursor execution: its events, echo, error translation.

    Only the driver's errors come wrapped, as SQLAlchemy's own execution
    wraps them; anything else (an event handler's) is raised as it was raised.
    """
    try:
        conn._cursor_execute(cursor, sql, params)
    except StatementError as error:
        if isinstance(error, DBAPIError) or not isinstance(error.orig, BaseException):
            raise
        raise error.orig from None


class PreparedStatement:
    """One statement compiled for one dialect, with its parameters' and result columns' processors.

    Parameters without a value in the statement are required at execution;
    values fixed in the statement (``status = 'running'``) are processed once
    here.  Expanding parameters (``IN`` lists whose length varies) are not
    supported: build one statement per list length instead.
    """

    def __init__(self, statement: Any, dialect: Dialect, table: Table) -> None:
        self.statement = statement
        # Only where the driver binds every value right from the value alone;
        # elsewhere the construct runs as usual.
        self.direct = backend_for(dialect).direct_execution
        compiled = statement.compile(dialect=dialect)
        expanding = [name for name, bind in compiled.binds.items() if bind.expanding]
        if expanding or getattr(compiled, "escaped_bind_names", None):
            raise ValueError(f"cannot prepare a statement with expanding or escaped parameters: {expanding}")
        self.sql: str = compiled.string
        self._order: tuple[str, ...] | None = (
            tuple(compiled.positiontup) if compiled.positional and compiled.positiontup else None
        )
        #: The positional values from the named ones, in the statement's order (positional drivers).
        self._positions: Callable[[Mapping[str, Any]], tuple[Any, ...]] | None = None
        if self._order is not None:
            pick = operator.itemgetter(*self._order)
            single = len(self._order) == 1
            self._positions = (lambda values: (pick(values),)) if single else pick
        self._fixed: dict[str, Any] = {}
        self._required: list[tuple[str, Processor | None]] = []
        for name, bind in compiled.binds.items():
            processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if bind.required:
                self._required.append((name, processor))
            else:
                value = bind.effective_value
                self._fixed[name] = processor(value) if processor is not None else value
        self._dialect = dialect
        # What the statement returns, by name: a table's column or an
        # expression labelled with one's name (the params read as text).
        self._columns = {column.name: column for column in table.c}
        self._columns.update({column.key: column for column in getattr(statement, "exported_columns", ())})
        self._result_processors: dict[str, Processor | None] = {}
        #: The names of the columns it returns, and their processors, in order: found at the first run.
        self._names: tuple[str, ...] | None = None
        self._row_processors: list[Processor | None] | None = None

    def execute(self, conn: Connection, params: Mapping[str, Any]) -> CursorResult[Any] | DriverResult:
        """Run the statement with ``params`` (the required parameters, by name)."""
        if not self.direct:
            return conn.execute(self.statement, dict(params))
        rows, rowcount, _names = self._send(conn, params)
        return DriverResult(rows, rowcount)

    def rows(self, conn: Connection, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Run the statement and return its rows as dicts of column name to processed value.

        Every column it returns must be a column of the table or a labelled expression.
        """
        if not self.direct:
            return [dict(row) for row in conn.execute(self.statement, dict(params)).mappings()]
        raw_rows, _rowcount, names = self._send(conn, params)
        if not raw_rows:
            return []
        processors = self._processors_of(names)
        return [
            {
                key: (processor(value) if processor is not None else value)
                for key, processor, value in zip(names, processors, raw, strict=True)
            }
            for raw in raw_rows
        ]

    def _send(
        self, conn: Connection, params: Mapping[str, Any]
    ) -> tuple[Sequence[Sequence[Any]], int, tuple[str, ...]]:
        """Send the statement on a cursor of ``conn``'s: its rows (all fetched), row count, column names."""
        values = dict(self._fixed)
        for name, processor in self._required:
            try:
                value = params[name]
            except KeyError:
                raise KeyError(f"no value for the statement's parameter {name!r}") from None
            values[name] = processor(value) if processor is not None else value
        driver_params: Any = values if self._positions is None else self._positions(values)
        if observed(conn):
            result = conn.exec_driver_sql(self.sql, driver_params)
            if not result.returns_rows:
                return (), result.rowcount, ()
            return result.fetchall(), result.rowcount, tuple(result.keys())
        if not conn.in_transaction():
            conn.begin()  # (as SQLAlchemy's own execution begins one: a no-op for the driver in autocommit)
        cursor = conn.connection.cursor()
        try:
            # The connection's own cursor execution, for its translation of
            # driver errors (a lost connection invalidated); nothing listens
            # to its statements here (`observed`).
            cursor_execute(conn, cursor, self.sql, driver_params)
            names = self._names
            if names is None:
                # (Read once: a driver may build the description anew at each read.)
                description = cursor.description
                names = () if description is None else tuple(column[0] for column in description)
                self._names = names
            if not names:
                return (), cursor.rowcount, names
            return cursor.fetchall(), cursor.rowcount, names
        finally:
            close_quietly(cursor)

    def _processors_of(self, names: tuple[str, ...]) -> list[Processor | None]:
        processors = self._row_processors
        if processors is None:
            processors = self._row_processors = [self._result_processor(name) for name in names]
        return processors

    def _result_processor(self, key: str) -> Processor | None:
        try:
            return self._result_processors[key]
        except KeyError:
            pass
        column_type = self._columns[key].type.dialect_impl(self._dialect)
        processor = self._result_processors[key] = column_type.result_processor(self._dialect, None)
        return processor


__all__ = ["DriverResult", "PreparedStatement", "close_quietly", "observed", "send_driver_sql"]
