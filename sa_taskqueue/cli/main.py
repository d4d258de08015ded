"""The command line: ``sa-taskqueue`` (or ``python -m sa_taskqueue``).

Errors are for people: a bad URL, an unreachable server, a missing table or
an application that does not import each give one line on stderr and a
non-zero exit; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import getpass
import importlib
import json
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import click
import sqlalchemy as sa
from rich.table import Table as RichTable

from sa_taskqueue import __version__
from sa_taskqueue.backends import SERVED_BY, backend_for
from sa_taskqueue.cli import params as cli_params
from sa_taskqueue.cli.demo import DEFAULT_URL, run_demo
from sa_taskqueue.cli.preflight import (
    driver_hint,
    engine_for_url,
    is_driver,
    misnamed_dialect_hint,
    missing_database_message,
)
from sa_taskqueue.cli.render import (
    LISTED_VALUE_LENGTH,
    human_age,
    output_console,
    print_list,
    print_task,
    row_json,
    rows_json,
)
from sa_taskqueue.core import validation
from sa_taskqueue.core.control import control_table_of
from sa_taskqueue.core.exceptions import (
    DatabaseBusy,
    DatabaseError,
    DatabaseUnavailable,
    SchemaMissing,
    TaskQueueError,
)
from sa_taskqueue.core.limits import ColumnLimits
from sa_taskqueue.core.log_fields import TASK_LOG_FIELDS
from sa_taskqueue.core.model import Task, TaskStatus
from sa_taskqueue.core.model import metadata as library_metadata
from sa_taskqueue.core.redaction import Redactor, has_unescaped_at
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.features import admin, schedules, unique
from sa_taskqueue.features.admin import Admin, StatusReport, UnregisteredTasks
from sa_taskqueue.features.live_workers import unserved_line
from sa_taskqueue.features.pausing import read_paused, set_paused
from sa_taskqueue.health import HealthThresholds, health_lines
from sa_taskqueue.queue import TaskQueue
from sa_taskqueue.worker.cancelling import DEFAULT_CANCEL_GRACE
from sa_taskqueue.worker.worker import DEFAULT_COMPLETION_DELAY

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

URL_ENV = "SA_TASKQUEUE_DATABASE_URL"

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger("sa_taskqueue")

#: The secrets of every URL this command was given: whatever it prints (its
#: messages, the driver's errors, the worker's log lines) is shown without them.
redactor = Redactor()


class Failure(click.ClickException):
    """A failure explained in one line; exit code 1."""

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {redactor.text(self.format_message())}", err=True)


@click.group()
@click.version_option(__version__, "--version", prog_name="sa-taskqueue", message="%(prog)s %(version)s")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.option(
    "--url",
    default=None,
    help=f"Database URL for the command that follows (as its own --url; default: ${URL_ENV}).",
)
@click.pass_context
def cli(ctx: click.Context, debug: bool, url: str | None) -> None:
    """sa_taskqueue: a task queue in the SQL database you already have."""
    ctx.obj = {"debug": debug, "url": url}
    # An application the worker imports may build its engine from it.
    redactor.remember(os.environ.get(URL_ENV))
    redactor.remember(url)


# Errors ------------------------------------------------------------------------


@contextmanager
def for_people(ctx: click.Context, url: str | sa.URL | None = None) -> Iterator[None]:
    """Turn the errors a user can cause into one line each (unless --debug)."""
    redactor.remember(url)
    if ctx.obj and ctx.obj.get("debug"):
        try:
            yield
        except click.ClickException:
            raise
        except Exception:  # noqa: BLE001 - shown whole, as asked for, then the exit
            # The traceback, as asked for, but with no password in it.
            click.echo(redactor.text(traceback.format_exc()), err=True)
            raise SystemExit(1) from None
        return
    where = f" at {_safe(url)}" if url else ""
    try:
        yield
    except click.ClickException:
        raise
    except SchemaMissing as error:
        raise Failure(f"{error}") from error
    except DatabaseBusy as error:
        raise Failure(f"{error}{where}; try again once it commits") from error
    except DatabaseUnavailable as error:
        raise Failure(f"cannot use the database{where}: {_driver_detail(error)}") from error
    except DatabaseError as error:
        raise Failure(f"the database refused a statement{where}: {_driver_detail(error)}") from error
    except TaskQueueError as error:
        raise Failure(str(error)) from error
    except sa.exc.ArgumentError as error:  # NoSuchModuleError too: no dialect of the URL's name
        hint = misnamed_dialect_hint(url) if isinstance(error, sa.exc.NoSuchModuleError) else None
        raise Failure(f"bad database URL {_safe(url or '')}: {hint or error}") from error
    except ModuleNotFoundError as error:
        raise Failure(
            f"a database driver is missing ({error.name}): {driver_hint(error.name, url)}"
        ) from error
    except (sa.exc.OperationalError, sa.exc.InterfaceError) as error:
        busy = _busy(error, url)
        if busy is not None:
            raise Failure(f"{busy}{where}; try again once it commits") from error
        raise Failure(f"cannot use the database{where}: {_first_line(error.orig)}") from error
    except sa.exc.DBAPIError as error:
        raise Failure(f"the database refused a statement{where}: {_first_line(error.orig)}") from error
    except sa.exc.SQLAlchemyError as error:
        raise Failure(f"{_first_line(error)}") from error
    except (ConnectionError, socket.gaierror, TimeoutError) as error:
        # An asyncio driver's failure to connect can arrive as the socket's own error (asyncpg's).
        raise Failure(f"cannot use the database{where}: {_first_line(error)}") from error
    except ValueError as error:  # e.g. a URL whose port is not a number
        raise Failure(f"{_first_line(error)}{where}") from error


def _driver_detail(error: BaseException) -> str:
    """The first line of what the driver said, under our translated error."""
    cause = error.__cause__
    return _first_line(getattr(cause, "orig", None) or cause or error)


def _busy(error: sa.exc.DBAPIError, url: str | sa.URL | None) -> str | None:
    """What to say when ``error`` is a lock wait that ran out (SQLite's busy timeout), else None."""
    try:
        dialect = sa.make_url(url).get_dialect()() if url else None
    except Exception:  # noqa: BLE001 - no dialect to ask: say what the driver said
        return None
    return backend_for(dialect).busy(error.orig) if dialect is not None else None


def _first_line(error: BaseException | None) -> str:
    text = str(error).strip() if error is not None else "unknown error"
    return text.splitlines()[0] if text else type(error).__name__


def _safe(url: str | sa.URL) -> str:
    """The URL with its password and secret query values hidden, even when it does not parse."""
    redactor.remember(url)
    return redactor.url(url)


def _engine(url: str | None) -> sa.Engine | AsyncEngine:
    """An engine for ``url`` (an `AsyncEngine` for an asyncio driver's: `engine_for_url`)."""
    return engine_for_url(_checked_url(url))


def _checked_url(url: str | None) -> str:
    """``url``, if there is one and it can be handed to a driver."""
    if not url:
        raise click.UsageError(f"no database URL: pass --url or set {URL_ENV}")
    if has_unescaped_at(sa.make_url(url)):
        # The driver would be sent the password's tail as the host name.
        raise Failure(f"bad database URL {_safe(url)}: write an @ in the password as %40")
    return url


def _url_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--url", envvar=URL_ENV, callback=_url_before_command, help=f"Database URL (default: ${URL_ENV})."
    )(func)


