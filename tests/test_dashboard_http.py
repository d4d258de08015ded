"""The dashboard over HTTP (Starlette's TestClient) on the live database: pages, actions and their guards.

Every page answers with the rows the table holds; every action changes
the database as the queue's own method would, and nothing else; a request
without the token, a POST without the CSRF token or to a read-only
dashboard changes nothing.  No page shows the database's password.
"""

from __future__ import annotations

import html
import logging
import re
import socket
import threading
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

import sa_taskqueue as tq
from sa_taskqueue.cli.dashboard import TOKEN_ENV, _HideToken, is_loopback
from sa_taskqueue.cli.main import cli
from sa_taskqueue.features.live_workers import list_live_workers
from sa_taskqueue.features.pausing import read_paused
from sa_taskqueue.integrations.prometheus import PrometheusMetrics
from tests.backends import ASYNC_DRIVERS, Backend, async_url
from tests.helpers import start_cli, wait_until
from tests.own_table import Job, JobBase

with warnings.catch_warnings():
    # Starlette's TestClient on httpx (it points at httpx2); the suite's FastAPI tests use the same client.
    warnings.simplefilter("ignore")
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.testclient import TestClient

from sa_taskqueue.integrations.dashboard import create_app, reads

PERIODIC = "reports.nightly"
PASSWORD = "dashboard-secret-pw-6472"
TOKEN = "t0ken-for-the-dashboard-tests"
STATUSES = ("queued", "running", "completed", "failed", "cancelled")
PAGES = ("/", "/tasks", "/workers", "/schedules", "/health")


def _password_engine(engine: sa.Engine) -> sa.Engine:
    """An engine on the test database whose URL carries a password, as a production URL would.

    It connects with the test engine's own arguments (the test servers trust
    local connections), so the password is only in the URL the dashboard is
    given, which is where a leak would come from.
    """
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    if engine.url.host:
        url = engine.url.set(username=engine.url.username or "someone", password=PASSWORD)
    else:
        # A file database's URL has no user or password part: the secret rides in its query.
        url = engine.url.update_query_dict({"password": PASSWORD})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sa.exc.SAWarning)  # SQLite's driver ignores the query's password
        return sa.create_engine(url, creator=lambda: engine.dialect.loaded_dbapi.connect(*cargs, **cparams))


@pytest.fixture
def queue(engine: sa.Engine) -> Iterator[tq.TaskQueue]:
    queue = tq.TaskQueue(_password_engine(engine))

    @queue.task(name="mail.send")
    def send(to: str) -> None: ...

    @queue.periodic("0 3 * * *", tz="Europe/Paris", name=PERIODIC, params={"scope": "all"})
    def nightly(scope: str) -> None: ...

    yield queue
    queue.close()
    queue.engine.dispose()


@pytest.fixture
def seeded(queue: tq.TaskQueue) -> dict[str, int]:
    """One task in each status (ids by status), finished ones within the last hour; the password in two."""
    now = datetime.now(UTC)
    ids: dict[str, int] = {}
    with Session(queue.engine) as session:
        for index, status in enumerate(STATUSES):
            task = tq.Task(
                name="mail.send",
                queue="mail" if status != "cancelled" else "default",
                params={"to": f"user{index}@example.com", "dsn": f"postgresql://app:{PASSWORD}@db/app"},
                status=status,
                created_at=now - timedelta(minutes=30),
                run_at=now - timedelta(minutes=20),
                attempts=1 if status != "queued" else 0,
            )
            if status == "running":
                task.started_at, task.locked_by = now - timedelta(minutes=1), "host:1:abc"
                task.locked_until = now + timedelta(minutes=5)
            if status in ("completed", "failed", "cancelled"):
                task.started_at, task.finished_at = now - timedelta(minutes=10), now - timedelta(minutes=9)
            if status == "failed":
                task.last_error = (
                    f"Traceback (most recent call last):\nConnectionError: postgresql://app:{PASSWORD}@db"
                )
            if status == "completed":
                task.result = {"sent": True}
            session.add(task)
            session.flush()
            ids[status] = task.id
        session.commit()
    return ids


def client_of(app: Any, **kwargs: Any) -> TestClient:
    return TestClient(app, **kwargs)


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found is not None, "the page has a form with a CSRF token"
    return found.group(1)


