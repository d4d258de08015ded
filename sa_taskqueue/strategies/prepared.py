"""`PreparedStatement`: a hot statement compiled once, sent as driver SQL with processed values.

Executing a SQLAlchemy construct computes its cache key, looks the compiled
form up, and has the compiler build the parameters, every time: on this
project's benchmark machine that is about 40 µs a statement, as much as the
round trip to a local database.  Claims and completions run the same few
statements thousands of times a second, so they are compiled once per dialect
here and run through `Connection.exec_driver_sql`, which keeps what matters
of SQLAlchemy's execution (events, error translation, disconnect handling).

The values still go through the columns' own types, in both directions: a
task row reads back the same as through any other SQLAlchemy path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection, CursorResult, Table
from sqlalchemy.engine import Dialect

from sa_taskqueue.backends import backend_for

Processor = Callable[[Any], Any]


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

    def execute(self, conn: Connection, params: Mapping[str, Any]) -> CursorResult[Any]:
        """Run the statement with ``params`` (the required parameters, by name)."""
        if not self.direct:
            return conn.execute(self.statement, dict(params))
        values = dict(self._fixed)
        for name, processor in self._required:
            try:
                value = params[name]
            except KeyError:
                raise KeyError(f"no value for the statement's parameter {name!r}") from None
            values[name] = processor(value) if processor is not None else value
        if self._order is None:
            return conn.exec_driver_sql(self.sql, values)
        return conn.exec_driver_sql(self.sql, tuple(values[name] for name in self._order))

    def rows(self, conn: Connection, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Run the statement and return its rows as dicts of column name to processed value.

        Every column it returns must be a column of the table or a labelled expression.
        """
        if not self.direct:
            return [dict(row) for row in conn.execute(self.statement, dict(params)).mappings()]
        result = self.execute(conn, params)
        keys = list(result.keys())
        processors = [self._result_processor(key) for key in keys]
        rows: list[dict[str, Any]] = []
        for raw in result.fetchall():
            rows.append(
                {
                    key: (processor(value) if processor is not None else value)
                    for key, processor, value in zip(keys, processors, raw, strict=True)
                }
            )
        return rows

    def _result_processor(self, key: str) -> Processor | None:
        try:
            return self._result_processors[key]
        except KeyError:
            pass
        column_type = self._columns[key].type.dialect_impl(self._dialect)
        processor = self._result_processors[key] = column_type.result_processor(self._dialect, None)
        return processor


__all__ = ["PreparedStatement"]
