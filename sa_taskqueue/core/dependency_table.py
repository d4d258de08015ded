"""The dependency table beside each task table: one row per edge, parent to child.

A task enqueued with ``depends_on`` waits (status ``waiting``) until every
parent has finished.  A task's parents exist when it is created and its
edges never change afterwards, so the graph can have no cycle.  The primary
key (parent, child) serves "the children of a finished parent"; the index on
``child_id`` serves "the parents of a task" (the results a chain step reads).

No foreign keys: retention deletes finished tasks in bulk, whatever edges
name them, and a finished parent's edges matter no more.

`TaskMixin` declares the table on the same `MetaData` as the task table,
named ``<task table>_dependencies``, so ``create_all`` and Alembic's
autogenerate see it.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Index, MetaData, Table


def dependency_table_name(task_table_name: str) -> str:
    """The dependency table's name for a task table's: ``<task table>_dependencies``."""
    return f"{task_table_name}_dependencies"


def dependency_table(metadata: MetaData, task_table_name: str) -> Table:
    """The dependency table of the task table ``task_table_name``, declared on ``metadata`` once."""
    name = dependency_table_name(task_table_name)
    key = name if metadata.schema is None else f"{metadata.schema}.{name}"
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    return Table(
        name,
        metadata,
        Column("parent_id", BigInteger, primary_key=True, autoincrement=False),
        Column("child_id", BigInteger, primary_key=True, autoincrement=False),
        Index(f"ix_{name}_child", "child_id"),
    )


def dependency_table_of(task_table: Table) -> Table:
    """The dependency table beside ``task_table`` (declared by `TaskMixin`), declaring it if missing."""
    return dependency_table(task_table.metadata, task_table.name)


__all__ = ["dependency_table", "dependency_table_name", "dependency_table_of"]