def _app_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--app",
        metavar="MODULE:QUEUE",
        default=None,
        help="Act on this TaskQueue's table and database (what `worker APP` loads) instead of --url's "
        "sa_taskqueue_task.",
    )(func)


def _url_before_command(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A command's ``--url``: the one typed before the command (``sa-taskqueue --url X status``) if any.

    Typed both before and after the command, the two must agree: which
    database a ``purge`` deletes from is not left to a precedence rule.
    """
    before = _url_typed_before(ctx)
    if before is None:
        return value
    typed_after = ctx.get_parameter_source(param.name or "url") is click.core.ParameterSource.COMMANDLINE
    if typed_after and value != before:
        raise click.UsageError(
            "--url is given before the command and after it, with different URLs: give it once", ctx
        )
    return before


def _url_typed_before(ctx: click.Context) -> str | None:
    """The ``--url`` typed before the command's name, or None."""
    obj = ctx.find_root().obj
    return obj.get("url") if isinstance(obj, dict) else None


def _url_typed(ctx: click.Context) -> bool:
    """Whether the command's URL was typed on the command line (before or after its name), not read
    from the environment."""
    return (
        ctx.get_parameter_source("url") is click.core.ParameterSource.COMMANDLINE
        or _url_typed_before(ctx) is not None
    )


# worker --------------------------------------------------------------------------


def load_queue(spec: str) -> TaskQueue:
    """Import ``module:attribute`` (like ``uvicorn app:app``) and check it is a TaskQueue."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise Failure(f"{spec!r} is not MODULE:QUEUE_OBJECT (for example myapp.tasks:queue)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and is_driver(error.name):
            # The application builds its engine at import: its driver is what is missing.
            raise Failure(
                f"cannot import {module_name!r}: a database driver is missing ({error.name}): "
                f"{driver_hint(error.name, None)}"
            ) from error
        raise Failure(f"cannot import {module_name!r}: {error}") from error
    except sa.exc.NoSuchModuleError as error:
        # The application builds its engine at import, on a URL SQLAlchemy has no dialect for.
        hint = misnamed_dialect_hint(_dialect_url_of(error))
        if hint is None:
            raise Failure(f"importing {module_name!r} failed: {type(error).__name__}: {error}") from error
        raise Failure(f"cannot import {module_name!r}: its database URL: {hint}") from error
    except Exception as error:
        raise Failure(f"importing {module_name!r} failed: {type(error).__name__}: {error}") from error
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise Failure(f"{module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(target, TaskQueue):
        raise Failure(f"{spec} is a {type(target).__name__}, not a sa_taskqueue.TaskQueue")
    return target


def _dialect_url_of(error: sa.exc.NoSuchModuleError) -> str | None:
    """The URL scheme SQLAlchemy could not load a dialect for ("sqlalchemy.dialects:postgres.asyncpg"
    gives ``postgres+asyncpg://``), or None."""
    _, found, name = str(error).partition("sqlalchemy.dialects:")
    return f"{name.strip().replace('.', '+')}://" if found and name.strip() else None


class RedactingFormatter(logging.Formatter):
    """Another formatter's lines with the command's secrets hidden (a driver may echo a DSN)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return redactor.text(self.inner.format(record))


class JSONFormatter(logging.Formatter):
    """One JSON object per line, for log shippers: time (ISO 8601, UTC), level, logger, message, and
    the task's fields where the line is about one (task_id, task_name, queue, attempt, duration_ms,
    worker_id, error)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        # The fields the worker attaches to its lines about a task (sa_taskqueue.core.log_fields).
        for key in TASK_LOG_FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        formatter: logging.Formatter = JSONFormatter()
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(RedactingFormatter(formatter))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


#: The options of every command that runs a worker: ``sa-taskqueue worker`` and
#: ``flask sa-taskqueue worker`` (`sa_taskqueue.integrations.flask`), so the two read alike.
WORKER_OPTIONS: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
    click.option(
        "--concurrency", default=1, show_default=True, type=cli_params.CONCURRENCY, help="Tasks at once."
    ),
    click.option("--queues", default=None, help="Comma-separated queues to serve (default: all)."),
    click.option(
        "--isolation",
        type=click.Choice(["thread", "process"]),
        default="thread",
        show_default=True,
        help="Run each task in a thread, or in a child process of its own (a crash fails that task alone).",
    ),
    click.option("--burst", is_flag=True, help="Exit once nothing is due."),
    click.option(
        "--poll-interval",
        default=1.0,
        show_default=True,
        type=cli_params.POLL_INTERVAL,
        help="The longest wait in seconds between polls while idle.",
    ),
    click.option(
        "--shutdown-timeout",
        default=30.0,
        show_default=True,
        type=cli_params.SHUTDOWN_TIMEOUT,
        help="Seconds running tasks get to finish after SIGTERM before they are given back.",
    ),
    click.option(
        "--cancel-grace",
        default=DEFAULT_CANCEL_GRACE,
        show_default=True,
        type=cli_params.SHUTDOWN_TIMEOUT,
        help="Seconds a cancelled task process gets to stop before it is killed (--isolation process).",
    ),
    click.option(
        "--completion-delay",
        default=DEFAULT_COMPLETION_DELAY,
        show_default=True,
        type=cli_params.COMPLETION_DELAY,
        help="Seconds a success may wait for the other tasks claimed, to share their statement (0: none).",
    ),
    click.option(
        "--no-listen",
        is_flag=True,
        help=(
            f"Poll for work instead of waiting on LISTEN ({SERVED_BY['listen']}): "
            "for a pooler in transaction mode."
        ),
    ),
    click.option(
        "--no-self-test",
        is_flag=True,
        help="Start without proving the database's locking first (see `sa-taskqueue doctor`).",
    ),
    click.option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help=(
            "Log lines as text, or as one JSON object each with the task's fields "
            "(task_id, duration_ms, ...)."
        ),
    ),
    click.option(
        "--log-level",
        type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
        default="info",
        show_default=True,
        help="The least severe log lines written (any case: DEBUG, debug).",
    ),
]


