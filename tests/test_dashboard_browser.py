"""The dashboard in a real browser: every page renders the database's rows, every button changes them.

The dashboard runs under uvicorn against the suite's live database (``--backend``),
and Debian's Chromium drives it through Playwright: one browser and one context
for the module, a new page with no cookies per test.  The rows come from the queue's own
API and a real worker (`tests.dashboard_server.seed`); what an action did is read
back from the database, never from the page.  Each test fails on a console error,
an uncaught exception or a failed request on any page it opened.

Without Chromium these tests skip on a developer's machine and fail in CI
(``CI`` set), each saying what to install.  With ``SA_TASKQUEUE_SCREENSHOTS=<dir>``
they save each page as ``dashboard-<page>.png`` there (the docs' images).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.core.worker_table import worker_table_of
from sa_taskqueue.worker.worker import Worker
from tests.dashboard_server import (
    PERIODIC,
    SCREENSHOTS_VARIABLE,
    Seeded,
    launch_chromium,
    make_dashboard_queue,
    require_browser,
    seed,
    serve,
    statuses,
)
from tests.helpers import wait_until

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, ConsoleMessage, Page, Request, Response

TOKEN = "correct-horse-battery-staple"

#: Mount points of the token-protected and read-only apps, served side by side by one server.
LOCKED = "/locked"
READ_ONLY = "/read-only"


@dataclass
class Dashboards:
    """Where each dashboard answers: the plain one at its server's root, the others mounted."""

    plain: str
    locked: str
    read_only: str
    host: str


#: A page of the host application with each kind of problem the tests fail on.
BROKEN_PAGE = """<!doctype html><title>broken</title><link rel="icon" href="data:,">
<img src="/missing.png" alt="">
<script>console.error("logged by the page"); throw new Error("thrown by the page");</script>"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    require_browser()
    from playwright.sync_api import expect

    # Bounded waits, with room for a CI machine running three sessions on two cores.
    expect.set_options(timeout=10_000)
    with launch_chromium() as browser:
        yield browser


@pytest.fixture(scope="module")
def dashboard_queue(engine: sa.Engine) -> Iterator[tq.TaskQueue]:
    queue = make_dashboard_queue(engine)
    yield queue
    queue.close()


@pytest.fixture(scope="module")
def dashboards(browser: Browser, dashboard_queue: tq.TaskQueue) -> Iterator[Dashboards]:
    try:
        from sa_taskqueue.integrations.dashboard import create_app
    except ImportError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the dashboard's extra is not installed ({error}): pip install -e '.[dev,dashboard]'")
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Mount, Route

    async def broken(_request: Any) -> HTMLResponse:
        return HTMLResponse(BROKEN_PAGE)

    # The other two are mounted, as a host application would mount them: each
    # link and form action has to stay under its mount point.  The host's own
    # broken page shows that the problem collector catches what it should.
    mounted = Starlette(
        routes=[
            Mount(LOCKED, create_app(dashboard_queue, auth=TOKEN)),
            Mount(READ_ONLY, create_app(dashboard_queue, read_only=True)),
            Route("/broken", broken),
        ]
    )
    with serve(create_app(dashboard_queue)) as plain, serve(mounted) as host:
        yield Dashboards(plain.base_url, host.base_url + LOCKED, host.base_url + READ_ONLY, host.base_url)


@dataclass
class Problems:
    """What went wrong in the browser while a test ran: console errors, page errors, failed requests."""

    seen: list[str] = field(default_factory=list)
    #: Response statuses a test expects (a refusal it provokes) rather than counts as a failure.
    expected_statuses: set[int] = field(default_factory=set)

    def on_console(self, message: ConsoleMessage) -> None:
        if message.type != "error":
            return
        # Chromium logs each 4xx/5xx response as a console error too; the response itself is judged below.
        status = re.search(r"status of (\d{3})", message.text)
        if status and int(status.group(1)) in self.expected_statuses:
            return
        self.seen.append(f"console error: {message.text} ({message.location.get('url')})")

    def on_page_error(self, error: Exception) -> None:
        self.seen.append(f"uncaught exception: {error}")

    def on_request_failed(self, request: Request) -> None:
        # A load the page's own navigation cut short (a click before the icon arrived) is no failure;
        # a refused script or style is a console error above.
        if request.failure == "net::ERR_ABORTED":
            return
        self.seen.append(f"request failed: {request.method} {request.url}: {request.failure}")

    def on_response(self, response: Response) -> None:
        if response.status >= 400 and response.status not in self.expected_statuses:
            self.seen.append(f"HTTP {response.status}: {response.request.method} {response.url}")


@pytest.fixture
def problems() -> Problems:
    return Problems()


@pytest.fixture(scope="module")
def context(browser: Browser) -> Iterator[BrowserContext]:
    context = browser.new_context(viewport={"width": 1280, "height": 600})
    context.set_default_timeout(10_000)
    yield context
    context.close()


@pytest.fixture
def page(context: BrowserContext, problems: Problems) -> Iterator[Page]:
    """A new page without cookies; the test fails if any page it opened logged an error."""
    context.clear_cookies()
    page = context.new_page()
    page.on("console", problems.on_console)
    page.on("pageerror", problems.on_page_error)
    page.on("requestfailed", problems.on_request_failed)
    page.on("response", problems.on_response)
    # A confirmation before a destructive action is accepted, as a user would.
    page.on("dialog", lambda dialog: dialog.accept())
    yield page
    page.close()
    assert not problems.seen, "the browser saw:\n" + "\n".join(problems.seen)


def screenshot(page: Page, name: str) -> None:
    """Save the page as dashboard-<name>.png where SA_TASKQUEUE_SCREENSHOTS says."""
    folder = os.environ.get(SCREENSHOTS_VARIABLE)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"dashboard-{name}.png"), full_page=True)


def expect(*args: Any, **kwargs: Any) -> Any:
    from playwright.sync_api import expect

    return expect(*args, **kwargs)


def open_page(page: Page, url: str, name: str) -> None:
    """Go to ``url`` and wait for the contract's ``<main data-page=name>``."""
    response = page.goto(url)
    assert response is not None
    assert response.status == 200, f"{url} answered {response.status}"
    expect(page.locator(f'main[data-page="{name}"]')).to_be_visible()


