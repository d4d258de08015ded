"""`create_app`: the dashboard as a Starlette application, to serve alone or mount in a host app.

Pages are rendered on the server (Jinja2, autoescaped); the stylesheet and
the one script are static files of this package, so the Content-Security-
Policy allows no inline code at all.  Every database call runs in a thread
(`run_in_threadpool`), through `TaskQueue.run_sync`, so a queue on an async
engine is driven on its own loop as the command line drives it.  Every
action is a method of the queue or of `Admin`, the code the Python API and
the command line run: the dashboard writes no SQL of its own.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlencode
from zoneinfo import ZoneInfo

import sqlalchemy as sa
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sa_taskqueue.core import validation
from sa_taskqueue.core.exceptions import TaskQueueError
from sa_taskqueue.core.limits import ColumnLimits
from sa_taskqueue.core.model import TaskStatus
from sa_taskqueue.core.redaction import Redactor
from sa_taskqueue.features import admin, schedules
from sa_taskqueue.features.admin import Admin, Undecodable
from sa_taskqueue.features.live_workers import list_live_workers, unserved_tasks
from sa_taskqueue.features.pausing import read_paused
from sa_taskqueue.features.workflows import batches as batch_rows
from sa_taskqueue.health import health_lines
from sa_taskqueue.integrations.dashboard import reads
from sa_taskqueue.integrations.dashboard.guard import (
    CSRF_COOKIE,
    FLASH_COOKIE,
    PAGE_HEADERS,
    SESSION_COOKIE,
    Auth,
    Guard,
    mount_point,
    without_token,
)
from sa_taskqueue.queue import TaskQueue

HERE = Path(__file__).parent

#: The table a dashboard given an Engine or a URL shows.
DEFAULT_TABLE = "sa_taskqueue_task"

#: The most characters a page shows of one value (params, result, an error).
SHOWN_LENGTH = 100_000

#: What a task's page shows, in order, beside params, result, headers and the last error.
TASK_FIELDS = (
    "id",
    "name",
    "queue",
    "status",
    "priority",
    "attempts",
    "max_attempts",
    "run_at",
    "created_at",
    "started_at",
    "finished_at",
    "locked_by",
    "locked_until",
    "unique_key",
    "concurrency_key",
    "concurrency_slot",
    "progress",
    "progress_at",
    "cancel_requested_at",
    "cancelled_by",
    "batch_id",
)


def create_app(
    target: TaskQueue | sa.Engine | str,
    *,
    auth: Auth = None,
    read_only: bool = False,
    title: str = "sa_taskqueue",
) -> Starlette:
    """The dashboard of ``target``'s task table, as a Starlette app to serve or mount.

    ``target`` is a `TaskQueue` (its engine, its table, its registered and
    periodic tasks), an `Engine` or a database URL (the library's own table,
    ``sa_taskqueue_task``; no periodic tasks are known then).  ``auth`` is
    None (anyone who reaches it may use it: bind it to a loopback address, or
    guard the mount), a token (sent as ``Authorization: Bearer <token>``, or
    once as ``?token=<token>``, which sets a session cookie), or a callable
    taking the Starlette `Request` and returning True to let it in (run in a
    thread; an ``async def`` is awaited).
    ``read_only`` renders no actions and refuses every POST.

    Mount it anywhere (``app.mount("/queue", create_app(queue))``): its links
    follow the mount point.
    """
    dashboard = Dashboard(target, auth=auth, read_only=read_only, title=title)
    routes = [
        Route("/", dashboard.overview, name="overview"),
        Route("/tasks", dashboard.tasks, name="tasks"),
        Route("/tasks/{task_id:int}", dashboard.task, name="task"),
        Route("/tasks/{task_id:int}/{action:str}", dashboard.task_action, methods=["POST"]),
        Route("/queues/{queue_name:path}/{action:str}", dashboard.queue_action, methods=["POST"]),
        Route("/schedules/{task_name:path}/enqueue", dashboard.enqueue_now, methods=["POST"]),
        Route("/workers", dashboard.workers, name="workers"),
        Route("/batches", dashboard.batches, name="batches"),
        Route("/batches/{batch_id:int}", dashboard.batch, name="batch"),
        Route("/schedules", dashboard.schedules, name="schedules"),
        Route("/health", dashboard.health, name="health"),
        Route("/metrics", dashboard.metrics, name="metrics"),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(Guarded, guard=dashboard.guard)],
        exception_handlers={
            TaskQueueError: dashboard.unavailable,
            sa.exc.SQLAlchemyError: dashboard.unavailable,
        },
    )
    app.state.dashboard = dashboard
    return app


class Guarded:
    """ASGI middleware: the security headers on every response, and authentication before any page."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        request = Request(scope)
        # Pages are never stored (they show live rows, and may carry a CSRF token); the
        # static files are kept and revalidated by their ETag, a 304 on every page after the first.
        static = _route_path(request).startswith("/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in PAGE_HEADERS.items():
                    headers.setdefault(name, "no-cache" if static and name == "Cache-Control" else value)
            await send(message)

        refusal = await self._refusal(request)
        if refusal is not None:
            await refusal(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)

    async def _refusal(self, request: Request) -> Response | None:
        """The response that refuses ``request`` (or trades its ``?token=`` for a cookie), or None."""
        guard = self.guard
        if guard.auth is None or _route_path(request).startswith("/static/"):
            return None
        token = request.query_params.get("token")
        if token is not None and isinstance(guard.auth, str) and request.method == "GET":
            if not guard.token_matches(token):
                return _refused("That token is not this dashboard's.")
            response = RedirectResponse(without_token(request), status_code=303)
            response.set_cookie(
                SESSION_COOKIE,
                guard.new_session(),
                path=mount_point(request) + "/",
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
            return response
        if not await guard.allowed(request):
            return _refused(
                "Send the dashboard's token (Authorization: Bearer TOKEN), or open a page with ?token=TOKEN."
                if isinstance(guard.auth, str)
                else "The application serving this dashboard did not let this request in."
            )
        return None


def _refused(message: str) -> HTMLResponse:
    body = (
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>Not allowed</title>"
        "<link rel=icon href='data:,'></head>"
        f"<body><h1>Not allowed</h1><p>{_escape(message)}</p></body></html>"
    )
    return HTMLResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _route_path(request: Request) -> str:
    """The request's path below the mount point."""
    root, path = str(request.scope.get("root_path", "")), str(request.scope["path"])
    return path[len(root) :] if root and path.startswith(root) else path


class BadInput(ValueError):
    """A filter or form value the dashboard cannot use; the page says which and why."""


@dataclass
class Flash:
    kind: str  # "ok" or "error"
    text: str
    #: Where to go instead of the form's page (which the action may have removed).
    go: str | None = None


class Dashboard:
    """The pages and actions of one dashboard, on one queue."""

    def __init__(
        self, target: TaskQueue | sa.Engine | str, *, auth: Auth, read_only: bool, title: str
    ) -> None:
        #: The queue whose table is shown, and the application whose registrations (periodic
        #: tasks) are known: the same TaskQueue, or no application for an Engine or a URL.
        self.queue: TaskQueue
        self.app: TaskQueue | None = None
        if isinstance(target, TaskQueue):
            self.queue = self.app = target
        elif isinstance(target, (str, sa.URL)):
            self.queue = TaskQueue(sa.create_engine(target))
        else:
            self.queue = TaskQueue(target)
        self.guard = Guard(auth)
        self.read_only = bool(read_only)
        self.title = title
        #: Hides the database's password from everything rendered: URLs, errors, params.
        self.redactor = Redactor(self.queue.engine.url)
        self.database = self.redactor.url(self.queue.engine.url)
        self.templates = Environment(
            loader=FileSystemLoader(HERE / "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.templates.filters["age"] = human_age
        self.templates.filters["when"] = when
        self.templates.filters["shown"] = self.shown
        self.templates.filters["in_zone"] = in_zone
        self.templates.filters["segment"] = lambda value: quote(str(value), safe="")

    # Helpers ------------------------------------------------------------------

    async def db(self, fn: Callable[[sa.Engine, sa.Table], Any]) -> Any:
        """``fn(engine, table)`` in a thread, where the queue's engine may be used."""
        queue = self.queue
        return await run_in_threadpool(queue.run_sync, lambda: fn(queue.engine, queue.table))

    def shown(self, value: Any) -> str:
        """A stored value as a page shows it: JSON indented, times ISO, secrets of the URL hidden.

        A value longer than `SHOWN_LENGTH` is cut, saying how much was left out
        (``sa-taskqueue show ID --json`` prints it whole): a page stays light
        whatever a task was given.
        """
        if value is None:
            return "—"
        if isinstance(value, datetime):
            return when(value)
        if isinstance(value, TaskStatus):
            return value.value
        # Scrubbed before the cut, so no cut leaves part of a secret in view; JSON
        # string by string, as a secret holding a quote is written escaped in JSON text.
        if isinstance(value, Undecodable):
            text = self.redactor.text(value.text)
        elif isinstance(value, (dict, list)):
            text = json.dumps(self.redactor.value(value), indent=2, sort_keys=True, default=str)
        else:
            text = self.redactor.text(str(value))
        if len(text) > SHOWN_LENGTH:
            text = f"{text[:SHOWN_LENGTH]}\n… {len(text) - SHOWN_LENGTH:,} more characters not shown"
        return text

    def render(
        self, request: Request, template: str, page: str, status_code: int = 200, **context: Any
    ) -> Response:
        seed, new_seed = self.guard.csrf_seed(request)
        flash = _read_flash(request)
        base = mount_point(request)
        html = self.templates.get_template(template).render(
            title=self.title,
            page=page,
            database=self.database,
            read_only=self.read_only,
            csrf_token=self.guard.csrf_token(seed),
            here=_here(request),
            url=lambda path, **query: _url(base, path, query),
            flash=flash,
            now=self.queue.clock(),
            **context,
        )
        response = HTMLResponse(html, status_code=status_code)
        cookie_path = base + "/"
        if new_seed:
            response.set_cookie(
                CSRF_COOKIE,
                seed,
                path=cookie_path,
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
        if flash is not None:
            response.delete_cookie(FLASH_COOKIE, path=cookie_path)
        return response

    async def unavailable(self, request: Request, error: Exception) -> Response:
        """A page that could not read the database: what the driver said, without secrets."""
        return self.render(
            request,
            "error.html",
            page="error",
            status_code=503,
            message=f"The database refused or could not be reached: {self.redactor.text(_first_line(error))}",
        )

    # Pages --------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        now = self.queue.clock()

        def read(engine: sa.Engine, table: sa.Table) -> tuple[Any, ...]:
            report = Admin(engine, table).status()
            paused = read_paused(engine, table)
            rows = reads.queue_rows(engine, table, report.counts, paused, now)
            return report, rows, reads.throughput(engine, table, now)

        report, rows, throughput = await self.db(read)
        return self.render(
            request,
            "overview.html",
            "overview",
            report=report,
            queues=rows,
            statuses=[status.value for status in TaskStatus],
            chart=Chart.of(throughput),
        )

    async def tasks(self, request: Request) -> Response:
        try:
            filters, before = _filters(request, ColumnLimits.of(self.queue.table))
        except BadInput as error:
            return self.render(
                request,
                "tasks.html",
                "tasks",
                status_code=400,
                error=str(error),
                page_rows=None,
                form=dict(request.query_params),
                statuses=[status.value for status in TaskStatus],
            )
        page = await self.db(lambda engine, table: reads.task_page(engine, table, filters, before))
        form = {key: value for key, value in request.query_params.items() if key not in ("before", "token")}
        next_url = None
        if page.next_before is not None:
            next_url = _url(mount_point(request), "/tasks", {**form, "before": str(page.next_before)})
        return self.render(
            request,
            "tasks.html",
            "tasks",
            error=None,
            page_rows=page,
            form=form,
            next_url=next_url,
            statuses=[status.value for status in TaskStatus],
        )

    async def task(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        try:
            validation.check_task_id(task_id)
        except (TypeError, ValueError):
            return self.render(request, "error.html", "task", status_code=404, message=f"No task {task_id}.")
        row = await self.db(lambda engine, table: admin.get_task(engine, table, task_id))
        if row is None:
            return self.render(request, "error.html", "task", status_code=404, message=f"No task {task_id}.")
        status = TaskStatus(row["status"])
        return self.render(
            request,
            "task.html",
            "task",
            task=row,
            status=status.value,
            fields=[name for name in TASK_FIELDS if name in row],
            timings=_timings(row, self.queue.clock()),
            actions=_task_actions(status),
        )

    async def workers(self, request: Request) -> Response:
        """The live-worker registry: who runs, what each runs, and the due tasks nobody serves."""
        now = self.queue.clock()

        def read(engine: sa.Engine, table: sa.Table) -> tuple[Any, Any]:
            return list_live_workers(engine, table, now=now), unserved_tasks(engine, table, now=now)

        workers, unserved = await self.db(read)
        return self.render(request, "workers.html", "workers", workers=workers, unserved=unserved)

    async def batches(self, request: Request) -> Response:
        """The newest batches, with their counts by outcome and what is pending; ``?unfinished=1`` filters."""
        unfinished = request.query_params.get("unfinished", "") not in ("", "0")
        before_text = request.query_params.get("before", "").strip()
        before: int | None = None
        if before_text:
            try:
                before = int(before_text)
                validation.check_task_id(before)
            except (TypeError, ValueError):
                return self.render(
                    request, "error.html", "batches", status_code=400, message=f"No batch id {before_text!r}."
                )

        def read(engine: sa.Engine, table: sa.Table) -> list[batch_rows.BatchState]:
            with engine.connect() as conn:
                return batch_rows.listing(
                    conn, table, limit=reads.PAGE_SIZE + 1, before=before, unfinished=unfinished
                )

        rows = await self.db(read)
        more = len(rows) > reads.PAGE_SIZE
        rows = rows[: reads.PAGE_SIZE]
        next_url = None
        if more:
            query = {"before": str(rows[-1].id), **({"unfinished": "1"} if unfinished else {})}
            next_url = _url(mount_point(request), "/batches", query)
        return self.render(
            request, "batches.html", "batches", batches=rows, unfinished=unfinished, next_url=next_url
        )

    async def batch(self, request: Request) -> Response:
        """One batch: its counts, its members by status now (each a link to them), its callbacks."""
        batch_id = request.path_params["batch_id"]
        try:
            validation.check_task_id(batch_id)
        except (TypeError, ValueError):
            return self.render(
                request, "error.html", "batch", status_code=404, message=f"No batch {batch_id}."
            )

        def read(engine: sa.Engine, table: sa.Table) -> tuple[Any, dict[str, int]]:
            with engine.connect() as conn:
                state = batch_rows.read(conn, table, batch_id)
                members = batch_rows.member_statuses(conn, table, batch_id) if state is not None else {}
                return state, members

        state, members = await self.db(read)
        if state is None:
            return self.render(
                request, "error.html", "batch", status_code=404, message=f"No batch {batch_id}."
            )
        return self.render(
            request,
            "batch.html",
            "batch",
            batch=state,
            members=members,
            statuses=[status.value for status in TaskStatus],
        )

    async def schedules(self, request: Request) -> Response:
        app = self.app
        if app is None:
            return self.render(request, "schedules.html", "schedules", rows=None)
        periodic = app.periodic_tasks
        names = [entry.name for entry in periodic]
        last = await self.db(lambda engine, table: schedules.last_slots(engine, table, names))
        now = app.clock()
        rows = [
            {
                "name": entry.name,
                "schedule": entry.schedule.describe(),
                "zone": entry.schedule.tz.key,
                "next_run": entry.schedule.next_slot(now),
                "last_slot": last.get(entry.name),
                "queue": entry.task.options.queue,
                "params": entry.params,
            }
            for entry in periodic
        ]
        return self.render(request, "schedules.html", "schedules", rows=rows)

    async def health(self, request: Request) -> Response:
        """The self-test and the table health, each shown even when the other could not run.

        The self-test writes (and removes) probe rows in the control table, as
        a worker's start does; on a database that refuses writes (a replica)
        it fails with the database's reason, and the table health still shows.
        """
        queue = self.queue

        def measure() -> dict[str, Any]:
            found: dict[str, Any] = {"footing": None, "footing_error": None}
            found["strategy"] = queue.strategy.name
            try:
                found["footing"] = queue.check_footing()
            except (TaskQueueError, sa.exc.SQLAlchemyError) as error:
                found["footing_error"] = self.redactor.text(_first_line(error))
            table_health = queue.table_health()
            found["table_health"] = table_health
            found["table_lines"] = [self.redactor.text(line) for line in health_lines(table_health)]
            return found

        return self.render(request, "health.html", "health", **await run_in_threadpool(measure))

    async def metrics(self, request: Request) -> Response:
        """The Prometheus registry's metrics, behind the dashboard's auth, for a scraper.

        What is in the registry is the host's choice (`PrometheusMetrics`
        attached to a queue; ``sa-taskqueue dashboard`` attaches one with the
        table's gauges).  Without the ``metrics`` extra, a page says how to add it.
        """
        try:
            from sa_taskqueue.integrations.prometheus import metrics_exposition
        except ModuleNotFoundError:
            return self.render(
                request,
                "error.html",
                "error",
                status_code=404,
                message="Metrics need the metrics extra: pip install 'sa_taskqueue[metrics]'.",
            )
        accept = request.headers.get("accept")
        # Collecting may read the table (the gauges): in a thread, off the loop.
        body, content_type = await run_in_threadpool(lambda: metrics_exposition(accept=accept))
        return Response(body, media_type=content_type)

    # Actions ------------------------------------------------------------------

    async def _act(
        self, request: Request, default_next: str, act: Callable[[], Awaitable[Flash]]
    ) -> Response:
        """Check the POST (read-only, CSRF), run ``act``, and redirect to where the form was."""
        if self.read_only:
            return self.render(
                request, "error.html", "error", status_code=403, message="This dashboard is read-only."
            )
        form = await request.form()
        if not self.guard.csrf_valid(request, form.get("csrf_token")):
            return self.render(
                request,
                "error.html",
                "error",
                status_code=403,
                message="The form's CSRF token is missing or wrong: reload the page and try again.",
            )
        next_path = form.get("next")
        if not isinstance(next_path, str) or not _is_local(next_path):
            next_path = default_next
        try:
            flash = await act()
        except (TaskQueueError, ValueError, TypeError) as error:
            flash = Flash("error", self.redactor.text(str(error)))
        response = RedirectResponse(mount_point(request) + (flash.go or next_path), status_code=303)
        response.set_cookie(
            FLASH_COOKIE,
            quote(f"{flash.kind}:{flash.text[:500]}"),
            path=mount_point(request) + "/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def task_action(self, request: Request) -> Response:
        task_id: int = request.path_params["task_id"]
        action: str = request.path_params["action"]
        queue = self.queue

        async def act() -> Flash:
            validation.check_task_id(task_id)
            if action == "retry":
                count = await self.db(lambda engine, table: Admin(engine, table).retry(task_id))
                if count:
                    return Flash("ok", f"Task {task_id} is queued to run again.")
                return Flash(
                    "error", f"Task {task_id} is not failed or cancelled (or its unique key is held)."
                )
            if action == "cancel":
                outcome = await run_in_threadpool(queue.cancel_task, task_id, by="dashboard")
                text = outcome.message[0].upper() + outcome.message[1:] + "."
                return Flash("ok" if outcome.cancelled else "error", text)
            if action == "delete":
                if await self.db(lambda engine, table: Admin(engine, table).delete(task_id)):
                    # Its own page is gone: back to the list.
                    return Flash("ok", f"Task {task_id} is deleted.", go="/tasks")
                return Flash("error", f"Task {task_id} is not finished (or is gone): nothing deleted.")
            raise BadInput(f"unknown action {action!r}: retry, cancel or delete")

        if action not in ("retry", "cancel", "delete"):
            return self.render(
                request, "error.html", "error", status_code=404, message=f"No action {action!r} on tasks."
            )
        return await self._act(request, f"/tasks/{task_id}", act)

    async def queue_action(self, request: Request) -> Response:
        name: str = request.path_params["queue_name"]
        action: str = request.path_params["action"]
        queue = self.queue
        if action not in ("pause", "resume"):
            return self.render(
                request, "error.html", "error", status_code=404, message=f"No action {action!r} on queues."
            )

        async def act() -> Flash:
            if action == "pause":
                await run_in_threadpool(queue.pause, name)
                return Flash("ok", f"Queue {name} is paused: workers claim none of its tasks until resumed.")
            await run_in_threadpool(queue.resume, name)
            return Flash("ok", f"Queue {name} is resumed.")

        return await self._act(request, "/", act)

    async def enqueue_now(self, request: Request) -> Response:
        name: str = request.path_params["task_name"]
        app = self.app

        async def act() -> Flash:
            periodic = {entry.name: entry for entry in app.periodic_tasks} if app is not None else {}
            entry = periodic.get(name)
            if app is None or entry is None:
                return Flash("error", f"No periodic task {name!r} is registered with this application.")

            def enqueue() -> int:
                with Session(app.engine) as session:
                    task = app.enqueue(session, name, dict(entry.params))
                    session.commit()
                    return int(task.id)

            task_id = await run_in_threadpool(app.run_sync, enqueue)
            return Flash("ok", f"Task {task_id} ({name}) is enqueued to run now.")

        return await self._act(request, "/schedules", act)


# Page helpers -------------------------------------------------------------------


@dataclass
class Bar:
    x: float
    completed_y: float
    completed_height: float
    failed_y: float
    failed_height: float
    label: str


@dataclass
class Chart:
    """The throughput chart's geometry, computed here so the SVG needs no script and no style attribute."""

    width: int
    height: int
    bar_width: float
    bars: list[Bar]
    peak: int
    completed_total: int
    failed_total: int
    start: datetime

    @classmethod
    def of(cls, data: reads.Throughput, width: int = 720, height: int = 160) -> Chart:
        minutes = len(data.completed)
        peak = max([c + f for c, f in zip(data.completed, data.failed, strict=True)] + [1])
        step = width / minutes
        bars = []
        for index, (completed, failed) in enumerate(zip(data.completed, data.failed, strict=True)):
            completed_height = height * completed / peak
            failed_height = height * failed / peak
            minute = data.start + timedelta(minutes=index)
            bars.append(
                Bar(
                    x=round(index * step, 2),
                    completed_y=round(height - completed_height, 2),
                    completed_height=round(completed_height, 2),
                    failed_y=round(height - completed_height - failed_height, 2),
                    failed_height=round(failed_height, 2),
                    label=f"{minute:%H:%M} UTC: {completed} completed, {failed} failed",
                )
            )
        return cls(
            width=width,
            height=height,
            bar_width=round(step * 0.8, 2),
            bars=bars,
            peak=peak,
            completed_total=sum(data.completed),
            failed_total=sum(data.failed),
            start=data.start,
        )


def _filters(request: Request, limits: ColumnLimits) -> tuple[reads.TaskFilters, int | None]:
    """The task list's filters from the query string, each checked; `BadInput` names a bad one."""
    query = request.query_params

    def text(name: str) -> str | None:
        value = query.get(name, "").strip()
        return value or None

    status = text("status")
    if status is not None and status not in {s.value for s in TaskStatus}:
        raise BadInput(f"status: {status!r} is not one of {', '.join(s.value for s in TaskStatus)}")
    before_text = text("before")
    before: int | None = None
    if before_text is not None:
        try:
            before = int(before_text)
            validation.check_task_id(before)
        except (TypeError, ValueError):
            raise BadInput(f"before: {before_text!r} is not a task id") from None
    batch_text = text("batch")
    batch: int | None = None
    if batch_text is not None:
        try:
            batch = int(batch_text)
            validation.check_task_id(batch)
        except (TypeError, ValueError):
            raise BadInput(f"batch: {batch_text!r} is not a batch id") from None
    search = text("q")
    if search is not None and len(search) > 200:
        raise BadInput("q: a search is at most 200 characters")
    filters = reads.TaskFilters(
        queue=text("queue"),
        name=text("name"),
        status=TaskStatus(status) if status is not None else None,
        since=_moment("since", text("since")),
        until=_moment("until", text("until")),
        q=search,
        batch=batch,
    )
    if filters.queue is not None and len(filters.queue) > limits.queue_length:
        raise BadInput(f"queue: longer than the column's {limits.queue_length} characters")
    if filters.name is not None and len(filters.name) > limits.name_length:
        raise BadInput(f"name: longer than the column's {limits.name_length} characters")
    return filters, before


def _moment(name: str, value: str | None) -> datetime | None:
    """A time typed in the filter form (ISO 8601; UTC unless it names an offset)."""
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(f"{name}: {value!r} is not a date and time (YYYY-MM-DDTHH:MM, in UTC)") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _task_actions(status: TaskStatus) -> list[str]:
    """The actions that can change a task in ``status``."""
    if status in (TaskStatus.QUEUED, TaskStatus.RUNNING):
        return ["cancel"]
    if status in (TaskStatus.FAILED, TaskStatus.CANCELLED):
        return ["retry", "delete"]
    if status is TaskStatus.COMPLETED:
        return ["delete"]
    return []


def _timings(row: dict[str, Any], now: datetime) -> list[tuple[str, str]]:
    """How long the task waited and ran, as far as its times tell."""
    created, run_at, started, finished = (
        row.get(k) for k in ("created_at", "run_at", "started_at", "finished_at")
    )
    shown = []
    if started is not None and run_at is not None:
        shown.append(("waited after it was due", human_age(max(started - run_at, timedelta(0)))))
    elif run_at is not None and row.get("status") == TaskStatus.QUEUED.value:
        shown.append(("due in" if run_at > now else "due for", human_age(abs(run_at - now))))
    if started is not None and finished is not None:
        shown.append(("last run took", human_age(max(finished - started, timedelta(0)))))
    elif started is not None:
        shown.append(("running for", human_age(max(now - started, timedelta(0)))))
    if created is not None and finished is not None:
        shown.append(("enqueued to finished", human_age(max(finished - created, timedelta(0)))))
    return shown


def human_age(age: timedelta | None) -> str:
    """``850ms``, ``12.0s``, ``3.5m``, ``2.0h``, ``4.1d``."""
    if age is None:
        return "—"
    seconds = age.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    if seconds < 1:
        return f"{max(seconds, 0.0) * 1000:.0f}ms"
    return f"{seconds:.1f}s"


def when(value: datetime | None) -> str:
    """A time in UTC, to the second: ``2026-01-02 03:04:05``."""
    if value is None:
        return "—"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def in_zone(value: datetime | None, zone: str) -> str:
    """A time in the IANA ``zone``, with its offset: ``2026-01-02 04:04:05 +01:00``."""
    if value is None:
        return "—"
    shown = value.astimezone(ZoneInfo(zone))
    offset = shown.strftime("%z")
    return f"{shown:%Y-%m-%d %H:%M:%S} {offset[:3]}:{offset[3:]}"


def _url(base: str, path: str, query: dict[str, str] | None = None) -> str:
    query = {key: value for key, value in (query or {}).items() if value not in (None, "")}
    return base + path + (f"?{urlencode(query)}" if query else "")


def _here(request: Request) -> str:
    """The page's own path and query below the mount point: where a form's POST comes back to."""
    query = [(key, value) for key, value in request.query_params.multi_items() if key != "token"]
    path = _route_path(request) or "/"
    return f"{path}?{urlencode(query)}" if query else path


def _is_local(path: str) -> bool:
    """Whether ``path`` is a page of this dashboard (no scheme, no other host)."""
    return path.startswith("/") and not path.startswith("//") and "\\" not in path and "\n" not in path


def _read_flash(request: Request) -> Flash | None:
    raw = request.cookies.get(FLASH_COOKIE)
    if not raw:
        return None
    kind, _, text = unquote(raw).partition(":")
    return Flash("error" if kind == "error" else "ok", text[:500])
