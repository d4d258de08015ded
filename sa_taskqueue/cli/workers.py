"""``sa-taskqueue workers``: the live workers and what each runs; and ``status``'s line on unserved tasks.

The rows are the workers' own (`sa_taskqueue.features.live_workers`): each
worker writes one as it starts, moves it on with its heartbeat and deletes
it as it stops; a worker that died drops out once its heartbeat lapses.
Printed as a block per worker rather than a table, so that long ids, queue
lists and task names are printed whole, on a terminal or through a pipe.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import click
import sqlalchemy as sa

from sa_taskqueue.cli.main import _app_option, _on_queue, _target, _url_option, cli, for_people
from sa_taskqueue.cli.render import human_age
from sa_taskqueue.core.exceptions import SchemaMissing
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.core.worker_table import worker_table_of
from sa_taskqueue.features.live_workers import (
    LiveWorker,
    describe_unserved,
    list_live_workers,
    unserved_tasks,
)


@cli.command("workers")
@click.argument("app_argument", metavar="[APP]", required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of the live workers, for scripts.")
@_app_option
@_url_option
@click.pass_context
def workers_command(
    ctx: click.Context, app_argument: str | None, as_json: bool, app: str | None, url: str | None
) -> None:
    """The live workers: id, host, pid, queues, task names, concurrency, version, times, what each runs.

    A worker is live from its start until it stops; one that died without
    stopping (SIGKILL, a lost machine) drops out once a few of its
    heartbeats have passed without one.  Given APP (MODULE:QUEUE_OBJECT, as
    an argument or --app), the workers of APP's table and database, unless
    --url is given on the command line.
    """
    if app_argument is not None and app is not None:
        raise click.UsageError("give APP or --app, not both")
    app = app if app is not None else app_argument
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    now = utcnow()
    with for_people(ctx, target.url):
        workers = _on_queue(target.queue, _live, now)
    if as_json:
        click.echo(json.dumps([worker_json(worker) for worker in workers], indent=2))
        return
    table = worker_table_of(target.queue.table).name
    if not workers:
        click.echo(f"no live workers ({table})")
        return
    click.echo(f"{len(workers)} live worker(s) ({table})")
    for worker in workers:
        click.echo("")
        for line in worker_lines(worker, now):
            click.echo(line)


def _live(engine: sa.Engine, table: sa.Table, /, now: datetime) -> list[LiveWorker]:
    return list_live_workers(engine, table, now=now)


def worker_lines(worker: LiveWorker, now: datetime) -> list[str]:
    """One worker as lines: who and where, what it serves, its times, what it runs."""
    lines = [
        f"worker {worker.id}",
        f"  host {worker.host}, pid {worker.pid}, sa_taskqueue {worker.version}, "
        f"concurrency {worker.concurrency}",
        f"  queues: {', '.join(worker.queues) if worker.queues != ['*'] else '* (every queue)'}",
        f"  task names: {', '.join(worker.task_names) or '(none registered)'}",
        f"  started {_time(worker.started_at)} ({human_age(now - worker.started_at)} ago), "
        f"last heartbeat {human_age(now - worker.heartbeat_at)} ago, "
        f"live until {_time(worker.expires_at)} unless it beats again",
    ]
    if not worker.running:
        lines.append("  running: nothing")
        return lines
    lines.append(f"  running {len(worker.running)}:")
    for task in worker.running:
        since = f", for {human_age(now - task.started_at)}" if task.started_at is not None else ""
        until = f", lease until {_time(task.locked_until)}" if task.locked_until is not None else ""
        lines.append(f"    task {task.id} {task.name} ({task.queue}){since}{until}")
    return lines


def worker_json(worker: LiveWorker) -> dict[str, Any]:
    """A worker as JSON takes it: every field, times in ISO 8601."""
    return {
        "id": worker.id,
        "host": worker.host,
        "pid": worker.pid,
        "queues": worker.queues,
        "task_names": worker.task_names,
        "concurrency": worker.concurrency,
        "version": worker.version,
        "started_at": worker.started_at.isoformat(),
        "heartbeat_at": worker.heartbeat_at.isoformat(),
        "expires_at": worker.expires_at.isoformat(),
        "running": [
            {
                "id": task.id,
                "name": task.name,
                "queue": task.queue,
                "started_at": task.started_at.isoformat() if task.started_at is not None else None,
                "locked_until": task.locked_until.isoformat() if task.locked_until is not None else None,
            }
            for task in worker.running
        ],
    }


def _time(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def unserved_line(engine: sa.Engine, table: sa.Table, /) -> str:
    """``status``'s line on the due tasks no live worker serves: by queue and name, with count and age."""
    try:
        groups = unserved_tasks(engine, table, now=utcnow())
    except SchemaMissing as missing:
        # A database not migrated since the live-worker table came: the rest of status still holds.
        return f"no live worker serves: unknown ({missing})"
    if not groups:
        return "no live worker serves: none (a live worker serves every due task's queue and name)"
    return f"no live worker serves: {describe_unserved(groups)}"


__all__ = ["unserved_line", "worker_json", "worker_lines", "workers_command"]