def status_of(engine: sa.Engine, task_id: int) -> str | None:
    t = tq.Task.__table__
    with engine.connect() as conn:
        return conn.scalar(sa.select(t.c.status).where(t.c.id == task_id))


def all_rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    t = tq.Task.__table__
    with engine.connect() as conn:
        return [
            tuple(row) for row in conn.execute(sa.select(t.c.id, t.c.status, t.c.run_at).order_by(t.c.id))
        ]


# Pages ------------------------------------------------------------------------------------------


def test_every_page_answers_with_the_tables_tasks(queue: tq.TaskQueue, seeded: dict[str, int]) -> None:
    client = client_of(create_app(queue))
    pages = {path: client.get(path) for path in (*PAGES, *(f"/tasks/{i}" for i in seeded.values()))}
    for path, response in pages.items():
        assert response.status_code == 200, (path, response.text[:500])
        assert 'data-nav="overview"' in response.text
    overview = pages["/"].text
    assert '<main data-page="overview">' in overview
    mail = re.search(r'<tr data-queue="mail">(.*?)</tr>', overview, re.S)
    assert mail is not None
    for status in STATUSES:
        expected = "0" if status == "cancelled" else "1"
        cell = re.search(rf'data-status="{status}">(?:<a [^>]*>)?(\d+)', mail.group(1))
        assert cell is not None and cell.group(1) == expected, status
    assert 'data-paused="false"' in mail.group(1)
    assert 'svg data-chart="throughput"' in overview
    # The chart counts the finished rows of the last hour: one completed, one failed.
    assert "completed (1)" in overview and "failed (1)" in overview
    tasks = pages["/tasks"].text
    assert all(f'data-task-id="{task_id}"' in tasks for task_id in seeded.values())
    failed = pages[f"/tasks/{seeded['failed']}"].text
    assert '<main data-page="task">' in failed
    assert re.search(r'<pre data-field="last_error"[^>]*>Traceback', failed)
    assert 'data-field="name">mail.send' in failed
    assert 'data-action="retry"' in failed and 'data-action="delete"' in failed
    assert 'data-action="cancel"' in pages[f"/tasks/{seeded['queued']}"].text
    running = pages[f"/tasks/{seeded['running']}"].text.split("<main", 1)[1]
    assert re.findall(r'data-action="([^"]+)"', running) == ["cancel"], "a running task can only be cancelled"
    schedules = pages["/schedules"].text
    assert f'<tr data-schedule="{PERIODIC}">' in schedules
    assert "Europe/Paris" in schedules and 'data-action="enqueue-now"' in schedules
    health = pages["/health"].text
    assert 'section data-check="table_health"' in health
    assert re.search(r'section data-check="(skip_locked|conditional_update|advisory_lock)"', health)
    assert '<main data-page="workers">' in pages["/workers"].text


def test_no_page_shows_the_database_password(queue: tq.TaskQueue, seeded: dict[str, int]) -> None:
    client = client_of(create_app(queue))
    paths = [*PAGES, "/tasks?q=dsn", *(f"/tasks/{task_id}" for task_id in seeded.values())]
    for path in paths:
        response = client.get(path)
        assert response.status_code == 200, path
        assert PASSWORD not in response.text, path
    overview = client.get("/").text
    assert "***" in overview or "%2A%2A%2A" in overview  # the URL is shown, its password masked


def test_a_missing_task_is_404_and_a_bad_filter_400(queue: tq.TaskQueue, seeded: dict[str, int]) -> None:
    client = client_of(create_app(queue))
    assert client.get("/tasks/999999999").status_code == 404
    bad = client.get("/tasks?since=yesterday")
    assert bad.status_code == 400
    assert "since: &#39;yesterday&#39; is not a date and time" in bad.text
    assert client.get("/tasks?status=lost").status_code == 400
    assert client.get("/tasks?before=x").status_code == 400


