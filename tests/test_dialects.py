"""What each database needs to be told: SQL shapes, the registry, and each dialect's own traps.

The compile-only tests run in every session (they need no server): they are
how the Oracle and MySQL 8 paths are checked where no such server runs.
"""

from __future__ import annotations

import contextlib
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mssql, mysql, oracle, postgresql, sqlite
from sqlalchemy.orm import DeclarativeBase, Session
from sqlalchemy.schema import CreateIndex, CreateTable

import sa_taskqueue as tq
from sa_taskqueue.backends import backend_for
from sa_taskqueue.health.explain import explain
from sa_taskqueue.strategies import registry
from sa_taskqueue.strategies.claiming import ClaimRequest
from sa_taskqueue.strategies.conditional import ConditionalUpdateStrategy
from sa_taskqueue.strategies.held_arrays import complete_from_arrays_statement, held_claims
from sa_taskqueue.strategies.lease import HELD_NOW, complete_many_statement, fail_many_statement
from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy, locking_select
from tests.app import make_queue
from tests.backends import Backend
from tests.helpers import enqueue_records as enqueue_keys

TABLE = tq.Task.__table__
NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
REQUEST = ClaimRequest(limit=10, queues=None, worker_id="w", now=NOW, lease_until=NOW + timedelta(minutes=5))


def sql(statement: object, dialect: sa.engine.Dialect) -> str:
    return " ".join(str(statement.compile(dialect=dialect)).split())  # type: ignore[attr-defined]


# Compiled shapes ---------------------------------------------------------------


def test_postgres_claims_with_a_locking_cte_and_update_from_returning() -> None:
    text = sql(SkipLockedStrategy().one_statement_claim(TABLE, REQUEST), postgresql.dialect())
    assert re.fullmatch(
        r"WITH claimable AS \(SELECT .* LIMIT \S+ FOR UPDATE SKIP LOCKED\) "
        r"UPDATE sa_taskqueue_task SET .* FROM claimable "
        r"WHERE sa_taskqueue_task.id = claimable.id RETURNING .*",
        text,
    ), text
    assert " IN (" not in text, "no IN (subquery) the planner could re-run"


def test_oracle_locks_from_an_unbounded_cursor() -> None:
    text = sql(SkipLockedStrategy().unbounded_locking_select(TABLE, REQUEST), oracle.dialect())
    assert text.endswith("FOR UPDATE SKIP LOCKED")
    assert "FETCH FIRST" not in text and "ROWNUM" not in text, "ORA-02014 with FOR UPDATE"
    # Why: SQLAlchemy's own limit renders the shape Oracle rejects.
    naive = sql(select_ids().limit(10).with_for_update(skip_locked=True), oracle.dialect())
    assert "FETCH FIRST" in naive or "ROWNUM" in naive


def test_mysql_locking_select_limits_outside_any_subquery() -> None:
    dialect = mysql.dialect()
    text = sql(locking_select(TABLE, REQUEST, TABLE).limit(10), dialect)
    assert re.fullmatch(
        r"SELECT .* FROM sa_taskqueue_task WHERE .* ORDER BY .* LIMIT \S+ FOR UPDATE SKIP LOCKED", text
    )
    assert "(SELECT" not in text
    assert not dialect.update_returning, "MySQL has no UPDATE ... RETURNING, hence select-then-update"


@pytest.mark.parametrize(
    "dialect",
    [postgresql.dialect(), mysql.dialect(), oracle.dialect(), sqlite.dialect()],
    ids=["postgresql", "mysql", "oracle", "sqlite"],
)
def test_a_batch_of_failures_is_one_update_each_row_under_its_own_claim(dialect: sa.engine.Dialect) -> None:
    text = sql(fail_many_statement(TABLE, 3, clears_slots=True), dialect)
    assert text.startswith("UPDATE sa_taskqueue_task SET "), text
    assert " FROM " not in text and "SELECT" not in text, "no join or subquery a dialect may refuse"
    # Each row's status, error, retry time and finish, picked by its id; the rest alike for all.
    assert text.count("CASE WHEN") == 4 and text.count("END") == 4, text
    assert re.search(r"locked_until=[:%?]", text) and re.search(r"concurrency_slot=[:%?]", text), text
    # Three claim tests, each with the row's worker, attempt and start, under a live lease.
    assert text.count("sa_taskqueue_task.locked_by = ") == 3, text
    assert text.count("sa_taskqueue_task.started_at = ") == 3, text
    assert "sa_taskqueue_task.locked_until > " in text, text