def worker_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add `WORKER_OPTIONS` to a click command, in the order ``--help`` lists them."""
    for option in reversed(WORKER_OPTIONS):
        command = option(command)
    return command


def parse_queues(queues: str | None) -> list[str] | None:
    """``--queues a,b``: the queue names, or None (every queue) when not given."""
    return [q.strip() for q in queues.split(",") if q.strip()] if queues else None


@cli.command()
@click.argument("app")
@worker_options
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics on this port (needs the metrics extra).",
)
@click.pass_context
def worker(
    ctx: click.Context,
    app: str,
    concurrency: int,
    queues: str | None,
    isolation: str,
    burst: bool,
    poll_interval: float,
    shutdown_timeout: float,
    cancel_grace: float,
    completion_delay: float,
    no_listen: bool,
    no_self_test: bool,
    log_format: str,
    log_level: str,
    metrics_port: int | None,
) -> None:
    """Run a worker for the TaskQueue object APP (MODULE:QUEUE_OBJECT).

    APP is imported like `uvicorn app:app` imports an application, from the
    current directory: for example myapp.tasks:queue.  The worker runs the
    tasks APP registers, on APP's table and database, until SIGTERM or
    SIGINT (or, with --burst, until nothing is due).
    """
    if _url_typed_before(ctx) is not None:
        raise click.UsageError("worker takes no --url: it uses the engine of the queue APP builds", ctx)
    configure_logging(log_format, log_level)
    with for_people(ctx):
        queue = load_queue(app)
        url = queue.engine.url
        with for_people(ctx, url):
            queue.strategy  # noqa: B018 - connect now: a bad server fails here, in one line
            stop_metrics = _serve_metrics(queue, metrics_port) if metrics_port is not None else None
            worker_ = queue.run_worker(
                concurrency=concurrency,
                queues=parse_queues(queues),
                burst=burst,
                poll_interval=poll_interval,
                isolation=isolation,
                shutdown_timeout=shutdown_timeout,
                cancel_grace=cancel_grace,
                listen=not no_listen,
                self_test=not no_self_test,
                completion_delay=completion_delay,
            )
            if stop_metrics is not None:
                stop_metrics()
    logging.shutdown()
    if worker_.abandoned:
        # Threads of tasks given back (or left to their lease) may still be
        # running: leave without them rather than wait for them.
        os._exit(0)


def _serve_metrics(queue: TaskQueue, port: int) -> Callable[[], None]:
    """``--metrics-port``: the queue's Prometheus metrics served from this process; returns their stop."""
    try:
        # The integration serves them; imported only when asked for (the metrics extra).
        from sa_taskqueue.integrations.prometheus import PrometheusMetrics, serve_metrics
    except ImportError as error:
        raise Failure(
            f"--metrics-port needs prometheus_client: pip install 'sa_taskqueue[metrics]' ({error})"
        ) from error
    metrics = PrometheusMetrics(queue).attach()
    try:
        server = serve_metrics(port)
    except OSError as error:
        metrics.detach()
        why = error.strerror or error
        raise Failure(f"--metrics-port {port}: cannot serve metrics there ({why})") from error
    logger.info("serving Prometheus metrics on port %d", server.server_port)

    def stop() -> None:
        server.shutdown()
        metrics.detach()  # (its gauge lease let go: another worker reads them from its next scrape)

    return stop