def test_the_task_list_pages_by_id_and_filters(queue: tq.TaskQueue, seeded: dict[str, int]) -> None:
    with Session(queue.engine) as session:
        for index in range(120):
            session.add(tq.Task(name="bulk.job", queue="bulk", params={"n": index, "tag": f"t{index % 7}"}))
        session.commit()
    client = client_of(create_app(queue))
    seen: list[int] = []
    url: str | None = "/tasks?queue=bulk"
    pages = 0
    while url is not None:
        page = client.get(url).text
        ids = [int(i) for i in re.findall(r'data-task-id="(\d+)"', page)]
        assert len(ids) <= 50
        seen.extend(ids)
        found = re.search(r'<a data-next-page href="([^"]+)"', page)
        url = found.group(1).replace("&amp;", "&") if found else None
        pages += 1
    assert pages == 3
    assert len(seen) == 120 and seen == sorted(seen, reverse=True)
    # Filters: name, status, text in params, error text, created time.
    tagged = client.get("/tasks?q=%22t3%22").text  # the tag's JSON string: t3 exactly
    assert len(re.findall(r'data-task-id="', tagged)) == len([i for i in range(120) if i % 7 == 3])
    errors = client.get("/tasks?q=connectionerror").text
    assert re.findall(r'data-task-id="(\d+)"', errors) == [str(seeded["failed"])]
    running = client.get("/tasks?status=running").text
    assert re.findall(r'data-task-id="(\d+)"', running) == [str(seeded["running"])]
    future = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    assert "data-task-id" not in client.get(f"/tasks?since={future}").text
    assert len(re.findall(r"data-task-id", client.get(f"/tasks?until={future}&name=mail.send").text)) == 5
    # A wildcard typed in the search is a character, not a pattern.
    assert "data-task-id" not in client.get("/tasks?q=%25%25%25").text


# Actions ----------------------------------------------------------------------------------------


def post(client: TestClient, page: str, action: str, **fields: str) -> Any:
    token = csrf_of(client.get(page).text)
    return client.post(action, data={"csrf_token": token, "next": page, **fields}, follow_redirects=False)


def test_each_action_changes_the_database(queue: tq.TaskQueue, seeded: dict[str, int]) -> None:
    engine = queue.engine
    client = client_of(create_app(queue))

    failed = seeded["failed"]
    response = post(client, f"/tasks/{failed}", f"/tasks/{failed}/retry")
    assert response.status_code == 303 and response.headers["location"] == f"/tasks/{failed}"
    assert status_of(engine, failed) == "queued"
    assert "is queued to run again" in client.get(response.headers["location"]).text

    queued = seeded["queued"]
    post(client, f"/tasks/{queued}", f"/tasks/{queued}/cancel")
    assert status_of(engine, queued) == "cancelled"

    completed = seeded["completed"]
    response = post(client, f"/tasks/{completed}", f"/tasks/{completed}/delete")
    assert status_of(engine, completed) is None
    assert response.headers["location"] == "/tasks"  # its own page is gone
    assert "is deleted" in client.get("/tasks").text

    # A running task is not deleted (its worker would lose its outcome): refused, with a message.
    running = seeded["running"]
    response = post(client, "/", f"/tasks/{running}/delete")
    assert status_of(engine, running) == "running"
    assert "nothing deleted" in client.get(response.headers["location"]).text

    # A running task's cancel is recorded for its worker, who did it and when kept on the row.
    response = post(client, f"/tasks/{running}", f"/tasks/{running}/cancel")
    assert status_of(engine, running) == "running"
    page = client.get(response.headers["location"]).text
    assert f"Task {running} is running: cancel requested; its worker stops it within one heartbeat." in page
    assert 'data-field="cancelled_by">dashboard<' in page

    post(client, "/", "/queues/mail/pause")
    assert read_paused(engine, queue.table) == frozenset({"mail"})
    page = client.get("/").text
    assert re.search(r'<tr data-queue="mail">.*?data-paused="true"', page, re.S)
    assert "data-flash" in page
    post(client, "/", "/queues/mail/resume")
    assert read_paused(engine, queue.table) == frozenset()

    before = {row[0] for row in all_rows(engine)}
    post(client, "/schedules", f"/schedules/{PERIODIC}/enqueue")
    t = tq.Task.__table__
    with engine.connect() as conn:
        new = conn.execute(sa.select(t).where(t.c.id.not_in(before))).all()
    assert [(row.name, row.status, row.params) for row in new] == [(PERIODIC, "queued", {"scope": "all"})]