def test_sqlite_drops_for_update_so_it_gets_the_conditional_update() -> None:
    assert "FOR UPDATE" not in sql(select_ids().with_for_update(skip_locked=True), sqlite.dialect())
    text = sql(ConditionalUpdateStrategy().one_statement_claim(TABLE, REQUEST), sqlite.dialect())
    assert re.fullmatch(
        r"UPDATE sa_taskqueue_task SET .* WHERE sa_taskqueue_task.id IN \(SELECT .* LIMIT .*\) RETURNING .*",
        text,
    )


def select_ids() -> sa.Select[tuple[int]]:
    return sa.select(TABLE.c.id).order_by(TABLE.c.priority)


# Registry ------------------------------------------------------------------------


def dialect_of(module: object, version: tuple[int, ...], *, mariadb: bool = False) -> sa.engine.Dialect:
    dialect = module.dialect()  # type: ignore[attr-defined]
    dialect.server_version_info = version
    if mariadb:
        dialect.is_mariadb = True
    return dialect


@pytest.mark.parametrize(
    ("dialect", "expected"),
    [
        (dialect_of(postgresql, (9, 5)), "skip_locked"),
        (dialect_of(mysql, (8, 0, 1)), "skip_locked"),
        (dialect_of(mysql, (8, 0, 0)), "conditional_update"),
        (dialect_of(mysql, (5, 7, 44)), "conditional_update"),
        (dialect_of(mysql, (10, 6, 0), mariadb=True), "skip_locked"),
        (dialect_of(mysql, (10, 11, 9), mariadb=True), "skip_locked"),
        (dialect_of(mysql, (10, 5, 27), mariadb=True), "conditional_update"),
        (dialect_of(oracle, (19, 0)), "skip_locked"),
        (dialect_of(sqlite, (3, 45, 0)), "conditional_update"),
        (dialect_of(mssql, (16, 0)), "conditional_update"),
    ],
)
def test_registry_picks_the_strategy_from_dialect_and_server_version(
    dialect: sa.engine.Dialect, expected: str
) -> None:
    assert registry.resolve(dialect).name == expected


def test_registering_overrides_a_default() -> None:
    try:
        registry.register("postgresql", ConditionalUpdateStrategy)
        assert registry.resolve(dialect_of(postgresql, (15,))).name == "conditional_update"
    finally:
        registry.register("postgresql", SkipLockedStrategy)
    assert registry.resolve(dialect_of(postgresql, (15,))).name == "skip_locked"


@pytest.mark.parametrize("name", ["advisory_lock", "skip_locked"])
def test_a_strategy_the_dialect_cannot_run_is_refused_at_construction(name: str, tmp_path: object) -> None:
    engine = sa.create_engine("sqlite://")
    with pytest.raises(tq.StrategyError, match=r"SQLite|sqlite"):
        tq.TaskQueue(engine, strategy=name)


def test_an_unknown_strategy_name_lists_the_known_ones() -> None:
    with pytest.raises(tq.StrategyError, match="advisory_lock, conditional_update, skip_locked"):
        tq.TaskQueue(sa.create_engine("sqlite://"), strategy="fastest")


def test_skip_locked_refuses_a_mysql_without_skip_locked() -> None:
    with pytest.raises(tq.StrategyError, match=r"MariaDB 10\.5\.1 has no SKIP LOCKED"):
        SkipLockedStrategy().check_server(dialect_of(mysql, (10, 5, 1), mariadb=True))


# Live: each backend's own traps ---------------------------------------------------


def test_the_registry_default_is_in_use(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine)
    name = queue.strategy.name  # connects, so the server version is known below
    server = backend_for(engine.dialect)
    version = server.server_version
    expected = {
        "postgresql": "skip_locked",
        "oracle": "skip_locked",
        "sqlite": "conditional_update",
        "mysql": "skip_locked" if version >= (8, 0, 1) else "conditional_update",
        "mariadb": "skip_locked" if version >= (10, 6) else "conditional_update",
    }
    assert name == expected[server.name]


@pytest.mark.requires("update_from_locked_cte")
def test_postgres_claims_in_one_round_trip(engine: sa.Engine) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5))
    enqueue_keys(queue, engine, 5)
    queue.paused.max_age = 3600.0  # the paused queues, read by the first claim, are not read again
    queue.claim()  # the first claim also runs the periodic recovery
    statements: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        claimed = queue.claim(limit=3)
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
    assert len(claimed) == 3
    assert len(statements) == 1, statements


