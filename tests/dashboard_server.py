"""The dashboard served for real, the browser that drives it, and a task table with a task in every status.

`serve` runs an ASGI application with uvicorn on a free loopback port in a
thread of the test process, against the test's live database.  `launch_chromium`
starts Debian's Chromium (``/usr/bin/chromium``, installed by .ci/install-chromium)
through Playwright, which never downloads a browser of its own here.  `seed`
fills the task table through the queue's own API and a real worker, so every
row the pages show is one the queue wrote.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.helpers import wait_until

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Playwright

CHROMIUM = Path("/usr/bin/chromium")

#: What Chromium needs to run headless as root in a container with no GPU, and
#: to reach nothing but the dashboard: no sandbox (root), no QUIC, no first-run
#: dialogs, no update, sync or other background traffic.  Playwright adds
#: --headless and a fresh user data directory of its own.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

#: Where the tests save a screenshot of each page they render, when set.
SCREENSHOTS_VARIABLE = "SA_TASKQUEUE_SCREENSHOTS"

#: The task names and queues the seeded table uses; the periodic task's name.
PERIODIC = "reports.nightly_summary"


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (pip install -e '.[test]')"
    if not CHROMIUM.exists():
        return f"Debian's Chromium is missing at {CHROMIUM} (as root: sh .ci/install-chromium)"
    return None


def require_browser() -> None:
    """Skip on a developer's machine without the browser; in CI (``CI`` set) fail instead, loudly."""
    missing = browser_missing()
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI runs the dashboard's browser tests, but {missing}", pytrace=False)
    pytest.skip(f"dashboard browser tests: {missing}")


@contextlib.contextmanager
def launch_chromium() -> Iterator[Browser]:
    """Debian's Chromium, headless, through Playwright: one per test module."""
    from playwright.sync_api import sync_playwright

    playwright: Playwright
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS, timeout=30_000
        )
        try:
            yield browser
        finally:
            browser.close()


class Served:
    """An ASGI application served by uvicorn on ``base_url`` from a thread of this process."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        # Bound here, before the thread starts, so the port is ours and the URL known at once.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        port = self._socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="dashboard-server", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the dashboard's server stopped while starting (its log says why)")
            if time.monotonic() > deadline:
                raise RuntimeError("the dashboard's server did not start within 30 s")
            self._thread.join(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(15)
        self._socket.close()


@contextlib.contextmanager
def serve(app: Any) -> Iterator[Served]:
    """Serve ``app`` until the block ends."""
    served = Served(app)
    served.start()
    try:
        yield served
    finally:
        served.stop()


def make_dashboard_queue(engine: sa.Engine) -> tq.TaskQueue:
    """A queue with the tasks the seeded table holds and one periodic task, as an application would have."""
    queue = tq.TaskQueue(engine)

    @queue.task(name="mail.send_welcome", queue="emails")
    def send_welcome(user_id: int) -> dict[str, Any]:
        return {"sent_to": user_id}

    @queue.task(name="images.resize", queue="images", max_attempts=1)
    def resize(path: str, width: int) -> None:
        raise ValueError(f"cannot resize {path}: not an image")

    @queue.task(name="thumbs.report", queue="emails")
    def report(batch: dict[str, Any], to: str) -> None:
        """A batch's callback (the batches page's tests)."""
        return

    @queue.periodic(every=timedelta(hours=24), name=PERIODIC, queue="reports")
    def nightly_summary() -> None:
        return None

    return queue


@dataclass
class Seeded:
    """The ids of the rows `seed` wrote, by what became of them."""

    queued: list[int]
    running: int
    completed: list[int]
    failed: int
    cancelled: int
    worker_id: str
    waiting: int = 0


def enqueue(engine: sa.Engine, queue: tq.TaskQueue, name: str, params: dict[str, Any], **options: Any) -> int:
    with Session(engine) as session:
        task = queue.enqueue(session, name, params, **options)
        session.commit()
        return task.id


def seed(engine: sa.Engine, queue: tq.TaskQueue, *, extra_queued: int = 0) -> Seeded:
    """A task in every status, written by the queue itself (but the waiting one); queue "images" left paused.

    A real worker in burst mode runs two welcome mails to completion and one
    resize to its last failure (with the traceback the worker stores); a claim
    left open keeps one task running, and another waits for it; one is cancelled; the rest stay queued,
    ``extra_queued`` more of them for the pages that paginate.
    """
    completed = [enqueue(engine, queue, "mail.send_welcome", {"user_id": n}) for n in (1, 2)]
    failed = enqueue(engine, queue, "images.resize", {"path": "/uploads/cat.txt", "width": 640})

    def ran() -> bool:
        # A burst worker returns as soon as a claim finds nothing due, which a
        # task enqueued a moment ago may not be yet on every database's clock.
        queue.run_worker(burst=True, queues=["emails", "images"], poll_interval=0.05)
        rows = statuses(engine)
        return [rows[id] for id in [*completed, failed]] == ["completed", "completed", "failed"]

    wait_until(ran, 30, "the seeded tasks run by a burst worker", every=0.01)

    running = enqueue(engine, queue, "mail.send_welcome", {"user_id": 3})
    worker_id = "web-1:4242:seeded"
    claims: list[list[int]] = []

    def claimed() -> bool:
        claims.append([task.id for task in queue.claim(queues=["emails"], worker_id=worker_id)])
        return bool(claims[-1])

    wait_until(claimed, 30, "the claim of the seeded running task", every=0.01)
    if claims[-1] != [running]:
        raise AssertionError(f"the seed's claim took {claims[-1]}, not task {running}")

    with Session(engine) as session, session.begin():
        # Waits for the running task, which never ends here.
        digest = tq.Task(name="mail.send_digest", queue="emails", params={}, depends_on=[running])
        session.add(digest)
        session.flush()
        waiting = digest.id
    cancelled = enqueue(engine, queue, "mail.send_welcome", {"user_id": 4})
    if not queue.cancel(cancelled):
        raise AssertionError(f"the seed could not cancel task {cancelled}")
    queued = [
        enqueue(engine, queue, "images.resize", {"path": f"/uploads/photo-{n}.jpg", "width": 320}, priority=n)
        for n in range(2)
    ]
    if extra_queued:
        with Session(engine) as session:
            params = [{"path": f"/uploads/scan-{n}.png", "width": 1024} for n in range(extra_queued)]
            queue.enqueue_many(session, "images.resize", params)
            session.commit()
        queued = [id for id, status in statuses(engine).items() if status == "queued"]
    queue.pause("images")
    return Seeded(queued, running, completed, failed, cancelled, worker_id, waiting)


def statuses(engine: sa.Engine) -> dict[int, str]:
    """Every task's status, by id, as the database has it."""
    table = tq.Task.__table__
    with engine.connect() as conn:
        return {row.id: str(row.status.value) for row in conn.execute(sa.select(table.c.id, table.c.status))}