# migrate ---------------------------------------------------------------------------


@cli.command()
@click.option("--revision", default="head", show_default=True, help="Migrate to this revision.")
@_app_option
@_url_option
@click.pass_context
def migrate(ctx: click.Context, revision: str, app: str | None, url: str | None) -> None:
    """Create or upgrade the library's task table (sa_taskqueue_task) with the package's alembic migrations.

    With --app, in the database of APP's queue, through its engine (unless
    --url is given on the command line); a queue on a TaskMixin table of the
    application's own is migrated by the application's own Alembic instead.
    """
    # Imported here, not at the top: only this command needs alembic (a fifth of a second).
    from alembic.util import CommandError

    with for_people(ctx, url):
        target = _target(ctx, app, url, creating=True)
    table = target.queue.table
    if table.metadata is not library_metadata:
        raise Failure(
            f"{app} uses a task table of its own, {table.name!r} (a TaskMixin model on the "
            "application's own metadata), and migrate creates and upgrades only the library's table, "
            f"{Task.__tablename__!r}, with the library's migrations: create and upgrade {table.name!r} "
            f"and {control_table_of(table).name!r} with the application's own Alembic "
            "(alembic revision --autogenerate, then alembic upgrade head)"
        )
    with for_people(ctx, target.url):
        try:
            _on_queue(target.queue, _upgrade, revision)
        except CommandError as error:  # e.g. a revision the history does not have
            raise Failure(f"migration failed: {_first_line(error)}") from error
    click.echo(f"migrated {_safe(target.url)} to {revision}")


def _upgrade(engine: sa.Engine, table: sa.Table, /, revision: str) -> None:
    from sa_taskqueue.core.migrate import upgrade_engine

    upgrade_engine(engine, revision)


# The queue an admin command acts on ------------------------------------------------


@dataclass(frozen=True)
class Target:
    """What an admin command works on: a queue (its table, its engine) and the application, if loaded."""

    queue: TaskQueue
    #: The queue ``--app`` loaded, whose registrations give defaults and names; None with --url alone.
    app: TaskQueue | None
    url: sa.URL


def _on_queue(
    queue: TaskQueue,
    fn: Callable[Concatenate[sa.Engine, sa.Table, P], R],
    /,
    *args: P.args,
    **kwargs: P.kwargs,
) -> R:
    """``fn(engine, table, ...)`` on ``queue``'s database and table: the one way a command reaches them.

    Every database call of the admin commands goes through here, so how a
    queue's engine is driven is decided in this one place: through the queue,
    which runs it on an async engine's loop (an app whose only engine is async).
    """
    return queue.run_sync(lambda: fn(queue.engine, queue.table, *args, **kwargs))


def _database_url(queue: TaskQueue) -> sa.URL:
    """The URL of ``queue``'s database, for messages and for the checks made before connecting."""
    return queue.engine.url


def _target(ctx: click.Context, app: str | None, url: str | None, *, creating: bool = False) -> Target:
    """The queue ``--app`` names (its table, on its database) or the library's own table at ``--url``.

    With both, ``--url`` given on the command line (not from the environment)
    points APP's table at another database: a replica, a staging copy.  A
    missing SQLite file is refused unless ``creating`` (`migrate`).
    """
    url_given = _url_typed(ctx)
    if app is None:
        queue = _own_queue(ctx, _engine(url))
        loaded = None
    else:
        loaded = load_queue(app)
        queue = _own_queue(ctx, _engine(url), model=loaded.model) if url_given else loaded
    where = _database_url(queue)
    missing = None if creating else missing_database_message(where)
    if missing is not None:
        # The driver would create an empty file there; only `migrate` should.
        raise Failure(missing)
    return Target(queue, loaded, where)


def _own_queue(ctx: click.Context, engine: sa.Engine | AsyncEngine, **options: Any) -> TaskQueue:
    """A queue on an engine this command made, its connections closed when the command ends.

    (An async engine's are closed on its own loop, where its driver can close them gracefully.)
    """
    queue = TaskQueue(engine, **options)

    def close() -> None:
        # After the command's outcome is printed: a connection that cannot be closed cleanly (a
        # server gone meanwhile) is let go with the process, not reported over that outcome.
        with suppress(Exception):
            queue.close()
            queue.run_sync(queue.engine.dispose)

    ctx.call_on_close(close)
    return queue


# enqueue, status, list, show, retry, cancel, purge -------------------------------

_DEFAULTS = "the task's own with --app, else"


