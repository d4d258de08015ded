"""``sa-taskqueue dashboard``: serve the web dashboard of a queue with uvicorn.

The dashboard shows tasks' params and errors and can retry, cancel, delete
and pause; so it binds a loopback address unless told otherwise, and
refuses any other address without a token.
"""

from __future__ import annotations

import importlib
import ipaddress
import logging
import re
from typing import Any

import click

from sa_taskqueue.cli.main import Failure, _app_option, _target, _url_option, cli, for_people, redactor

TOKEN_ENV = "SA_TASKQUEUE_DASHBOARD_TOKEN"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8089

_TOKEN_IN_QUERY = re.compile(r"(?<=[?&]token=)[^&\s]*")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


class _HideToken(logging.Filter):
    """Keeps ``?token=...`` out of the access log: the first page a browser opens may carry it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                _TOKEN_IN_QUERY.sub("***", arg) if isinstance(arg, str) else arg for arg in record.args
            )
        return True


@cli.command("dashboard")
@click.argument("app_argument", metavar="[APP]", required=False)
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=DEFAULT_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port to listen on.",
)
@click.option(
    "--token",
    envvar=TOKEN_ENV,
    default=None,
    help=f"Require this token (Authorization: Bearer, or ?token= once per browser; default: ${TOKEN_ENV}).",
)
@click.option(
    "--read-only", is_flag=True, help="Show everything, change nothing: no actions, every POST refused."
)
@click.option(
    "--root-path",
    default="",
    metavar="PATH",
    help="The path a reverse proxy serves it under, stripped before it arrives (e.g. /ops/queue).",
)
@_app_option
@_url_option
@click.pass_context
def dashboard(
    ctx: click.Context,
    app_argument: str | None,
    host: str,
    port: int,
    token: str | None,
    read_only: bool,
    root_path: str,
    app: str | None,
    url: str | None,
) -> None:
    """Serve the web dashboard: queues, tasks, workers, schedules, health, and their actions.

    Given the workers' APP (MODULE:QUEUE_OBJECT, as an argument or --app),
    its table, database and periodic tasks; with --url alone, the library's
    own table there.  It listens on 127.0.0.1 unless --host says otherwise,
    and any other address needs --token.  Needs the ``dashboard`` extra.
    """
    if app_argument is not None and app is not None:
        raise click.UsageError("give APP or --app, not both")
    app = app if app is not None else app_argument
    if token is not None and not token.strip():
        raise click.UsageError("--token is empty: give a token, or leave it out on a loopback address")
    root_path = root_path.rstrip("/")
    if root_path and (not root_path.startswith("/") or "//" in root_path):
        raise click.BadParameter(f"{root_path!r} is not a path such as /ops/queue", param_hint="--root-path")
    if token is None and not is_loopback(host):
        raise Failure(
            f"refusing to serve the dashboard on {host} without a token: anyone who reaches it could read "
            f"tasks and change them; pass --token (or set {TOKEN_ENV}), or listen on 127.0.0.1"
        )
    try:
        # The dashboard sits above the command line (it is an integration, with
        # dependencies of its own): imported by name, when this command runs.
        create_app = importlib.import_module("sa_taskqueue.integrations.dashboard").create_app
        uvicorn: Any = importlib.import_module("uvicorn")
    except ModuleNotFoundError as error:
        raise Failure(
            f"the dashboard needs {error.name}, which is not installed: pip install 'sa_taskqueue[dashboard]'"
        ) from error
    with for_people(ctx, url):
        target = _target(ctx, app, url)
    shown = target.app if target.app is not None and target.queue is target.app else target.queue
    with for_people(ctx, target.url):
        web = create_app(shown, auth=token, read_only=read_only)
    try:
        prometheus: Any = importlib.import_module("sa_taskqueue.integrations.prometheus")
    except ModuleNotFoundError:
        pass  # no metrics extra: /metrics says how to add it
    else:
        # This process serves the queue's gauges at /metrics (read when scraped, as the one reader).
        prometheus.PrometheusMetrics(shown, gauges="always").attach()
    where = f"http://{host if ':' not in host else f'[{host}]'}:{port}/"
    if root_path:
        where += f" (its links under {root_path}/)"
    click.echo(
        f"dashboard of {target.queue.table.name} at {redactor.url(target.url)}: {where}"
        + (" (open it once with ?token=YOUR_TOKEN)" if token else "")
        + (" (read-only)" if read_only else "")
    )
    logging.getLogger("uvicorn.access").addFilter(_HideToken())
    uvicorn.run(web, host=host, port=port, root_path=root_path, log_level="info")
