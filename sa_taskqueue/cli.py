"""The command line: ``sa-taskqueue`` or ``python -m sa_taskqueue``."""

from __future__ import annotations

import os
import sys

import click
import sqlalchemy as sa

from sa_taskqueue.demo import DEFAULT_URL, run_demo

URL_ENV = "SA_TASKQUEUE_DATABASE_URL"


@click.group()
def cli() -> None:
    """sa_taskqueue: a task queue in the SQL database you already have."""


@cli.command()
@click.option(
    "--tasks", default=300, show_default=True, type=click.IntRange(1), help="How many tasks to enqueue."
)
@click.option("--workers", default=4, show_default=True, type=click.IntRange(1), help="Worker processes.")
@click.option(
    "--url", default=DEFAULT_URL, show_default=True, help="Database URL (the demo uses tables of its own)."
)
def demo(tasks: int, workers: int, url: str) -> None:
    """Enqueue TASKS tasks and drain them with WORKERS processes, then summarise."""
    click.echo(f"sa_taskqueue demo: {tasks} tasks, {workers} worker processes, {_safe(url)}")
    summary = run_demo(url, tasks, workers, progress=sys.stdout.isatty())
    rate = summary.tasks / summary.seconds if summary.seconds else float("inf")
    click.echo(f"  drained in {summary.seconds:.2f}s: {rate:,.0f} tasks/s")
    click.echo(f"  statuses: {dict(sorted(summary.statuses.items()))}")
    share = ", ".join(str(count) for _, count in summary.runs_per_worker.most_common())
    click.echo(f"  tasks per worker process: {share}")
    if summary.exactly_once:
        click.echo("  every task ran exactly once")
        return
    twice = sorted(n for n, count in summary.runs_per_task.items() if count > 1)
    missing = sorted(set(range(summary.tasks)) - set(summary.runs_per_task))
    click.echo(f"  NOT exactly once: ran twice {twice[:10]}, never ran {missing[:10]}", err=True)
    sys.exit(1)


@cli.command()
@click.option("--url", envvar=URL_ENV, help=f"Database URL (default: ${URL_ENV}).")
@click.option("--revision", default="head", show_default=True, help="Migrate to this revision.")
def migrate(url: str | None, revision: str) -> None:
    """Create or upgrade the task table with the package's alembic migrations."""
    from sa_taskqueue.migrate import upgrade

    if not url:
        raise click.UsageError(f"no database URL: pass --url or set {URL_ENV}")
    try:
        upgrade(url, revision)
    except sa.exc.ArgumentError as error:
        raise click.ClickException(f"bad database URL {_safe(url)}: {error}") from error
    except sa.exc.OperationalError as error:
        raise click.ClickException(f"cannot reach the database at {_safe(url)}: {error.orig}") from error
    click.echo(f"migrated {_safe(url)} to {revision}")


def _safe(url: str) -> str:
    """The URL with any password hidden."""
    try:
        return sa.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return url


def main() -> None:
    cli(
        prog_name=os.path.basename(sys.argv[0]) if not sys.argv[0].endswith("__main__.py") else "sa_taskqueue"
    )