def count(page: Page, selector: str) -> int:
    """The number a table cell shows (an empty cell or a dash counts as none)."""
    text = page.locator(selector).inner_text()
    digits = re.sub(r"\D", "", text)
    return int(digits) if digits else 0


def shown_task_ids(page: Page) -> list[int]:
    return [
        int(value)
        for value in page.locator("tr[data-task-id]").evaluate_all(
            "rows => rows.map(row => row.dataset.taskId)"
        )
    ]


def follow_nav(page: Page, name: str, base: str) -> None:
    """Click the navigation's link to page ``name`` and wait for it; its address stays under ``base``."""
    with page.expect_navigation():
        page.locator(f'a[data-nav="{name}"]').click()
    expect(page.locator(f'main[data-page="{name}"]')).to_be_visible()
    assert page.url.startswith(base + "/")


def paused_queues(queue: tq.TaskQueue) -> set[str]:
    return set(queue.paused_queues())


# Pages ------------------------------------------------------------------------


def test_the_problem_collector_catches_what_the_pages_are_checked_for(
    dashboards: Dashboards, page: Page, problems: Problems
) -> None:
    """The check every test ends with can fail: a host page with an error of each kind trips it."""
    page.goto(dashboards.host + "/broken")
    page.wait_for_load_state("load")
    seen = "\n".join(problems.seen)
    assert "console error: logged by the page" in seen
    assert "uncaught exception: thrown by the page" in seen
    assert "HTTP 404: GET " + dashboards.host + "/missing.png" in seen
    page.close()
    problems.seen.clear()


