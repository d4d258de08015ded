"""One home per database: `backend_for(dialect)` is the only place that looks at a dialect's name.

=============  ==========================================================
module         database
=============  ==========================================================
``base``       `Backend`: every capability, with the default for any other dialect (``"*"``)
``postgresql`` PostgreSQL
``mysql``      MySQL and MariaDB, under either dialect name
``sqlite``     SQLite
``oracle``     Oracle
=============  ==========================================================
"""

from __future__ import annotations

import weakref

from sqlalchemy.engine import Dialect

from sa_taskqueue.backends.base import Backend
from sa_taskqueue.backends.mysql import MySQLBackend
from sa_taskqueue.backends.oracle import OracleBackend
from sa_taskqueue.backends.postgresql import PostgreSQLBackend
from sa_taskqueue.backends.sqlite import SQLiteBackend

ANY_DIALECT = "*"

#: Dialect name -> backend.  ``"*"`` serves every dialect not listed.
BACKENDS: dict[str, type[Backend]] = {
    "postgresql": PostgreSQLBackend,
    "mysql": MySQLBackend,
    "mariadb": MySQLBackend,
    "sqlite": SQLiteBackend,
    "oracle": OracleBackend,
    ANY_DIALECT: Backend,
}


def partial_index_dialects() -> list[str]:
    """The dialect names whose backends have partial indexes (for an `Index`'s ``<name>_where``)."""
    return sorted(
        name for name, backend in BACKENDS.items() if name != ANY_DIALECT and backend.partial_indexes
    )


_made: weakref.WeakKeyDictionary[Dialect, Backend] = weakref.WeakKeyDictionary()


def backend_for(dialect: Dialect) -> Backend:
    """The backend of ``dialect`` (of an engine, a connection, or made by hand for compiling).

    One per dialect object, kept as long as the dialect: column types ask for
    it on every value they bind.
    """
    try:
        return _made[dialect]
    except KeyError:
        pass
    backend = _made[dialect] = BACKENDS.get(dialect.name, BACKENDS[ANY_DIALECT])(dialect)
    return backend


__all__ = [
    "ANY_DIALECT",
    "BACKENDS",
    "Backend",
    "MySQLBackend",
    "OracleBackend",
    "PostgreSQLBackend",
    "SQLiteBackend",
    "backend_for",
    "partial_index_dialects",
]
