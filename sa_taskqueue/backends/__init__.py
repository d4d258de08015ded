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


#: Where a dialect object keeps its backend.
_KEPT_AS = "_sa_taskqueue_backend"


def backend_for(dialect: Dialect) -> Backend:
    """The backend of ``dialect`` (of an engine, a connection, or made by hand for compiling).

    Made once per dialect object and kept on it, so it lives exactly as long
    as the dialect: column types ask for it on every value they bind.  (Two
    threads asking at once may each make one; a backend holds no state of its
    own, so either serves.)
    """
    found: Backend | None = getattr(dialect, _KEPT_AS, None)
    if found is None:
        found = BACKENDS.get(dialect.name, BACKENDS[ANY_DIALECT])(dialect)
        setattr(dialect, _KEPT_AS, found)
    return found


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