def test_every_page_shows_the_database_s_rows(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page
) -> None:
    """One walk through the navigation, as a user would click it, checking each page against the rows."""
    seeded = seed(engine, dashboard_queue)

    open_page(page, dashboards.plain + "/", "overview")
    emails, images = 'tr[data-queue="emails"]', 'tr[data-queue="images"]'
    expect(page.locator(emails)).to_be_visible()
    assert count(page, f'{emails} td[data-status="completed"]') == 2
    assert count(page, f'{emails} td[data-status="running"]') == 1
    assert count(page, f'{emails} td[data-status="cancelled"]') == 1
    assert count(page, f'{emails} td[data-status="queued"]') == 0
    assert count(page, f'{images} td[data-status="failed"]') == 1
    assert count(page, f'{images} td[data-status="queued"]') == 2
    expect(page.locator(f"{images} [data-paused]")).to_have_attribute("data-paused", "true")
    expect(page.locator(f"{emails} [data-paused]")).to_have_attribute("data-paused", "false")
    expect(page.locator('svg[data-chart="throughput"]')).to_be_visible()
    screenshot(page, "overview")

    follow_nav(page, "tasks", dashboards.plain)
    assert shown_task_ids(page) == sorted(statuses(engine), reverse=True)
    failed_row = page.locator(f'tr[data-task-id="{seeded.failed}"]')
    expect(failed_row.locator('td[data-field="name"]')).to_have_text("images.resize")
    expect(failed_row.locator('td[data-field="queue"]')).to_have_text("images")
    expect(failed_row.locator('td[data-field="status"]')).to_contain_text("failed")
    screenshot(page, "tasks")

    # The filter form, as a user fills it in: the status filter, submitted.
    filters = page.locator("form[data-filters]")
    status = filters.locator('[name="status"]')
    if status.evaluate("field => field.tagName") == "SELECT":
        status.select_option("failed")
    else:
        status.fill("failed")
    submit = filters.locator('button[type="submit"], input[type="submit"], button:not([type])')
    with page.expect_navigation():
        if submit.count():
            submit.first.click()
        else:
            status.press("Enter")
    expect(page.locator("tr[data-task-id]")).to_have_count(1)
    assert shown_task_ids(page) == [seeded.failed]
    assert "status=failed" in page.url

    # The task's own page, through its row's link: the row's fields and the worker's traceback.
    with page.expect_navigation():
        failed_row.locator('td[data-field="name"] a').click()
    expect(page.locator('main[data-page="task"]')).to_be_visible()
    expect(page.locator('[data-field="name"]')).to_contain_text("images.resize")
    expect(page.locator('[data-field="status"]')).to_contain_text("failed")
    expect(page.locator('[data-field="queue"]')).to_contain_text("images")
    expect(page.locator('[data-field="params"]')).to_contain_text("/uploads/cat.txt")
    error = page.locator('pre[data-field="last_error"]')
    expect(error).to_contain_text("Traceback")
    expect(error).to_contain_text("ValueError: cannot resize /uploads/cat.txt: not an image")
    screenshot(page, "task")

    follow_nav(page, "workers", dashboards.plain)
    screenshot(page, "workers")  # with a live worker's row when test_workers_page_lists_a_live_worker runs

    follow_nav(page, "schedules", dashboards.plain)
    schedule = page.locator(f'tr[data-schedule="{PERIODIC}"]')
    expect(schedule).to_be_visible()
    expect(schedule).to_contain_text("reports")
    screenshot(page, "schedules")

    follow_nav(page, "health", dashboards.plain)
    expect(page.locator("section[data-check]").first).to_be_visible()
    screenshot(page, "health")

    follow_nav(page, "overview", dashboards.plain)