def test_a_post_without_a_valid_csrf_token_is_refused(queue: tq.TaskQueue, seeded: dict[str, int]) -> None:
    engine = queue.engine
    client = client_of(create_app(queue))
    client.get("/")  # sets the CSRF cookie
    rows = all_rows(engine)
    failed = seeded["failed"]
    assert client.post(f"/tasks/{failed}/retry", data={}).status_code == 403
    assert client.post(f"/tasks/{failed}/retry", data={"csrf_token": "forged"}).status_code == 403
    assert client.post("/queues/mail/pause", data={"csrf_token": ""}).status_code == 403
    # A token from the page, sent without the cookie it signs (another site's form): refused.
    token = csrf_of(client.get(f"/tasks/{failed}").text)
    stranger = client_of(create_app(queue))
    assert stranger.post(f"/tasks/{failed}/retry", data={"csrf_token": token}).status_code == 403
    assert all_rows(engine) == rows
    assert read_paused(engine, queue.table) == frozenset()


def test_a_read_only_dashboard_shows_no_action_and_refuses_posts(
    queue: tq.TaskQueue, seeded: dict[str, int]
) -> None:
    client = client_of(create_app(queue, read_only=True))
    for path in (*PAGES, *(f"/tasks/{task_id}" for task_id in seeded.values())):
        response = client.get(path)
        assert response.status_code == 200
        assert "data-action" not in response.text, path
    rows = all_rows(queue.engine)
    token = csrf_of(client_of(create_app(queue)).get("/").text)
    for action in (
        f"/tasks/{seeded['failed']}/retry",
        "/queues/mail/pause",
        f"/schedules/{PERIODIC}/enqueue",
    ):
        assert client.post(action, data={"csrf_token": token}).status_code == 403
    assert all_rows(queue.engine) == rows
    assert read_paused(queue.engine, queue.table) == frozenset()


# Authentication -----------------------------------------------------------------------------------