@cli.command()
@click.argument("name")
@click.option(
    "--params",
    type=cli_params.JSON_OBJECT,
    default="{}",
    show_default=True,
    help="Parameters as a JSON object; @FILE reads it from a file, - from stdin.",
)
@click.option("--queue", "queue_name", default=None, show_default=f"{_DEFAULTS} default", help="Queue.")
@click.option(
    "--priority", default=None, show_default=f"{_DEFAULTS} 0", type=cli_params.COLUMN_INT, help="Priority."
)
@click.option(
    "--max-attempts",
    default=None,
    show_default=f"{_DEFAULTS} 3",
    type=cli_params.ATTEMPTS,
    help="Attempts before it fails for good.",
)
@click.option(
    "--delay", type=cli_params.DURATION, default=None, help="Run no sooner than this from now (10s, 5m, 2h)."
)
@click.option(
    "--run-at",
    type=cli_params.RUN_AT,
    default=None,
    help="Run no sooner than this ISO 8601 time, with its offset (2026-12-01T09:00:00Z).",
)
@click.option(
    "--unique-key",
    default=None,
    help="Enqueue nothing while a task of this name and key is queued or running "
    "(with --app, a task's unique_by derives it when not given).",
)
@_app_option
@_url_option
@click.pass_context
def enqueue(
    ctx: click.Context,
    name: str,
    params: dict[str, Any],
    queue_name: str | None,
    priority: int | None,
    max_attempts: int | None,
    delay: timedelta | None,
    run_at: datetime | None,
    unique_key: str | None,
    app: str | None,
    url: str | None,
) -> None:
    """Enqueue a task called NAME (run by workers that registered it).

    With --app, a task APP registers gets its registration's queue, priority
    and max attempts unless given here, and its params are checked against
    the function.
    """
    if delay is not None and run_at is not None:
        raise click.UsageError("give --delay or --run-at, not both")
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    registered = target.app.registered(name) if target.app is not None else None
    defaults = registered.options if registered is not None else None
    values: dict[str, Any] = {
        "queue": queue_name if queue_name is not None else (defaults.queue if defaults else "default"),
        "priority": priority if priority is not None else (defaults.priority if defaults else 0),
        "max_attempts": (
            max_attempts if max_attempts is not None else (defaults.max_attempts if defaults else 3)
        ),
        "delay": delay,
        "run_at": run_at,
    }
    if target.app is not None and registered is None:
        click.echo(f"note: {app} registers no task {name!r}; its workers will leave it queued", err=True)
    with for_people(ctx, target.url):
        try:
            # Every value is checked before anything reaches the database.
            if registered is not None:
                registered.check_params(params)
            unique_by = registered.options.unique_by if registered is not None else None
            key = unique.key_of(unique_key, unique_by, params, name, ColumnLimits.of(target.queue.table))
            if key is not None:
                task_id, inserted = _on_queue(target.queue, _enqueue_unique_row, name, params, key, **values)
            else:
                task_id, inserted = _on_queue(target.queue, _enqueue_row, name, params, **values), True
        except (TypeError, ValueError) as error:
            raise Failure(str(error)) from error
    if not inserted:
        click.echo(f"task {task_id} ({name}) is queued or running with unique key {key!r}: nothing enqueued")
        return
    click.echo(
        f"enqueued task {task_id} ({name}) on queue {values['queue']}, "
        f"priority {values['priority']}, max attempts {values['max_attempts']}"
    )


def _enqueue_row(
    engine: sa.Engine, table: sa.Table, /, name: str, params: dict[str, Any], **values: Any
) -> int:
    return Admin(engine, table).enqueue(name, params, **values)


def _enqueue_unique_row(
    engine: sa.Engine, table: sa.Table, /, name: str, params: dict[str, Any], key: str, **values: Any
) -> tuple[int, bool]:
    return Admin(engine, table).enqueue_unique(name, params, key, **values)


@cli.command()
@click.argument("app_argument", metavar="[APP]", required=False)
@_app_option
@_url_option
@click.pass_context
def status(ctx: click.Context, app_argument: str | None, app: str | None, url: str | None) -> None:
    """Counts per queue and status, the oldest due task's age, and expired leases.

    Given the workers' APP (MODULE:QUEUE_OBJECT, as an argument or --app),
    also the queued tasks whose name APP does not register, which its workers
    leave queued; the table and database are then APP's, unless --url is
    given on the command line.
    """
    if app_argument is not None and app is not None:
        raise click.UsageError("give APP or --app, not both")
    app = app if app is not None else app_argument
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    registered = target.app.task_names if target.app is not None else None
    with for_people(ctx, target.url):
        report = _on_queue(target.queue, _status_report, registered)
    console = output_console()
    table = RichTable(title="tasks")
    statuses = [status.value for status in TaskStatus]  # waiting first: tasks whose parents have not finished
    table.add_column("queue")
    for name in statuses:
        table.add_column(name, justify="right")
    for queue_name, counts in sorted(report.counts.items()):
        table.add_row(queue_name, *(str(counts.get(name, 0)) for name in statuses))
    if not report.counts:
        table.add_row("(no tasks)", *("0" for _ in statuses))
    console.print(table)
    if report.oldest_due_age is None:
        console.print("oldest due task: none waiting")
    else:
        console.print(f"oldest due task: waiting {human_age(report.oldest_due_age)}")
    if report.expired_leases:
        ids = ", ".join(str(task_id) for task_id in report.expired_leases[:20])
        console.print(f"running with an expired lease (worker gone?): {len(report.expired_leases)}: {ids}")
    else:
        console.print("running with an expired lease: none")
    if report.unregistered is not None:
        console.print(unregistered_line(report.unregistered), markup=False, soft_wrap=True)
    with for_people(ctx, target.url):
        console.print(_on_queue(target.queue, unserved_line), markup=False, soft_wrap=True)
    with for_people(ctx, target.url):
        paused = sorted(_on_queue(target.queue, read_paused))
    console.print(f"paused queues: {', '.join(paused) if paused else 'none'}", markup=False, soft_wrap=True)


def _status_report(engine: sa.Engine, table: sa.Table, /, registered: list[str] | None) -> StatusReport:
    return Admin(engine, table).status(registered=registered)


