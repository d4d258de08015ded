"""Claim with ``SELECT ... FOR UPDATE SKIP LOCKED``: PostgreSQL, MySQL 8, MariaDB 10.6+, Oracle.

Concurrent claimers each lock a different set of due rows and skip the rows
another claimer has locked, so they never wait on each other and never take
the same row.  The lock lasts only for the claim's short transaction; after
that the lease (``locked_by``/``locked_until``) is what says who holds a task.

SQLAlchemy renders the locking clause for each dialect, but three dialects
need a differently shaped claim around it; each branch below says why.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, Select, Table, bindparam, event, select, update
from sqlalchemy.engine import Dialect

from sa_taskqueue.dialects import MYSQL_FAMILY, is_mariadb, is_mysql_family
from sa_taskqueue.exceptions import StrategyError
from sa_taskqueue.strategies.base import (
    ClaimRequest,
    ClaimStrategy,
    apply_claim,
    claimed_row,
    claimed_values,
    due_select,
    limit_param,
    read_back,
)


class SkipLockedStrategy(ClaimStrategy):
    """Row locks taken with SKIP LOCKED for the length of the claim, then a lease."""

    name = "skip_locked"

    @classmethod
    def unsupported_reason(cls, dialect: Dialect) -> str | None:
        if dialect.name == "sqlite":
            return (
                "SQLite has no row locks (it drops FOR UPDATE when compiling), "
                "so skip_locked cannot run there; use conditional_update"
            )
        if dialect.name not in ("postgresql", "oracle", *MYSQL_FAMILY):
            return f"skip_locked has not been written for the {dialect.name!r} dialect"
        return None

    def check_server(self, dialect: Dialect) -> None:
        version = dialect.server_version_info or ()
        if is_mysql_family(dialect):
            mariadb = is_mariadb(dialect)
            needed = (10, 6) if mariadb else (8, 0, 1)
            if tuple(version) < needed:
                server = "MariaDB" if mariadb else "MySQL"
                raise StrategyError(
                    f"{server} {'.'.join(map(str, version))} has no SKIP LOCKED "
                    f"(needs {'.'.join(map(str, needed))}+); use conditional_update"
                )

    def finding_statement(self, dialect: Dialect, table: Table, request: ClaimRequest) -> Any:
        if dialect.name == "postgresql":
            return self.one_statement_claim(table, request)
        if dialect.name == "oracle":
            return self.oracle_locking_select(table, request)
        return locking_select(table, request, *read_back(table)).limit(limit_param())

    def claim(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        dialect = engine.dialect
        if dialect.name == "postgresql":
            return self._claim_in_one_statement(engine, table, request)
        if dialect.name == "oracle":
            return self._claim_from_unbounded_cursor(engine, table, request)
        return self._claim_then_update(engine, table, request)

    # PostgreSQL ---------------------------------------------------------------

    def one_statement_claim(self, table: Table, request: ClaimRequest) -> Any:
        """The PostgreSQL claim: lock in a CTE, ``UPDATE ... FROM`` it, ``RETURNING`` the rows.

        A CTE is evaluated once, so the LIMIT holds.  The tempting
        ``UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)``
        lets the planner re-run the subquery (on a join or a recheck) and
        claim more than n rows.
        """
        claimable = locking_select(table, request, table.c.id).limit(limit_param()).cte("claimable")
        return (
            update(table)
            .where(table.c.id == claimable.c.id)
            .values(**claimed_values(table, request))
            .returning(*read_back(table))
        )

    def _claim_in_one_statement(
        self, engine: Engine, table: Table, request: ClaimRequest
    ) -> list[dict[str, Any]]:
        claim = self.claim_statement(
            "claim", engine.dialect, table, request, lambda: self.one_statement_claim(table, request)
        )
        with self.single_statement(engine) as conn:
            return [claimed_row(row, request) for row in claim.rows(conn, request.params())]

    # MySQL and MariaDB --------------------------------------------------------

    def _claim_then_update(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        # MySQL and MariaDB have no UPDATE ... RETURNING, and reject LIMIT inside
        # an IN (...) subquery (error 1235), so the claim is two statements in
        # one transaction: lock the whole rows, then update them by id.  The
        # rows as claimed are computed from what was read, not read again.
        dialect = engine.dialect
        lock = self.claim_statement(
            "lock",
            dialect,
            table,
            request,
            lambda: locking_select(table, request, *read_back(table)).limit(limit_param()),
        )
        params = request.params()
        with self.transaction(engine) as conn:
            rows = lock.rows(conn, params)
            if rows:
                ids = claimed_id_params(len(rows))
                mark = self.claim_statement(
                    f"mark{len(rows)}", dialect, table, request, lambda: mark_claimed(table, request, ids)
                )
                mark.execute(conn, {**params, **dict(zip(ids, (row["id"] for row in rows), strict=True))})
        return [apply_claim(row, request) for row in rows]

    # Oracle -------------------------------------------------------------------

    def oracle_locking_select(self, table: Table, request: ClaimRequest) -> Select[Any]:
        """The Oracle locking query: no row limit in the SQL at all.

        Oracle raises ORA-02014 for FETCH FIRST with FOR UPDATE and for the
        ROWNUM wrapper that ``select().limit().with_for_update()`` compiles to
        there; ROWNUM would also be applied before SKIP LOCKED, returning
        nothing when the first rows are locked; and SQLAlchemy drops FOR UPDATE
        inside a subquery on Oracle.  Oracle locks a SKIP LOCKED cursor's rows
        as they are fetched, so the claim fetches ``limit`` rows from this
        unbounded cursor and locks just those.
        """
        return locking_select(table, request, table.c.id)

    def _claim_from_unbounded_cursor(
        self, engine: Engine, table: Table, request: ClaimRequest
    ) -> list[dict[str, Any]]:
        lock = self.oracle_locking_select(table, request).execution_options(
            **{FETCH_ROWS_OPTION: request.limit}
        )
        params = request.params()
        with self.transaction(engine) as conn:
            cursor = conn.execute(lock, params)
            ids = [row[0] for row in cursor.fetchmany(request.limit)]
            cursor.close()
            if not ids:
                return []
            conn.execute(
                mark_claimed(table, request, claimed_id_params(len(ids))),
                {**params, **dict(zip(claimed_id_params(len(ids)), ids, strict=True))},
            )
            rows = conn.execute(select(table).where(table.c.id.in_(ids))).mappings().all()
        return [dict(row) for row in rows]

    def prepare(self, engine: Engine) -> None:
        if engine.dialect.name == "oracle" and not event.contains(
            engine, "before_cursor_execute", _size_oracle_fetch
        ):
            event.listen(engine, "before_cursor_execute", _size_oracle_fetch)

    # Shared -------------------------------------------------------------------

    def lock_rows(self, conn: Connection, query: Any) -> Any:
        return query.with_for_update(skip_locked=True)

    @contextmanager
    def transaction(self, engine: Engine) -> Iterator[Connection]:
        if not is_mysql_family(engine.dialect):
            with super().transaction(engine) as conn:
                yield conn
            return
        # Under MySQL's default REPEATABLE READ a locking read also takes gap
        # locks on the index range it walked, which block enqueues into that
        # range and deadlock concurrent claimers; READ COMMITTED locks only
        # the rows it returns.  SET TRANSACTION (no SESSION) applies to this
        # transaction alone: one statement, nothing to reset afterwards, and
        # sent through SQLAlchemy, which notices a dead connection.
        with super().transaction(engine) as conn:
            conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            yield conn


#: Execution option: how many rows the driver may fetch per round trip.
FETCH_ROWS_OPTION = "sa_taskqueue_fetch_rows"


def _size_oracle_fetch(
    conn: Connection, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
) -> None:
    # python-oracledb prefetches 2 rows and then fetches 100 per round trip by
    # default, and Oracle locks a SKIP LOCKED cursor's rows as they are
    # fetched: a claim of 1 would lock up to 100 rows until it commits.
    rows = context.execution_options.get(FETCH_ROWS_OPTION) if context is not None else None
    if rows:
        cursor.prefetchrows = rows
        cursor.arraysize = rows


def claimed_id_params(count: int) -> list[str]:
    """The parameters holding the ids of ``count`` locked rows: one per id, so the SQL is fixed per count."""
    return [f"claimed_id_{index}" for index in range(count)]


def mark_claimed(table: Table, request: ClaimRequest, id_params: list[str]) -> Any:
    """UPDATE the rows whose ids are bound to ``id_params`` to claimed."""
    ids = [bindparam(name, type_=table.c.id.type) for name in id_params]
    return update(table).where(table.c.id.in_(ids)).values(**claimed_values(table, request))


def locking_select(table: Table, request: ClaimRequest, *columns: Any) -> Select[Any]:
    """Due rows in claim order, locked with SKIP LOCKED; the caller adds a LIMIT where the dialect allows."""
    return due_select(table, request, *columns).with_for_update(skip_locked=True)