def test_a_token_is_needed_from_a_header_or_once_in_the_url(
    queue: tq.TaskQueue, seeded: dict[str, int]
) -> None:
    app = create_app(queue, auth=TOKEN)
    client = client_of(app)
    for path in (*PAGES, f"/tasks/{seeded['queued']}"):
        assert client.get(path).status_code == 401, path
    assert client.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/?token=wrong").status_code == 401
    assert "sa_taskqueue_dashboard" not in client.cookies
    assert client.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    # The static files carry no data: served to anyone (the login page needs none, but a refusal may).
    assert client.get("/static/dashboard.css").status_code == 200

    # ?token= once: a session cookie, and the same page without the token in its URL.
    response = client.get(f"/tasks?status=failed&token={TOKEN}", follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == "/tasks?status=failed"
    assert "sa_taskqueue_dashboard" in response.cookies
    assert client.get("/tasks?status=failed").status_code == 200
    # A forged session cookie is not one.
    forger = client_of(app, cookies={"sa_taskqueue_dashboard": "abc.def"})
    assert forger.get("/").status_code == 401

    # A POST without the token changes nothing, even with a valid CSRF token.
    token = csrf_of(client.get(f"/tasks/{seeded['queued']}").text)
    anonymous = client_of(app, cookies={"sa_taskqueue_csrf": client.cookies["sa_taskqueue_csrf"]})
    response = anonymous.post(f"/tasks/{seeded['queued']}/cancel", data={"csrf_token": token})
    assert response.status_code == 401
    assert status_of(queue.engine, seeded["queued"]) == "queued"


def test_a_host_callable_decides_who_gets_in(queue: tq.TaskQueue, seeded: dict[str, int]) -> None:
    asked: list[str] = []

    def staff_only(request: Any) -> bool:
        asked.append(request.url.path)
        return request.headers.get("x-staff") == "yes"

    client = client_of(create_app(queue, auth=staff_only))
    assert client.get("/").status_code == 401
    assert client.get("/", headers={"X-Staff": "yes"}).status_code == 200
    token = csrf_of(client.get("/", headers={"X-Staff": "yes"}).text)
    response = client.post("/queues/mail/pause", data={"csrf_token": token})
    assert response.status_code == 401
    assert read_paused(queue.engine, queue.table) == frozenset()
    assert asked  # the callable was asked


def test_an_async_host_callable_is_awaited_and_only_true_lets_in(queue: tq.TaskQueue) -> None:
    async def staff_only(request: Any) -> bool:
        return request.headers.get("x-staff") == "yes"

    client = client_of(create_app(queue, auth=staff_only))
    assert client.get("/").status_code == 401
    assert client.get("/", headers={"X-Staff": "yes"}).status_code == 200
    # A truthy answer that is not True (a forgotten comparison, a user object) is a refusal.
    assert client_of(create_app(queue, auth=lambda request: "yes")).get("/").status_code == 401


def test_create_app_refuses_an_empty_token_and_a_bad_auth(queue: tq.TaskQueue) -> None:
    with pytest.raises(ValueError, match="empty token"):
        create_app(queue, auth="")
    with pytest.raises(TypeError, match="auth must be"):
        create_app(queue, auth=42)  # type: ignore[arg-type]


def test_pages_carry_strict_security_headers(queue: tq.TaskQueue, seeded: dict[str, int]) -> None:
    client = client_of(create_app(queue))
    response = client.get("/")
    csp = response.headers["content-security-policy"]
    assert "unsafe-inline" not in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["cache-control"] == "no-store"
    assert response.headers["referrer-policy"] == "no-referrer"
    assert "<script>" not in response.text and " style=" not in response.text
    # The static files are revalidated by their ETag rather than fetched again on every page.
    css = client.get("/static/dashboard.css")
    assert css.headers["cache-control"] == "no-cache"
    again = client.get("/static/dashboard.css", headers={"If-None-Match": css.headers["etag"]})
    assert again.status_code == 304


def test_mounted_its_links_and_actions_follow_the_mount_point(
    queue: tq.TaskQueue, seeded: dict[str, int]
) -> None:
    host = Starlette(routes=[Mount("/ops/queue", create_app(queue))])
    client = client_of(host)
    page = client.get("/ops/queue/").text
    links = re.findall(r'(?<![-\w])(?:href|action|src)="([^"]+)"', page)
    assert links
    assert [link for link in links if not link.startswith("/ops/queue/")] == []
    failed = seeded["failed"]
    response = post(
        client, f"/ops/queue/tasks/{failed}", f"/ops/queue/tasks/{failed}/retry", next=f"/tasks/{failed}"
    )
    assert response.status_code == 303
    assert response.headers["location"] == f"/ops/queue/tasks/{failed}"
    assert status_of(queue.engine, failed) == "queued"


def test_given_an_engine_or_a_url_it_shows_the_librarys_table(
    queue: tq.TaskQueue, seeded: dict[str, int]
) -> None:
    client = client_of(create_app(queue.engine))
    assert all(f'data-task-id="{i}"' in client.get("/tasks").text for i in seeded.values())
    assert "No application was loaded" in client.get("/schedules").text


# The command line ----------------------------------------------------------------------------------


def test_the_command_refuses_a_public_address_without_a_token(engine: sa.Engine) -> None:
    url = engine.url.render_as_string(hide_password=False)
    result = CliRunner().invoke(cli, ["dashboard", "--url", url, "--host", "0.0.0.0"], env={})
    assert result.exit_code == 1
    assert "refusing to serve the dashboard on 0.0.0.0 without a token" in result.output
    assert "--token" in result.output
    result = CliRunner().invoke(cli, ["dashboard", "--url", url, "--host", "0.0.0.0", "--token", " "], env={})
    assert result.exit_code == 2
    assert "--token is empty" in result.output


# An async engine, and a table of many rows ---------------------------------------------------------


def test_a_queue_on_an_async_engine_is_shown_and_changed(
    backend: Backend, engine: sa.Engine, seeded: dict[str, int]
) -> None:
    """The pages and actions run their sync calls through the queue's own bridge to its loop."""
    async_engine = create_async_engine(
        async_url(backend.url, ASYNC_DRIVERS[backend.name][0]), poolclass=NullPool
    )
    queue = tq.TaskQueue(async_engine)
    try:
        assert queue.is_async
        client = client_of(create_app(queue))
        for path in (*PAGES, f"/tasks/{seeded['failed']}"):
            assert client.get(path).status_code == 200, path
        post(client, f"/tasks/{seeded['failed']}", f"/tasks/{seeded['failed']}/retry")
        post(client, f"/tasks/{seeded['queued']}", f"/tasks/{seeded['queued']}/cancel")
        post(client, "/", "/queues/mail/pause")
        assert status_of(engine, seeded["failed"]) == "queued"
        assert status_of(engine, seeded["queued"]) == "cancelled"
        assert read_paused(engine, queue.table) == frozenset({"mail"})
    finally:
        queue.close()


def test_a_filtered_page_searches_a_bounded_id_window_then_offers_older(
    queue: tq.TaskQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search that matches little stops after SCAN_WINDOW ids (here 100), not at the end of the table."""
    monkeypatch.setattr(reads, "SCAN_WINDOW", 100)
    with Session(queue.engine) as session:
        session.add_all(
            tq.Task(name="rare.job" if index in (5, 250) else "common.job", params={"n": index})
            for index in range(300)
        )
        session.commit()
    client = client_of(create_app(queue))
    found: list[int] = []
    windows = 0
    url: str | None = "/tasks?name=rare.job"
    while url is not None:
        page = client.get(url).text
        found.extend(int(i) for i in re.findall(r'data-task-id="(\d+)"', page))
        if "Searched ids down to" in page:
            windows += 1
        link = re.search(r'<a data-next-page href="([^"]+)"', page)
        url = link.group(1).replace("&amp;", "&") if link else None
    t = tq.Task.__table__
    with queue.engine.connect() as conn:
        rare = list(conn.scalars(sa.select(t.c.id).where(t.c.name == "rare.job").order_by(t.c.id.desc())))
    assert found == rare
    assert windows >= 2  # it stopped at a window's end at least twice before reaching the oldest id


def test_a_database_it_cannot_reach_is_a_503_page_without_the_password() -> None:
    unreachable = f"postgresql+psycopg://app:{PASSWORD}@127.0.0.1:1/app?connect_timeout=2"
    client = client_of(create_app(unreachable))
    response = client.get("/tasks")
    assert response.status_code == 503
    assert "could not be reached" in response.text
    assert PASSWORD not in response.text


def test_the_workers_page_lists_a_running_worker_and_the_tasks_no_worker_serves(
    queue: tq.TaskQueue, seeded: dict[str, int]
) -> None:
    with Session(queue.engine) as session:
        session.add(tq.Task(name="billing.v2", queue="mail"))  # no worker registers it
        session.commit()
    worker = tq.Worker(queue, queues=["mail"], watchdog=False, poll_interval=0.1)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: list_live_workers(queue.engine, queue.table), 30, "the worker to register")
        page = client_of(create_app(queue)).get("/workers")
        assert page.status_code == 200
        assert f'<tr data-worker-id="{html.escape(worker.worker_id)}">' in page.text
        assert 'data-unserved="mail/billing.v2"' in page.text
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert 'data-worker-id="' not in client_of(create_app(queue)).get("/workers").text


def test_the_command_keeps_the_token_out_of_the_access_log_and_knows_loopback_addresses() -> None:
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        "",
        0,
        '%s - "%s %s"',
        ("127.0.0.1:1", "GET", f"/?a=1&token={TOKEN}"),
        None,
    )
    assert _HideToken().filter(record)
    assert TOKEN not in record.getMessage() and "token=***" in record.getMessage()
    assert all(is_loopback(host) for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(host) for host in ("0.0.0.0", "::", "10.0.0.5", "example.com"))


def test_the_chart_counts_each_finished_task_in_its_minute(queue: tq.TaskQueue) -> None:
    now = datetime(2026, 1, 1, 12, 0, 30, tzinfo=UTC)  # the chart spans 11:01:00 to 12:01:00
    finished = {
        datetime(2026, 1, 1, 11, 0, 59, tzinfo=UTC): "completed",  # before the hour: left out
        datetime(2026, 1, 1, 11, 1, 0, tzinfo=UTC): "completed",  # minute 0
        datetime(2026, 1, 1, 11, 55, 0, tzinfo=UTC): "completed",  # minute 54
        datetime(2026, 1, 1, 11, 55, 59, tzinfo=UTC): "failed",  # minute 54
        datetime(2026, 1, 1, 12, 0, 59, tzinfo=UTC): "completed",  # minute 59
        datetime(2026, 1, 1, 12, 1, 0, tzinfo=UTC): "failed",  # after the end: left out
    }
    with Session(queue.engine) as session:
        session.add_all(tq.Task(name="x", status=status, finished_at=at) for at, status in finished.items())
        session.commit()
    chart = reads.throughput(queue.engine, queue.table, now)
    assert chart.start == datetime(2026, 1, 1, 11, 1, tzinfo=UTC)
    assert {i: n for i, n in enumerate(chart.completed) if n} == {0: 1, 54: 1, 59: 1}
    assert {i: n for i, n in enumerate(chart.failed) if n} == {54: 1}


@pytest.mark.slow  # a real process
def test_the_command_serves_the_apps_dashboard_behind_its_token(backend: Backend, engine: sa.Engine) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = start_cli(
        "dashboard",
        "tests.periodic_app:cli_queue",
        "--port",
        str(port),
        "--root-path",
        "/ops/queue",  # as behind a proxy that strips it before the request arrives
        url=backend.url,
        **{TOKEN_ENV: TOKEN},
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def answers() -> bool:
            try:
                return httpx.get(f"{base}/", timeout=2).status_code == 401
            except httpx.TransportError:
                assert server.poll() is None, server.communicate()
                return False

        wait_until(answers, 60, "the dashboard to listen")
        with httpx.Client(base_url=base, timeout=10) as browser:
            # Redirected to the same page without the token, under the proxy's path.
            redirect = browser.get(f"/schedules?token={TOKEN}")
            assert redirect.status_code == 303 and redirect.headers["location"] == "/ops/queue/schedules"
            session = redirect.cookies["sa_taskqueue_dashboard"]  # set for /ops/queue/, the browser's path
            # What the proxy passes on: the path without /ops/queue, the browser's cookie.
            opened = browser.get("/schedules", headers={"Cookie": f"sa_taskqueue_dashboard={session}"})
            assert opened.status_code == 200
            assert '<tr data-schedule="nightly_paris">' in opened.text and "Europe/Paris" in opened.text
            links = re.findall(r'(?<![-\w])(?:href|action|src)="([^"]+)"', opened.text)
            assert links and all(link.startswith("/ops/queue/") for link in links)
            # The command attaches the queue's metrics: /metrics has the table's gauges.
            scraped = browser.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            assert scraped.status_code == 200 and "# TYPE sa_taskqueue_queue_depth gauge" in scraped.text
    finally:
        server.terminate()
        out, err = server.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}/" in out
    assert TOKEN not in out + err  # the access log shows ?token=***
    assert "token=***" in out + err


def test_an_apps_own_task_table_mounted_in_fastapi(engine: sa.Engine) -> None:
    """A queue on the application's own table (TaskMixin on its Base), under a FastAPI mount."""
    JobBase.metadata.create_all(engine)
    jobs = Job.__table__
    with engine.begin() as conn:
        conn.execute(jobs.delete())
    queue = tq.TaskQueue(engine, model=Job)
    try:
        with Session(engine) as session:
            failed = Job(
                name="report.build", queue="reports", status="failed", last_error="RuntimeError: no data"
            )
            session.add_all([failed, Job(name="mail.send", queue="mail")])
            session.commit()
            failed_id = failed.id
        host = FastAPI()
        host.mount("/queue", create_app(queue))
        client = client_of(host)
        assert '<tr data-queue="reports">' in client.get("/queue/").text
        assert f'data-task-id="{failed_id}"' in client.get("/queue/tasks").text
        assert "RuntimeError: no data" in client.get(f"/queue/tasks/{failed_id}").text
        response = post(client, f"/queue/tasks/{failed_id}", f"/queue/tasks/{failed_id}/retry", next="/")
        assert response.headers["location"] == "/queue/"
        with engine.connect() as conn:
            assert conn.scalar(sa.select(jobs.c.status).where(jobs.c.id == failed_id)) == "queued"
        # The library's own table was never touched.
        assert all_rows(engine) == []
    finally:
        queue.close()
        JobBase.metadata.drop_all(engine)


def test_a_huge_value_is_cut_on_the_page_saying_how_much(queue: tq.TaskQueue) -> None:
    with Session(queue.engine) as session:
        task = tq.Task(name="big", params={"blob": "x" * 150_000}, status="failed", last_error="E" * 120_000)
        session.add(task)
        session.commit()
        task_id = task.id
    page = client_of(create_app(queue)).get(f"/tasks/{task_id}").text
    assert "x" * 150_000 not in page and "E" * 120_000 not in page
    assert "20,000 more characters not shown" in page  # of the error: 120,000 - 100,000
    assert len(page) < 250_000


def test_metrics_are_served_behind_the_dashboards_auth(queue: tq.TaskQueue, seeded: dict[str, int]) -> None:
    metrics = PrometheusMetrics(queue, gauges="always").attach()  # the process's default registry
    try:
        client = client_of(create_app(queue, auth=TOKEN))
        assert client.get("/metrics").status_code == 401
        scraped = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain")
        assert 'sa_taskqueue_queue_depth{queue="mail",status="queued"} 1.0' in scraped.text
    finally:
        metrics.detach()