def unregistered_line(unregistered: list[UnregisteredTasks]) -> str:
    """Queued tasks whose name the loaded application does not register, by name."""
    if not unregistered:
        return "not registered here: none (every queued task's name is registered)"
    names = "; ".join(
        f"{group.name} ({group.queued} queued, oldest {human_age(group.oldest_age)} ago)"
        for group in unregistered
    )
    return f"not registered here: {names}"


@cli.command("list")
@click.option(
    "--status", "status_", type=click.Choice([s.value for s in TaskStatus]), help="Only this status."
)
@click.option("--queue", "queue_name", default=None, help="Only this queue.")
@click.option("--name", default=None, help="Only tasks of this name.")
@click.option("--limit", default=50, show_default=True, type=cli_params.LIST_LIMIT, help="At most this many.")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of every column, for scripts.")
@click.option(
    "--full",
    is_flag=True,
    help=f"With --json, print long values whole (by default each is cut to {LISTED_VALUE_LENGTH:,} "
    "characters; `show ID` prints one task whole).",
)
@_app_option
@_url_option
@click.pass_context
def list_command(
    ctx: click.Context,
    status_: str | None,
    queue_name: str | None,
    name: str | None,
    limit: int,
    as_json: bool,
    full: bool,
    app: str | None,
    url: str | None,
) -> None:
    """The newest tasks first: id, name, queue, status, attempts, run_at, age and worker.

    With --json, every column, each value longer than 1,000 characters cut
    around a marker saying how much was cut (and named in the row's "_cut"),
    unless --full is given.
    """
    if full and not as_json:
        raise click.UsageError("--full goes with --json (the table prints short columns only)")
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    with for_people(ctx, target.url):
        rows = _on_queue(
            target.queue, admin.list_tasks, status=status_, queue=queue_name, name=name, limit=limit
        )
    if as_json:
        click.echo(rows_json(rows, redactor, limit=None if full else LISTED_VALUE_LENGTH))
    else:
        print_list(output_console(), rows, utcnow(), redactor)


