"""``sa-taskqueue batches`` and ``sa-taskqueue batch ID``: batches, their counts and their members."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import click
import sqlalchemy as sa
from rich.console import Console
from rich.table import Table as RichTable

from sa_taskqueue.cli import params as cli_params
from sa_taskqueue.cli.main import (
    Failure,
    _app_option,
    _on_queue,
    _target,
    _url_option,
    cli,
    for_people,
    redactor,
)
from sa_taskqueue.cli.render import output_console
from sa_taskqueue.features.workflows import batches as batch_rows
from sa_taskqueue.features.workflows.batches import BatchState

#: Batches ``sa-taskqueue batches`` lists unless told.
DEFAULT_LIMIT = 50


def _listing(engine: sa.Engine, table: sa.Table, /, limit: int, unfinished: bool) -> list[BatchState]:
    with engine.connect() as conn:
        return batch_rows.listing(conn, table, limit=limit, unfinished=unfinished)


def _one(engine: sa.Engine, table: sa.Table, /, batch_id: int) -> tuple[BatchState | None, dict[str, int]]:
    with engine.connect() as conn:
        state = batch_rows.read(conn, table, batch_id)
        members = batch_rows.member_statuses(conn, table, batch_id) if state is not None else {}
        return state, members


def _when(value: datetime | None) -> str:
    return "" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


@cli.command("batches")
@click.option("--limit", type=cli_params.BoundedInt(1, 10_000), default=DEFAULT_LIMIT, show_default=True)
@click.option("--unfinished", is_flag=True, help="Only batches whose callbacks have not run yet.")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of the batches, for scripts.")
@_app_option
@_url_option
@click.pass_context
def batches_command(
    ctx: click.Context, limit: int, unfinished: bool, as_json: bool, app: str | None, url: str | None
) -> None:
    """The newest batches first: status, counts by outcome, pending members, when created and finished."""
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    with for_people(ctx, target.url):
        states = _on_queue(target.queue, _listing, limit, unfinished)
    if as_json:
        click.echo(json.dumps([redactor.value(state.as_json()) for state in states]))
        return
    print_batches(output_console(), states)


def print_batches(console: Console, states: list[BatchState]) -> None:
    """The batches as a table, newest first."""
    table = RichTable(title="batches (newest first)")
    for heading, justify in (
        ("id", "right"),
        ("name", "left"),
        ("status", "left"),
        ("total", "right"),
        ("succeeded", "right"),
        ("failed", "right"),
        ("cancelled", "right"),
        ("pending", "right"),
        ("created (UTC)", "left"),
        ("finished (UTC)", "left"),
    ):
        table.add_column(heading, justify=justify)  # type: ignore[arg-type]
    for state in states:
        status = state.status if state.outcome is None else f"{state.status}: {state.outcome}"
        table.add_row(
            str(state.id),
            redactor.text(state.name or ""),
            status,
            str(state.total),
            str(state.succeeded),
            str(state.failed),
            str(state.cancelled),
            str(state.pending),
            _when(state.created_at),
            _when(state.finished_at),
        )
    if not states:
        table.add_row("", "(no batches)", "", "", "", "", "", "", "", "")
    console.print(table)


@cli.command("batch")
@click.argument("batch_id", type=cli_params.TASK_ID)
@click.option("--json", "as_json", is_flag=True, help="One JSON object of the batch, for scripts.")
@_app_option
@_url_option
@click.pass_context
def batch_command(ctx: click.Context, batch_id: int, as_json: bool, app: str | None, url: str | None) -> None:
    """Batch BATCH_ID: its counts by outcome, its members by status now, its times and callbacks."""
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    with for_people(ctx, target.url):
        state, members = _on_queue(target.queue, _one, batch_id)
    if state is None:
        raise Failure(f"no batch {batch_id} in {target.queue.table.name}")
    if as_json:
        click.echo(json.dumps(redactor.value({**state.as_json(), "members": members}), indent=2))
        return
    print_batch(output_console(), state, members)


def print_batch(console: Console, state: BatchState, members: dict[str, int]) -> None:
    """One batch: a table of its fields, then its members by status and its callbacks."""
    table = RichTable(title=f"batch {state.id}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    rows: list[tuple[str, Any]] = [
        ("name", state.name or ""),
        ("status", state.status),
        ("outcome", state.outcome or ""),
        ("total", state.total),
        ("succeeded", state.succeeded),
        ("failed", state.failed),
        ("cancelled", state.cancelled),
        ("pending", state.pending),
        ("created (UTC)", _when(state.created_at)),
        ("closed (UTC)", _when(state.closed_at)),
        ("finished (UTC)", _when(state.finished_at)),
        (
            "members now",
            ", ".join(f"{status} {count}" for status, count in sorted(members.items())) or "none",
        ),
    ]
    for field, value in rows:
        table.add_row(field, redactor.text(str(value)))
    console.print(table)
    if state.callbacks:
        callbacks = RichTable(title="callbacks")
        for heading in ("on", "task", "queue", "params"):
            callbacks.add_column(heading)
        for spec in state.callbacks:
            callbacks.add_row(
                spec.on,
                spec.name,
                spec.queue,
                redactor.text(json.dumps(spec.params, sort_keys=True, default=str)),
            )
        console.print(callbacks)
    else:
        console.print("callbacks: none")


__all__ = ["batch_command", "batches_command", "print_batch", "print_batches"]