@pytest.mark.requires("skip_locked")
def test_skip_locked_skips_a_row_another_transaction_has_locked(engine: sa.Engine) -> None:
    queue = make_queue(engine, "skip_locked", timedelta(minutes=5))
    first, second, third = enqueue_keys(queue, engine, 3)
    with engine.connect() as other:
        other = other.execution_options(isolation_level="READ COMMITTED")
        with other.begin():
            other.execute(sa.select(TABLE.c.id).where(TABLE.c.id == first).with_for_update())
            assert [t.id for t in queue.claim(limit=2)] == [second, third]
            assert queue.claim() == []
    assert [t.id for t in queue.claim()] == [first], "claimable again once the lock is released"


@pytest.mark.requires("advisory_locks")
def test_advisory_lock_skips_a_task_whose_lock_another_session_holds(engine: sa.Engine) -> None:
    from sa_taskqueue.strategies.advisory import AdvisoryLocks

    queue = make_queue(engine, "advisory_lock", timedelta(minutes=5))
    first, second = enqueue_keys(queue, engine, 2)
    locks = AdvisoryLocks(engine, TABLE)
    with engine.connect() as other:
        assert locks.try_lock(other, [first]) == [first]
        assert [t.id for t in queue.claim(limit=2)] == [second]
        locks.unlock(other, [first])
    assert [t.id for t in queue.claim()] == [first]
    queue.close()


@pytest.mark.requires("advisory_locks")
def test_advisory_claim_holds_locks_only_on_the_tasks_it_returns(engine: sa.Engine) -> None:
    from sa_taskqueue.strategies.advisory import AdvisoryLocks

    queue = make_queue(engine, "advisory_lock", timedelta(minutes=5))
    ids = enqueue_keys(queue, engine, 20)
    claimed = queue.claim(limit=3)
    assert [t.id for t in claimed] == ids[:3]
    locks = AdvisoryLocks(engine, TABLE)
    with engine.connect() as other:
        got = locks.try_lock(other, ids)
        assert got == ids[3:], "every task not returned is free to lock"
        locks.unlock(other, got)
    queue.close()


@pytest.mark.backends("mysql", "mariadb")
def test_mysql_rejects_limit_inside_an_in_subquery(engine: sa.Engine) -> None:
    # Why the MySQL claim is select-then-update: error 1235.
    naive = (
        sa.update(TABLE)
        .where(TABLE.c.id.in_(sa.select(TABLE.c.id).order_by(TABLE.c.id).limit(1)))
        .values(locked_by="x")
    )
    with pytest.raises(sa.exc.DBAPIError) as raised, engine.begin() as conn:
        conn.execute(naive)
    assert raised.value.orig.args[0] == 1235  # type: ignore[union-attr]


def row_of(status: str, **columns: Any) -> dict[str, Any]:
    """A task row to insert as it is, in ``status``, tried once."""
    row = {
        "name": "record",
        "queue": "default",
        "priority": 0,
        "params": {},
        "status": status,
        "run_at": NOW - timedelta(days=1),
        "attempts": 1,
        "max_attempts": 3,
        "created_at": NOW,
    }
    return row | columns


def fill_with_finished_rows(engine: sa.Engine) -> None:
    """18,000 finished rows and 50 queued ones, with fresh planner statistics."""
    finished = [row_of(status) for status in ["completed"] * 15_000 + ["failed"] * 3_000]
    queued = [dict(row, status="queued") for row in finished[:50]]
    with engine.begin() as conn:
        conn.execute(TABLE.insert(), finished + queued)
    analyze(engine)


def analyze(engine: sa.Engine) -> None:
    """Bring the planner's statistics on the task table up to date."""
    with engine.begin() as conn:
        conn.exec_driver_sql(
            {
                "postgresql": "ANALYZE sa_taskqueue_task",
                "mysql": "ANALYZE TABLE sa_taskqueue_task",
                "mariadb": "ANALYZE TABLE sa_taskqueue_task",
                "sqlite": "ANALYZE",
            }[conn.dialect.name]
        )