@cli.command("schedules")
@click.argument("app_argument", metavar="[APP]", required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of the periodic tasks, for scripts.")
@_app_option
@_url_option
@click.pass_context
def schedules_command(
    ctx: click.Context, app_argument: str | None, as_json: bool, app: str | None, url: str | None
) -> None:
    """APP's periodic tasks: schedule and zone, next run (in the zone and UTC), last slot enqueued.

    APP (MODULE:QUEUE_OBJECT, as an argument or --app) registers them; the
    last slots are read from its control table.
    """
    if app_argument is not None and app is not None:
        raise click.UsageError("give APP or --app, not both")
    app = app if app is not None else app_argument
    if app is None:
        raise click.UsageError("schedules needs the application that registers them: give APP or --app")
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    assert target.app is not None
    periodic = target.app.periodic_tasks
    with for_people(ctx, target.url):
        last = _on_queue(target.queue, schedules.last_slots, [entry.name for entry in periodic])
    rows = schedules.report(periodic, last, target.app.clock())
    if as_json:
        click.echo(json.dumps(rows))
        return
    table = RichTable(title="periodic tasks")
    for heading in ("name", "schedule", "zone", "next run", "next run (UTC)", "last slot (UTC)"):
        table.add_column(heading)
    for entry, row in zip(periodic, rows, strict=True):
        table.add_row(
            row["name"],
            entry.schedule.describe(),
            row["tz"],
            row["next_run"],
            row["next_run_utc"],
            row["last_slot"],
        )
    if not rows:
        table.add_row("(none registered)", "", "", "", "", "")
    output_console().print(table)


@cli.command("show")
@click.argument("task_id", type=cli_params.TASK_ID)
@click.option("--json", "as_json", is_flag=True, help="One JSON object of every column, for scripts.")
@_app_option
@_url_option
@click.pass_context
def show_command(ctx: click.Context, task_id: int, as_json: bool, app: str | None, url: str | None) -> None:
    """Everything about task TASK_ID, whole: params, attempts, lease, times, result and the last error."""
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    with for_people(ctx, target.url):
        row = _on_queue(target.queue, admin.get_task, task_id)
    if row is None:
        raise Failure(f"no task {task_id} in {target.queue.table.name}")
    if as_json:
        click.echo(row_json(row, redactor))
    else:
        print_task(output_console(), row, redactor)


@cli.command()
@click.argument("task_id", type=cli_params.TASK_ID, required=False)
@click.option("--all-failed", is_flag=True, help="Retry every failed task.")
@_app_option
@_url_option
@click.pass_context
def retry(
    ctx: click.Context, task_id: int | None, all_failed: bool, app: str | None, url: str | None
) -> None:
    """Queue a failed or cancelled task (or --all-failed) to run again now."""
    if (task_id is None) == (not all_failed):
        raise click.UsageError("give a TASK_ID or --all-failed (one of them)")
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    with for_people(ctx, target.url):
        count = _on_queue(target.queue, _retry, task_id)
    if task_id is not None and count == 0:
        raise Failure(f"task {task_id} is not failed or cancelled (or does not exist)")
    click.echo(f"queued {count} task(s) to run again")


def _retry(engine: sa.Engine, table: sa.Table, /, task_id: int | None) -> int:
    return Admin(engine, table).retry(task_id)


@cli.command()
@click.argument("task_id", type=cli_params.TASK_ID)
@_app_option
@_url_option
@click.pass_context
def cancel(ctx: click.Context, task_id: int, app: str | None, url: str | None) -> None:
    """Cancel a task: a queued one never runs, a running one is stopped by its worker."""
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    with for_people(ctx, target.url):
        outcome = target.queue.cancel_task(task_id, by=_cancelled_by())
    if not outcome.cancelled:
        raise Failure(outcome.message)
    click.echo(outcome.message)


def _cancelled_by() -> str:
    """Who cancels from the command line, as the task row records it: ``cli:<user>``."""
    try:
        return f"cli:{getpass.getuser()}"
    except (OSError, KeyError):  # no user name in this environment
        return "cli"


# pause, resume ------------------------------------------------------------------


@cli.command()
@click.argument("queue_name", metavar="QUEUE")
@_app_option
@_url_option
@click.pass_context
def pause(ctx: click.Context, queue_name: str, app: str | None, url: str | None) -> None:
    """Stop every worker claiming tasks of QUEUE (running tasks finish) until `resume QUEUE`."""
    _pause_or_resume(ctx, queue_name, app, url, paused=True)
    click.echo(f"paused queue {queue_name}")


@cli.command()
@click.argument("queue_name", metavar="QUEUE")
@_app_option
@_url_option
@click.pass_context
def resume(ctx: click.Context, queue_name: str, app: str | None, url: str | None) -> None:
    """Let workers claim tasks of QUEUE again."""
    _pause_or_resume(ctx, queue_name, app, url, paused=False)
    click.echo(f"resumed queue {queue_name}")


def _pause_or_resume(
    ctx: click.Context, queue_name: str, app: str | None, url: str | None, paused: bool
) -> None:
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    try:
        # Checked against the table's own column, before anything connects.
        validation.check_queue_name(queue_name, ColumnLimits.of(target.queue.table))
    except (TypeError, ValueError) as error:
        raise click.BadParameter(str(error), param_hint="QUEUE") from None
    with for_people(ctx, target.url):
        _on_queue(target.queue, set_paused, queue_name, paused, utcnow())


@cli.command()
@click.option("--completed", is_flag=True, help="Delete completed tasks.")
@click.option("--failed", is_flag=True, help="Delete failed tasks.")
@click.option("--cancelled", is_flag=True, help="Delete cancelled tasks.")
@click.option(
    "--older-than", type=cli_params.DURATION, required=True, help="Finished longer ago than this (7d, 12h)."
)
@click.option(
    "--batch-size", default=1000, show_default=True, type=cli_params.BATCH_SIZE, help="Rows per transaction."
)
@_app_option
@_url_option
@click.pass_context
def purge(
    ctx: click.Context,
    completed: bool,
    failed: bool,
    cancelled: bool,
    older_than: timedelta,
    batch_size: int,
    app: str | None,
    url: str | None,
) -> None:
    """Delete finished tasks in batches, each its own short transaction."""
    statuses = [
        name
        for name, chosen in (("completed", completed), ("failed", failed), ("cancelled", cancelled))
        if chosen
    ]
    if not statuses:
        raise click.UsageError("say which: --completed, --failed and/or --cancelled")
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    with for_people(ctx, target.url):
        deleted = _on_queue(target.queue, _purge, statuses, older_than, batch_size)
    click.echo(f"deleted {deleted} task(s)")


def _purge(
    engine: sa.Engine, table: sa.Table, /, statuses: list[str], older_than: timedelta, batch_size: int
) -> int:
    return Admin(engine, table).purge(statuses, older_than, batch_size)


# health ---------------------------------------------------------------------------


def _threshold_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The table health thresholds, as ``health`` and ``doctor`` both take them."""
    for option in reversed(_THRESHOLD_OPTIONS):
        command = option(command)
    return command


_THRESHOLD_OPTIONS = [
    click.option(
        "--max-transaction-age",
        type=cli_params.THRESHOLD_AGE,
        default=None,
        help="Flag transactions open longer than this (default 60s).",
    ),
    click.option(
        "--max-dead-rows",
        type=cli_params.THRESHOLD_COUNT,
        default=None,
        help=f"{SERVED_BY['dead_rows']}: flag more dead rows than this (default 10000)...",
    ),
    click.option(
        "--max-dead-row-ratio",
        type=click.FloatRange(min=0.0),
        default=None,
        help="...that are also more than this fraction of the live rows (default 0.2).",
    ),
    click.option(
        "--max-history-list-length",
        type=cli_params.THRESHOLD_COUNT,
        default=None,
        help=f"{SERVED_BY['history_list']}: flag more unpurged undo records than this (default 100000).",
    ),
    click.option(
        "--max-wal-bytes",
        type=cli_params.THRESHOLD_COUNT,
        default=None,
        help=f"{SERVED_BY['wal']}: flag a WAL file larger than this (default 64 MiB).",
    ),
]


def _thresholds(
    transaction_age: timedelta | None,
    dead_rows: int | None,
    dead_row_ratio: float | None,
    history_list_length: int | None,
    wal_bytes: int | None,
) -> HealthThresholds:
    """The thresholds given on the command line (None: not given) over the defaults."""
    given: dict[str, Any] = {
        "transaction_age": transaction_age,
        "dead_rows": dead_rows,
        "dead_row_ratio": dead_row_ratio,
        "history_list_length": history_list_length,
        "wal_bytes": wal_bytes,
    }
    try:
        return HealthThresholds(**{name: value for name, value in given.items() if value is not None})
    except (TypeError, ValueError) as error:
        raise click.UsageError(str(error)) from None


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object: figures, findings, notes and ok.")
@_threshold_options
@_app_option
@_url_option
@click.pass_context
def health(
    ctx: click.Context,
    as_json: bool,
    max_transaction_age: timedelta | None,
    max_dead_rows: int | None,
    max_dead_row_ratio: float | None,
    max_history_list_length: int | None,
    max_wal_bytes: int | None,
    app: str | None,
    url: str | None,
) -> None:
    """What slows the task table: dead rows, long transactions, purge lag, WAL size; with advice.

    Each figure over its threshold is a finding, printed with what to do
    about it.  The exit code is 0 either way: scripts read "ok" from --json.
    """
    thresholds = _thresholds(
        max_transaction_age, max_dead_rows, max_dead_row_ratio, max_history_list_length, max_wal_bytes
    )
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    with for_people(ctx, target.url):
        report = target.queue.table_health(thresholds=thresholds)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        for line in health_lines(report):
            click.echo(redactor.text(line))


# doctor ----------------------------------------------------------------------------


@cli.command()
@click.argument("app_argument", metavar="[APP]", required=False)
@click.option("--no-listen", is_flag=True, help="Leave LISTEN out, as for workers run with --no-listen.")
@click.option("--strict", is_flag=True, help="Exit 1 on a table health finding too.")
@_threshold_options
@_app_option
@_url_option
@click.pass_context
def doctor(
    ctx: click.Context,
    app_argument: str | None,
    no_listen: bool,
    strict: bool,
    app: str | None,
    url: str | None,
    max_transaction_age: timedelta | None,
    max_dead_rows: int | None,
    max_dead_row_ratio: float | None,
    max_history_list_length: int | None,
    max_wal_bytes: int | None,
) -> None:
    """Prove the database gives the queue what it relies on, as a worker does at start.

    One line per check, passed or failed with the cause and the fix; then the
    task table's health, as ``health`` prints it.  The exit code is 1 when any
    check fails; a health finding counts only with --strict, being a slow
    queue rather than a wrong one.  Given APP (as an argument or --app), its
    queue's strategy is checked, on its database unless --url is given on the
    command line; with --url alone, the strategy the database gets by default.
    """
    if app_argument is not None and app is not None:
        raise click.UsageError("give APP or --app, not both")
    app = app if app is not None else app_argument
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    with for_people(ctx, target.url):
        report = target.queue.check_footing(listen=not no_listen)
        strategy = target.queue.strategy.name
        table = target.queue.table_health(
            thresholds=_thresholds(
                max_transaction_age, max_dead_rows, max_dead_row_ratio, max_history_list_length, max_wal_bytes
            )
        )
    print_doctor(
        [
            (f"self-test ({strategy} strategy, {_safe(target.url)})", report.lines()),
            ("table health", health_lines(table)),
        ]
    )
    if not report.ok or (strict and not table.ok):
        raise SystemExit(1)


def print_doctor(sections: list[tuple[str, list[str]]]) -> None:
    """``doctor``'s output: each section's title, then its lines indented under it."""
    for title, lines in sections:
        click.echo(f"{title}:")
        for line in lines or ["(nothing to check)"]:
            click.echo(f"  {redactor.text(line)}")


# demo -----------------------------------------------------------------------------


@cli.command()
@click.option("--tasks", default=300, show_default=True, type=cli_params.DEMO_TASKS, help="How many tasks.")
@click.option(
    "--workers", default=4, show_default=True, type=cli_params.DEMO_WORKERS, help="Worker processes."
)
@click.option(
    "--url",
    default=DEFAULT_URL,
    show_default=True,
    callback=_url_before_command,
    help="Database URL (tables of its own).",
)
@click.pass_context
def demo(ctx: click.Context, tasks: int, workers: int, url: str) -> None:
    """Enqueue TASKS tasks, drain them with WORKERS processes, and summarise."""
    console = output_console()
    console.print(f"sa_taskqueue demo: {tasks} tasks, {workers} worker processes, {_safe(url)}")
    with for_people(ctx, url):
        _checked_url(url)
        if console.is_terminal:
            from rich.progress import Progress  # the demo's bar alone: not on every command's start

            with Progress(console=console, transient=True) as progress:
                bar = progress.add_task("running", total=tasks)
                summary = run_demo(url, tasks, workers, lambda done: progress.update(bar, completed=done))
        else:
            summary = run_demo(url, tasks, workers)
    rate = summary.tasks / summary.seconds if summary.seconds else float("inf")
    table = RichTable(title="summary", show_header=False)
    table.add_column("what")
    table.add_column("figure", justify="right")
    table.add_row("tasks", str(summary.tasks))
    table.add_row("worker processes", str(summary.workers))
    table.add_row("drained in", f"{summary.seconds:.2f}s")
    table.add_row("throughput", f"{rate:,.0f} tasks/s")
    table.add_row("statuses", ", ".join(f"{k} {v}" for k, v in sorted(summary.statuses.items())))
    table.add_row("tasks per worker", ", ".join(str(c) for _, c in summary.runs_per_worker.most_common()))
    table.add_row("ran exactly once", "yes" if summary.exactly_once else "NO")
    console.print(table)
    if summary.exactly_once:
        console.print("every task ran exactly once")
        return
    twice = sorted(n for n, count in summary.runs_per_task.items() if count > 1)
    missing = sorted(set(range(summary.tasks)) - set(summary.runs_per_task))
    raise Failure(f"NOT exactly once: ran twice {twice[:10]}, never ran {missing[:10]}")


def main() -> None:
    program = "sa_taskqueue" if sys.argv[0].endswith("__main__.py") else os.path.basename(sys.argv[0])
    cli(prog_name=program)
