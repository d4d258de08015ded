"""`explain`: the database's plan for a statement, run exactly as the queue runs it."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, event

from sa_taskqueue.backends import backend_for


def explain(engine: Engine, statement: Any, params: dict[str, Any]) -> str:
    """The plan of ``statement`` with ``params``, one line per row the database answers with.

    The statement is compiled and bound exactly as a claim runs it, and the
    backend's EXPLAIN prefix is put in front of it on its way to the driver,
    so the plan is the one the claim gets.  Nothing is written: the
    transaction is rolled back.
    """
    prefix = backend_for(engine.dialect).explain_prefix
    plan: list[Any] = []

    def explained(_conn: Any, _cursor: Any, sql: str, parameters: Any, *_rest: Any) -> tuple[str, Any]:
        return prefix + sql, parameters

    def capture(_conn: Any, cursor: Any, *_rest: Any) -> None:
        if cursor.description is not None:
            plan.extend(cursor.fetchall())

    with engine.connect() as conn:
        event.listen(conn, "before_cursor_execute", explained, retval=True)
        event.listen(conn, "after_cursor_execute", capture)
        try:
            with conn.begin() as transaction:
                conn.execute(statement, params)
                transaction.rollback()
        finally:
            event.remove(conn, "before_cursor_execute", explained)
            event.remove(conn, "after_cursor_execute", capture)
    return "\n".join(" ".join(str(value) for value in row) for row in plan)


__all__ = ["explain"]
