"""Names for families of SQLAlchemy dialects.

SQLAlchemy calls MariaDB ``"mysql"`` under a ``mysql://`` URL (with
``is_mariadb`` set) and ``"mariadb"`` under a ``mariadb://`` URL; both speak
the same SQL for everything the queue does.
"""

from __future__ import annotations

from sqlalchemy.engine import Dialect

MYSQL_FAMILY = ("mysql", "mariadb")


def is_mysql_family(dialect: Dialect) -> bool:
    """True for MySQL and MariaDB, whichever name SQLAlchemy gives the dialect."""
    return dialect.name in MYSQL_FAMILY


def explain_prefix(dialect: Dialect) -> str:
    """What turns a statement into a request for its plan."""
    return {"sqlite": "EXPLAIN QUERY PLAN ", "oracle": "EXPLAIN PLAN FOR "}.get(dialect.name, "EXPLAIN ")


def is_mariadb(dialect: Dialect) -> bool:
    return dialect.name == "mariadb" or (
        dialect.name == "mysql" and bool(getattr(dialect, "is_mariadb", False))
    )