# Not Oracle: its EXPLAIN PLAN writes the plan to a table instead of answering with it.
@pytest.mark.backends("postgres", "mysql", "mariadb", "sqlite")
def test_the_claim_walks_the_claim_index_past_finished_rows(engine: sa.Engine) -> None:
    fill_with_finished_rows(engine)
    # The statement the default strategy really runs to find its rows.
    plan = tq.TaskQueue(engine).explain_claim(limit=10)
    assert "ix_sa_taskqueue_task_claim" in plan, plan
    assert "Seq Scan" not in plan and "SCAN sa_taskqueue_task\n" not in plan + "\n", plan
    # ... in claim order, with no sort step after it.
    assert not any(sort in plan for sort in ("Sort", "TEMP B-TREE", "filesort")), plan


@pytest.mark.backends("postgres")
def test_the_prepared_claim_walks_the_claim_index_in_a_generic_plan(engine: sa.Engine) -> None:
    # psycopg prepares a statement on the server after five runs, and
    # PostgreSQL may then plan it once for all parameter values.  A partial
    # index serves such a plan only if the query's own SQL implies the index
    # predicate, so the claim must not bind its status as a parameter.
    fill_with_finished_rows(engine)
    queue = tq.TaskQueue(engine)
    compiled = queue.strategy.finding_statement(engine.dialect, TABLE, REQUEST).compile(
        dialect=engine.dialect
    )
    values = compiled.construct_params(REQUEST.params())
    names: list[str] = []

    def numbered(match: re.Match[str]) -> str:
        if match[1] not in names:
            names.append(match[1])
        return f"${names.index(match[1]) + 1}"

    prepared = re.sub(r"%\((\w+)\)s", numbered, compiled.string)
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        from psycopg import sql as psql

        arguments = psql.SQL(", ").join(psql.Literal(values[name]) for name in names).as_string(raw)  # type: ignore[arg-type]
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE claim_plan AS {prepared}".replace("%%", "%"))
        plan = "\n".join(
            row[0]
            for row in conn.exec_driver_sql(f"EXPLAIN EXECUTE claim_plan({arguments})".replace("%", "%%"))
        )
        conn.rollback()
    assert "ix_sa_taskqueue_task_claim" in plan, plan
    assert "Seq Scan" not in plan and "Sort" not in plan, plan


# Not Oracle: its EXPLAIN PLAN writes the plan to a table instead of answering with it.
@pytest.mark.backends("postgres", "mysql", "mariadb", "sqlite")
def test_a_batch_completion_finds_its_rows_by_id_however_many_tasks_run(engine: sa.Engine) -> None:
    running = [
        row_of("running", run_at=NOW, started_at=NOW, locked_by="w", locked_until=NOW + timedelta(minutes=5))
    ] * 3_000
    with engine.begin() as conn:
        conn.execute(TABLE.insert(), running)
        ids = list(conn.execute(sa.select(TABLE.c.id).order_by(TABLE.c.id.desc()).limit(2)).scalars())
    claims = [(task_id, "w", 1, NOW) for task_id in ids]
    params: dict[str, Any] = {HELD_NOW: NOW, "finished_now": NOW}
    backend = backend_for(engine.dialect)
    # The statement each database completes a batch of two with.
    if backend.completes_from_arrays:
        statement = complete_from_arrays_statement(TABLE, HELD_NOW)
        params |= held_claims(claims, [None, None], engine.dialect)
    else:
        statement = complete_many_statement(TABLE, 2, False, returning=backend.update_returning)
        for index, (task_id, locked_by, attempts, started_at) in enumerate(claims):
            params |= {f"held_id_{index}": task_id, f"held_by_{index}": locked_by}
            params |= {f"held_attempts_{index}": attempts, f"held_started_at_{index}": started_at}

    def assert_found_by_id(plan: str) -> None:
        # Its two rows by their ids, not a walk of the lease index over all 3,000 running rows.
        if engine.dialect.name == "postgresql":
            # (An index scan of the primary key, or a bitmap of it.)
            assert re.search(r"Index Scan (using|on) sa_taskqueue_task_pkey", plan), plan
            assert "ix_sa_taskqueue_task_lease" not in plan, plan
            assert "Seq Scan on sa_taskqueue_task" not in plan, plan
        elif engine.dialect.name == "sqlite":
            assert "USING INTEGER PRIMARY KEY" in plan and "ix_sa_taskqueue_task_lease" not in plan, plan
        else:  # EXPLAIN's columns: id, select_type, table, type, possible_keys, key, ...
            assert [line.split()[5] for line in plan.splitlines()] == ["PRIMARY"], plan

    # Before the database has statistics on the new rows (SQLite gathers none
    # unless asked), and after.  (PostgreSQL plans by its statistics, which
    # say the lease index is empty until autovacuum comes by: `Backend.unindexed`.)
    if engine.dialect.name != "postgresql":
        assert_found_by_id(explain(engine, statement, params))
    analyze(engine)
    assert_found_by_id(explain(engine, statement, params))


