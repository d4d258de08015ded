"""One home per database: `backend_for(dialect)` is the only place that looks at a dialect's name.

=============  ==========================================================
module         database
=============  ==========================================================
``base``       `Backend`: every capability, with the default for any other dialect (``"*"``)
``postgresql`` PostgreSQL
``mysql``      MySQL and MariaDB, under either dialect name
``sqlite``     SQLite
``oracle``     Oracle
``table_health`` the table health measurement and each database's probe
=============  ==========================================================

Code outside this package asks a backend for a capability, or one of the
functions here for the dialect names that have one; it never names a
database or a driver itself.
"""

from __future__ import annotations

from sqlalchemy.engine import Dialect

from sa_taskqueue.backends.base import (
    CONDITIONAL_UPDATE,
    FETCH_ROWS_OPTION,
    SKIP_LOCKED,
    Backend,
    BulkCopier,
    TableHealthProbe,
)
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


def dialects_with(capability: str) -> list[str]:
    """The dialect names whose backends have ``capability`` (a true class attribute of `Backend`).

    For SQLAlchemy's per-dialect arguments, which are spelled with a
    dialect's name: an `Index`'s ``<name>_where``, a type's ``with_variant``.
    """
    return sorted(
        name
        for name, backend in BACKENDS.items()
        if name != ANY_DIALECT and getattr(backend, capability) is True
    )


def partial_index_dialects() -> list[str]:
    """The dialect names whose backends have partial indexes (for an `Index`'s ``<name>_where``)."""
    return dialects_with("partial_indexes")


def backend_class(dialect_name: str) -> type[Backend]:
    """The backend class serving dialects named ``dialect_name`` (a URL's backend name).

    For a decision made before any dialect exists, from a URL alone.
    """
    return BACKENDS.get(dialect_name, BACKENDS[ANY_DIALECT])


def dialect_named_by_alias(scheme_name: str) -> str | None:
    """The dialect name SQLAlchemy has for a database other tools call ``scheme_name``
    (`Backend.scheme_aliases`: ``postgres`` gives ``postgresql``), else None."""
    for name, backend in BACKENDS.items():
        if scheme_name in backend.scheme_aliases:
            return name
    return None


def known_dialect(dialect: Dialect) -> bool:
    """Whether a backend of its own serves ``dialect``, rather than the default for any other."""
    return dialect.name in BACKENDS and dialect.name != ANY_DIALECT


def backend_classes() -> list[type[Backend]]:
    """Every backend class, each once, the default for any other dialect last."""
    found: list[type[Backend]] = []
    for backend in BACKENDS.values():
        if backend not in found:
            found.append(backend)
    return found


def loop_bound_drivers() -> frozenset[str]:
    """Every backend's `Backend.loop_bound_drivers`: asyncio drivers tied to the loop that connected."""
    return frozenset().union(*(backend.loop_bound_drivers for backend in backend_classes()))


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


#: Which databases an option or a strategy that one kind of server answers applies to, in words for
#: people: the command line's help and the errors that name them take it from here.
SERVED_BY = {
    "listen": "PostgreSQL",
    "dead_rows": "PostgreSQL",
    "history_list": "MySQL, MariaDB",
    "wal": "SQLite",
    "advisory_locks": "PostgreSQL (pg_try_advisory_lock) or MySQL/MariaDB (GET_LOCK)",
    "galera": "a MariaDB Galera cluster",
}


def local_file_url(filename: str) -> str:
    """The URL of a database in the local file ``filename`` (SQLite's), for the demo."""
    return f"sqlite:///{filename}"


__all__ = [
    "ANY_DIALECT",
    "BACKENDS",
    "CONDITIONAL_UPDATE",
    "FETCH_ROWS_OPTION",
    "SERVED_BY",
    "SKIP_LOCKED",
    "Backend",
    "BulkCopier",
    "MySQLBackend",
    "OracleBackend",
    "PostgreSQLBackend",
    "SQLiteBackend",
    "TableHealthProbe",
    "backend_class",
    "backend_classes",
    "backend_for",
    "dialect_named_by_alias",
    "dialects_with",
    "known_dialect",
    "local_file_url",
    "loop_bound_drivers",
    "partial_index_dialects",
]