def test_task_filters_keep_the_rows_that_match(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page
) -> None:
    seeded = seed(engine, dashboard_queue)
    open_page(page, dashboards.plain + "/tasks?name=mail.send_welcome", "tasks")
    assert shown_task_ids(page) == sorted([*seeded.completed, seeded.running, seeded.cancelled], reverse=True)
    open_page(page, dashboards.plain + "/tasks?queue=images&status=queued", "tasks")
    assert shown_task_ids(page) == sorted(seeded.queued, reverse=True)
    # q searches the params and the last error.
    open_page(page, dashboards.plain + "/tasks?q=cat.txt", "tasks")
    assert shown_task_ids(page) == [seeded.failed]
    open_page(page, dashboards.plain + "/tasks?q=not+an+image", "tasks")
    assert shown_task_ids(page) == [seeded.failed]
    # since and until bound the creation time (UTC): every row was created within the last minutes.
    hour_ahead = (utcnow() + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    hour_ago = (utcnow() - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    open_page(page, f"{dashboards.plain}/tasks?status=queued&since={hour_ago}&until={hour_ahead}", "tasks")
    assert shown_task_ids(page) == sorted(seeded.queued, reverse=True)
    open_page(page, f"{dashboards.plain}/tasks?since={hour_ahead}", "tasks")
    assert shown_task_ids(page) == []


def test_tasks_pages_follow_one_another_to_the_last(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page
) -> None:
    from sa_taskqueue.integrations.dashboard.reads import PAGE_SIZE

    seeded = seed(engine, dashboard_queue, extra_queued=PAGE_SIZE + 10)
    open_page(page, dashboards.plain + "/tasks?queue=images", "tasks")
    seen: list[int] = []
    pages = 0
    while True:
        pages += 1
        rows = shown_task_ids(page)
        assert rows, f"page {pages} of the images queue is empty"
        seen += rows
        next_page = page.locator("a[data-next-page]")
        if next_page.count() == 0:
            break
        assert pages < 50, "the next-page links never end"
        with page.expect_navigation():
            next_page.click()
        expect(page.locator('main[data-page="tasks"]')).to_be_visible()
    assert pages >= 2
    assert seen == sorted([*seeded.queued, seeded.failed], reverse=True)


def test_a_missing_task_is_a_plain_not_found(
    engine: sa.Engine, dashboards: Dashboards, page: Page, problems: Problems
) -> None:
    problems.expected_statuses.add(404)
    response = page.goto(f"{dashboards.plain}/tasks/987654")
    assert response is not None
    assert response.status == 404


def test_workers_page_lists_a_live_worker(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page
) -> None:
    seed(engine, dashboard_queue)
    worker = Worker(dashboard_queue, queues=["emails"], poll_interval=0.1)
    thread = threading.Thread(target=worker.run, name="dashboard-test-worker", daemon=True)
    thread.start()
    workers = worker_table_of(tq.Task.__table__)
    try:

        def registered() -> bool:
            with engine.connect() as conn:
                return (
                    conn.execute(sa.select(workers.c.id).where(workers.c.id == worker.worker_id)).first()
                    is not None
                )

        # The worker writes its row as it starts.
        wait_until(registered, 30, "the worker's row in the live-worker table")
        open_page(page, dashboards.plain + "/workers", "workers")
        row = page.locator(f'tr[data-worker-id="{worker.worker_id}"]')
        expect(row).to_be_visible()
        expect(row).to_contain_text("emails")
        screenshot(page, "workers")
    finally:
        worker.stop()
        thread.join(30)
    assert not thread.is_alive()


# Actions: each button's effect is read back from the database --------------------


def click_action(page: Page, action: str, within: str = "main") -> None:
    """Click the button of ``action`` and wait for the redirect back with its flash message."""
    button = page.locator(f'{within} button[data-action="{action}"]')
    expect(button).to_have_count(1)
    with page.expect_navigation():
        button.click()
    expect(page.locator("[data-flash]")).to_be_visible()


def test_retry_queues_a_failed_task_again(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page
) -> None:
    seeded = seed(engine, dashboard_queue)
    open_page(page, f"{dashboards.plain}/tasks/{seeded.failed}", "task")
    click_action(page, "retry")
    assert statuses(engine)[seeded.failed] == "queued"
    assert page.url.startswith(dashboards.plain)


def test_cancel_stops_a_queued_task(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page
) -> None:
    seeded = seed(engine, dashboard_queue)
    target, other = seeded.queued
    open_page(page, f"{dashboards.plain}/tasks/{target}", "task")
    click_action(page, "cancel")
    rows = statuses(engine)
    assert rows[target] == "cancelled"
    assert rows[other] == "queued"


def test_delete_removes_the_row(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page
) -> None:
    seeded = seed(engine, dashboard_queue)
    before = statuses(engine)
    target = seeded.completed[0]
    open_page(page, f"{dashboards.plain}/tasks/{target}", "task")
    expect(page.locator('[data-field="result"]')).to_contain_text("sent_to")
    click_action(page, "delete")
    # The task's page is gone: the dashboard lands on the task list instead.
    expect(page.locator('main[data-page="tasks"]')).to_be_visible()
    expect(page.locator(f'tr[data-task-id="{target}"]')).to_have_count(0)
    after = statuses(engine)
    assert target not in after
    del before[target]
    assert after == before


def test_pause_and_resume_a_queue(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page
) -> None:
    seed(engine, dashboard_queue)
    assert paused_queues(dashboard_queue) == {"images"}
    open_page(page, dashboards.plain + "/", "overview")
    click_action(page, "pause", within='tr[data-queue="emails"]')
    assert paused_queues(dashboard_queue) == {"emails", "images"}
    expect(page.locator('tr[data-queue="emails"] [data-paused]')).to_have_attribute("data-paused", "true")
    click_action(page, "resume", within='tr[data-queue="images"]')
    assert paused_queues(dashboard_queue) == {"emails"}


def test_enqueue_now_adds_a_run_of_the_periodic_task(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page
) -> None:
    seed(engine, dashboard_queue)
    table = tq.Task.__table__
    runs = sa.select(table.c.id, table.c.status, table.c.queue).where(table.c.name == PERIODIC)
    with engine.connect() as conn:
        assert conn.execute(runs).all() == []
    open_page(page, dashboards.plain + "/schedules", "schedules")
    click_action(page, "enqueue-now", within=f'tr[data-schedule="{PERIODIC}"]')
    with engine.connect() as conn:
        [run] = conn.execute(runs).all()
    assert (run.status, run.queue) == (tq.TaskStatus.QUEUED, "reports")


# Access -----------------------------------------------------------------------


def test_a_token_protected_dashboard_refuses_until_given_the_token(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page, problems: Problems
) -> None:
    seeded = seed(engine, dashboard_queue)
    problems.expected_statuses.add(401)
    for path in ("/", f"/tasks/{seeded.failed}"):
        response = page.goto(dashboards.locked + path)
        assert response is not None
        assert response.status == 401, path
        expect(page.locator("main[data-page]")).to_have_count(0)
        expect(page.locator("body")).not_to_contain_text("/uploads/cat.txt")
    response = page.goto(dashboards.locked + "/?token=wrong-token")
    assert response is not None
    assert response.status == 401

    response = page.goto(dashboards.locked + f"/?token={TOKEN}")
    assert response is not None
    assert response.status == 200
    expect(page.locator('main[data-page="overview"]')).to_be_visible()
    # The token is taken out of the address once the session cookie holds it.
    assert TOKEN not in page.url
    assert page.url.startswith(dashboards.locked + "/")
    problems.expected_statuses.discard(401)

    # From there on the cookie lets every page in, and the mounted app's links stay under its mount.
    follow_nav(page, "tasks", dashboards.locked)
    open_page(page, f"{dashboards.locked}/tasks/{seeded.failed}", "task")
    click_action(page, "retry")
    assert statuses(engine)[seeded.failed] == "queued"
    assert page.url.startswith(dashboards.locked + "/")


def test_a_read_only_dashboard_shows_no_action(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page
) -> None:
    seeded = seed(engine, dashboard_queue)
    pages: list[tuple[str, str]] = [
        ("/", "overview"),
        ("/tasks", "tasks"),
        (f"/tasks/{seeded.failed}", "task"),
        (f"/tasks/{seeded.queued[0]}", "task"),
        ("/schedules", "schedules"),
    ]
    for path, name in pages:
        open_page(page, dashboards.read_only + path, name)
        expect(page.locator("button[data-action]")).to_have_count(0)
        expect(page.locator('form[method="post"]')).to_have_count(0)
    # The same pages with actions, to show the check above can fail.
    open_page(page, f"{dashboards.plain}/tasks/{seeded.failed}", "task")
    expect(page.locator('button[data-action="retry"]')).to_have_count(1)


# Batches ----------------------------------------------------------------------


def run_burst(queue: tq.TaskQueue) -> None:
    """A real worker, in this process, until nothing is due: it runs the members and counts them."""
    queue.run_worker(burst=True, poll_interval=0.05, concurrency=2)


def test_batches_page_lists_a_batch_and_its_members(
    engine: sa.Engine, dashboard_queue: tq.TaskQueue, dashboards: Dashboards, page: Page
) -> None:
    report = dashboard_queue.registered("thumbs.report")
    assert report is not None
    with Session(engine) as session:
        with dashboard_queue.batch(
            session, "welcome wave", on_complete=(report, {"to": "ops@example.com"})
        ) as finished:
            finished.enqueue_many("mail.send_welcome", [{"user_id": n} for n in range(4)])
        session.commit()
    run_burst(dashboard_queue)
    with Session(engine) as session:
        still_open = dashboard_queue.batch(session, "resizes")
        assert isinstance(still_open, tq.Batch)
        still_open.enqueue("images.resize", path="/uploads/dog.txt", width=10)
        still_open.enqueue("images.resize", path="/uploads/cow.txt", width=10)
        session.commit()

    open_page(page, dashboards.plain + "/", "overview")
    follow_nav(page, "batches", dashboards.plain)
    done_row = page.locator(f'tr[data-batch-id="{finished.id}"]')
    expect(done_row.locator('[data-field="name"]')).to_have_text("welcome wave")
    expect(done_row.locator('[data-field="status"]')).to_contain_text("finished")
    expect(done_row.locator('[data-field="outcome"]')).to_have_text("succeeded")
    expect(done_row.locator('[data-field="succeeded"]')).to_have_text("4")
    open_row = page.locator(f'tr[data-batch-id="{still_open.id}"]')
    expect(open_row.locator('[data-field="status"]')).to_have_text("open")
    expect(open_row.locator('[data-field="pending"]')).to_have_text("2")
    screenshot(page, "batches")

    with page.expect_navigation():
        page.locator("[data-show-unfinished]").click()
    expect(page.locator("tr[data-batch-id]")).to_have_count(1)

    with page.expect_navigation():
        page.locator(f'tr[data-batch-id="{still_open.id}"] [data-field="name"] a').click()
    expect(page.locator('main[data-page="batch"]')).to_be_visible()
    expect(page.locator('dd[data-field="total"]')).to_have_text("2")
    expect(page.locator('td[data-status="queued"]')).to_have_text("2")
    screenshot(page, "batch")

    with page.expect_navigation():
        page.locator("[data-members-link]").click()
    expect(page.locator('main[data-page="tasks"]')).to_be_visible()
    expect(page.locator("tr[data-task-id]")).to_have_count(2)
    assert re.search(rf"batch={still_open.id}\b", page.url)
    with Session(engine) as session:
        members = session.scalars(sa.select(tq.Task.id).where(tq.Task.batch_id == still_open.id)).all()
    assert shown_task_ids(page) == sorted(members, reverse=True)

    # The finished batch's page lists its callback, and the callback task ran with its counts.
    open_page(page, f"{dashboards.plain}/batches/{finished.id}", "batch")
    expect(page.locator('tr[data-callback="complete"]')).to_contain_text("ops@example.com")
    expect(page.locator('td[data-status="completed"]')).to_have_text("4")


def test_seeded_rows_cover_every_status(engine: sa.Engine, dashboard_queue: tq.TaskQueue) -> None:
    """The pages above are checked against a table with a task in every status."""
    seeded: Seeded = seed(engine, dashboard_queue)
    assert set(statuses(engine).values()) == {status.value for status in tq.TaskStatus}
    assert statuses(engine)[seeded.running] == "running"