class AppBase(DeclarativeBase):
    pass


class AppTask(tq.TaskMixin, AppBase):
    __tablename__ = "app_tasks"


def test_task_mixin_maps_on_an_applications_own_base(engine: sa.Engine) -> None:
    assert {index.name for index in AppTask.__table__.indexes} == {
        "ix_app_tasks_claim",
        "ix_app_tasks_lease",
        "ix_app_tasks_finished",
        "ux_app_tasks_unique",
        "ux_app_tasks_slot",
        "ix_app_tasks_batch",
    }
    assert "app_tasks_control" in AppBase.metadata.tables
    assert "app_tasks_dependencies" in AppBase.metadata.tables
    assert "app_tasks_batches" in AppBase.metadata.tables
    AppBase.metadata.drop_all(engine)
    AppBase.metadata.create_all(engine)
    try:
        queue = tq.TaskQueue(engine, model=AppTask)

        @queue.task(name="hello")
        def hello(who: str) -> str:
            return f"hello {who}"

        with Session(engine) as session:
            hello.enqueue(session, who="world")
            session.commit()
        [claimed] = queue.claim()
        assert queue.complete(claimed, hello(**claimed.params))
        with Session(engine) as session:
            row = session.scalars(sa.select(AppTask)).one()
            assert (row.status, row.result) == (tq.TaskStatus.COMPLETED, "hello world")
        queue.close()
    finally:
        AppBase.metadata.drop_all(engine)


@pytest.mark.backends("mariadb")
def test_a_mariadb_url_gets_the_mysql_family_treatment(backend: Backend, engine: sa.Engine) -> None:
    # SQLAlchemy names the dialect "mariadb" under a mariadb:// URL and
    # "mysql" (with is_mariadb) under mysql://; both must get DATETIME(6),
    # MEDIUMTEXT, READ COMMITTED claims and every strategy.
    url = sa.make_url(backend.url)
    mariadb_engine = sa.create_engine(url.set(drivername="mariadb+pymysql"))
    assert mariadb_engine.dialect.name == "mariadb"
    compiled = str(CreateTable(TABLE).compile(dialect=mariadb_engine.dialect))
    assert "run_at DATETIME(6) NOT NULL" in compiled
    assert "last_error MEDIUMTEXT" in compiled
    for strategy in ("skip_locked", "advisory_lock", "conditional_update"):
        queue = make_queue(mariadb_engine, strategy, timedelta(minutes=5))
        with Session(mariadb_engine) as session:
            task_id = queue.enqueue(session, "record", {"key": 1}).id
            session.commit()
        [claimed] = queue.claim()
        assert claimed.id == task_id
        assert claimed.started_at.microsecond == load_started_at(mariadb_engine, task_id).microsecond
        assert queue.complete(claimed) is True
        queue.close()
    assert tq.TaskQueue(mariadb_engine).strategy.name == "skip_locked"
    mariadb_engine.dispose()


def load_started_at(engine: sa.Engine, task_id: int) -> datetime:
    with engine.connect() as conn:
        value = conn.scalar(sa.select(TABLE.c.started_at).where(TABLE.c.id == task_id))
    assert value is not None
    return value


@pytest.mark.backends("mysql", "mariadb")
def test_mysql_claims_under_read_committed(engine: sa.Engine) -> None:
    strategy = SkipLockedStrategy()
    with strategy.transaction(engine) as conn:
        conn.execute(locking_select(TABLE, REQUEST, TABLE.c.id).limit(1), REQUEST.params())
        level = conn.execute(
            sa.text(
                "SELECT trx_isolation_level FROM information_schema.innodb_trx "
                "WHERE trx_mysql_thread_id = CONNECTION_ID()"
            )
        ).scalar_one()
    assert level == "READ COMMITTED"
    with engine.connect() as conn:
        # MariaDB still calls it tx_isolation; MySQL 8 only transaction_isolation.
        variable = "tx_isolation" if getattr(conn.dialect, "is_mariadb", False) else "transaction_isolation"
        session_level = conn.execute(sa.text(f"SELECT @@SESSION.{variable}")).scalar_one()
    assert session_level == "REPEATABLE-READ", "the application's own transactions are left alone"


@pytest.mark.backends("mysql", "mariadb")
def test_mysql_kept_connections_stay_at_read_committed_and_go_back_to_the_pool_as_they_came(
    engine: sa.Engine,
) -> None:
    # A kept connection is set to READ COMMITTED once, so its claims send no
    # SET TRANSACTION each; once given back, the pool hands it out as it was.
    strategy = SkipLockedStrategy()
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement)

    # MariaDB still calls it tx_isolation; MySQL 8 only transaction_isolation.
    variable = "tx_isolation" if getattr(engine.dialect, "is_mariadb", False) else "transaction_isolation"
    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        for _ in range(3):
            with strategy.transaction(engine) as conn:
                conn.execute(locking_select(TABLE, REQUEST, TABLE.c.id).limit(1), REQUEST.params())
                level = conn.execute(sa.text(f"SELECT @@SESSION.{variable}")).scalar_one()
                assert level == "READ-COMMITTED"
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    assert not [statement for statement in sent if statement.upper().startswith("SET")]
    strategy.executor.close()
    with contextlib.ExitStack() as stack:
        # Every connection the pool holds, the one given back among them.
        conns = [stack.enter_context(engine.connect()) for _ in range(engine.pool.checkedin() + 1)]
        levels = {conn.execute(sa.text(f"SELECT @@SESSION.{variable}")).scalar_one() for conn in conns}
    assert levels == {"REPEATABLE-READ"}


@pytest.mark.backends("mysql", "mariadb")
def test_mysql_strategies_without_locking_reads_keep_the_pools_isolation_level(engine: sa.Engine) -> None:
    variable = "tx_isolation" if getattr(engine.dialect, "is_mariadb", False) else "transaction_isolation"
    strategy = ConditionalUpdateStrategy()
    try:
        with strategy.executor.transaction(engine) as conn:
            level = conn.execute(sa.text(f"SELECT @@SESSION.{variable}")).scalar_one()
    finally:
        strategy.executor.close()
    assert level == "REPEATABLE-READ"


def _ddl(dialect: sa.engine.Dialect) -> str:
    """The task table's CREATE TABLE and CREATE INDEX statements for ``dialect``."""
    statements = [CreateTable(TABLE), *(CreateIndex(index) for index in TABLE.indexes)]
    return "\n".join(str(statement.compile(dialect=dialect)) for statement in statements)


def test_oracle_keeps_keys_single_with_unique_indexes_on_virtual_columns() -> None:
    """Oracle indexes a virtual column as a function-based index, and leaves out rows whose key is NULL."""
    ddl = _ddl(oracle.dialect())
    for column in ("active_unique_key", "running_slot_key"):
        line = next(line for line in ddl.splitlines() if line.strip().startswith(column))
        assert "GENERATED ALWAYS AS (CASE WHEN" in line
        assert "STORED" not in line and "VIRTUAL" not in line  # Oracle has virtual columns only
    # One column per index: a composite unique index would clash on rows
    # whose name is set and whose key is NULL.
    assert "CREATE UNIQUE INDEX ux_sa_taskqueue_task_unique ON sa_taskqueue_task (active_unique_key)" in ddl
    assert "CREATE UNIQUE INDEX ux_sa_taskqueue_task_slot ON sa_taskqueue_task (running_slot_key)" in ddl
    # Oracle's || reads NULL as '', so the CASE tests each part for NULL itself.
    assert "concurrency_key IS NOT NULL AND concurrency_slot IS NOT NULL" in ddl


@pytest.mark.parametrize(
    ("dialect", "generated"),
    [
        (postgresql.dialect(), "STORED"),  # only stored generated columns can be indexed there
        (mysql.dialect(), "concat("),  # MySQL's || is OR
        (sqlite.dialect(), "END)"),  # virtual: ALTER TABLE ADD COLUMN can add it in place
    ],
)
def test_the_key_columns_are_generated_in_a_form_each_database_indexes(
    dialect: sa.engine.Dialect, generated: str
) -> None:
    line = next(line for line in _ddl(dialect).splitlines() if line.strip().startswith("active_unique_key"))
    assert generated in line
    if dialect.name != "postgresql":
        assert "STORED" not in line
