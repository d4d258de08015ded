"""No password of the queue's own database is stored in a task's ``last_error``.

A task that cannot reach a service often says so with the URL it used, and
the URL it used is often the application's database URL, password and all.
The queue knows that URL (its engine's), so whatever way a failure reaches
the table (a task raising in a thread or in a child process, `TaskQueue.fail`
or ``fail_many`` given a text), the stored error shows ``***`` where any of
its secrets was: as is, percent-encoded in a rendered URL, or bare.

On every backend the secret rides in a query parameter the driver accepts
and does not use; on PostgreSQL, whose suite server trusts local
connections and so ignores a password, it is the password too.  SQLite has
no login, and the suite's MariaDB root has no password and would refuse one,
so there the query parameter is the secret tested.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.error_text import MAX_ERROR_LENGTH, bounded_text
from sa_taskqueue.core.redaction import Redactor, redact_text
from tests.app import make_engine
from tests.backends import Backend
from tests.helpers import task_row
from tests.test_cli_redaction import IGNORED_SECRET

# The secret SQLite's URL carries in its query is one pysqlite ignores, and says so.
pytestmark = pytest.mark.filterwarnings("ignore:Query string argument.*not accepted by the pysqlite driver")

SECRET = "s3cr@t/Stored-Pw9"


#: Backends whose suite login takes a password it ignores: SQLite has no login, and the suite's
#: MariaDB/MySQL root has no password and refuses a login with one.
PASSWORD_IGNORED = ("postgres", "postgres18")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Where the secret rides: in the userinfo only where the login ignores a password, else the query."""
    if "where" in metafunc.fixturenames:
        backend = metafunc.config.getoption("--backend")
        metafunc.parametrize("where", ["userinfo", "query"] if backend in PASSWORD_IGNORED else ["query"])


def secret_url(backend: Backend, where: str) -> sa.URL:
    """The backend's URL with `SECRET` in its userinfo or in a query parameter."""
    url = sa.make_url(backend.url)
    if where == "query":
        return url.update_query_dict({IGNORED_SECRET[backend.name]: SECRET})
    return url.set(password=SECRET)


@pytest.fixture
def secret_engine(where: str, backend: Backend, engine: sa.Engine) -> Iterator[sa.Engine]:
    """An engine on the suite's database whose URL holds `SECRET`."""
    secret = make_engine(secret_url(backend, where).render_as_string(hide_password=False))
    yield secret
    secret.dispose()


@pytest.fixture
def secret_queue(secret_engine: sa.Engine, strategy_name: str) -> Iterator[tq.TaskQueue]:
    queue = tq.TaskQueue(secret_engine, strategy=strategy_name, lease=timedelta(minutes=5))

    @queue.task(name="reach")
    def reach() -> None:
        shown = secret_engine.url.render_as_string(hide_password=False)
        raise RuntimeError(f"could not reach {shown}; the login with {SECRET} was refused")

    yield queue
    queue.close()


def assert_no_secret(text: str | None) -> None:
    assert text is not None
    for form in (SECRET, quote(SECRET, safe=""), "s3cr@t", "Stored-Pw9"):
        assert form not in text, f"{form!r} was stored:\n{text}"
    assert "***" in text, text


def enqueue(queue: tq.TaskQueue, engine: sa.Engine, name: str, max_attempts: int = 1) -> int:
    with Session(engine) as session:
        task_id = queue.enqueue(session, name, max_attempts=max_attempts).id
        session.commit()
    return task_id


def test_the_worker_logs_the_failure_without_the_secret(
    secret_queue: tq.TaskQueue, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    enqueue(secret_queue, engine, "reach")
    with caplog.at_level(logging.WARNING, logger="sa_taskqueue"):
        worker = secret_queue.run_worker(burst=True, poll_interval=0.05)
    assert worker.failed == 1
    [line] = [record.getMessage() for record in caplog.records if "failed after" in record.getMessage()]
    assert "could not reach" in line
    assert_no_secret(line)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_task_quoting_the_engine_url_stores_its_error_without_the_secret(
    secret_queue: tq.TaskQueue, engine: sa.Engine, isolation: str
) -> None:
    task_id = enqueue(secret_queue, engine, "reach")
    worker = secret_queue.run_worker(burst=True, poll_interval=0.05, isolation=isolation)
    assert worker.failed == 1
    row = task_row(engine, task_id)
    assert row.status == tq.TaskStatus.FAILED
    assert_no_secret(row.last_error)
    assert row.last_error is not None
    assert "could not reach" in row.last_error, "the rest of the message is kept"
    assert "the login with *** was refused" in row.last_error, row.last_error


def test_fail_and_fail_many_store_a_text_error_without_the_secret(
    secret_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    ids = [enqueue(secret_queue, engine, "reach") for _ in range(3)]
    claimed = secret_queue.claim(limit=3)
    assert sorted(task.id for task in claimed) == sorted(ids)
    first, *others = claimed
    url = secret_queue.engine.url.render_as_string(hide_password=False)
    assert secret_queue.fail(first, f"gave up on {url}", retry=False)
    written = secret_queue.fail_many(others, [f"token {SECRET} expired" for _ in others], retry=False)
    assert written == {task.id for task in others}
    for task_id in ids:
        assert_no_secret(task_row(engine, task_id).last_error)


def test_a_secret_straddling_the_cut_of_a_huge_error_is_not_stored_in_halves(
    secret_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    """The text is cut in the middle; a secret hidden only after the cut would leave its two halves."""
    task_id = enqueue(secret_queue, engine, "reach")
    [claimed] = secret_queue.claim()
    total = 3 * MAX_ERROR_LENGTH
    # Where a text of this length is cut: the head kept ends at ``head``, the tail kept starts at ``tail``.
    probe = bounded_text("x" * total)
    head = probe.index("\n... [")
    tail = total - (len(probe) - probe.index("] ...\n") - len("] ...\n"))
    text = "h" * (head - 8) + SECRET + "m" * (tail - head - 17) + SECRET + "t" * (total - tail - 9)
    assert len(text) == total
    assert text[head - 8 : head] == "s3cr@t/S" and text[tail : tail + 9] == "tored-Pw9"
    assert secret_queue.fail(claimed, text, retry=False)
    stored = task_row(engine, task_id).last_error
    assert stored is not None
    assert len(stored) <= MAX_ERROR_LENGTH
    assert "characters cut" in stored
    for part in ("s3cr", "Pw9"):
        assert part not in stored, f"{part!r} of the secret was stored"


@pytest.mark.parametrize(
    "text",
    ["a" * MAX_ERROR_LENGTH, "a://b:" * (MAX_ERROR_LENGTH // 6), "k=" * (MAX_ERROR_LENGTH // 2)],
    ids=["one long word", "many URL starts", "many keys"],
)
def test_scrubbing_the_longest_error_stored_takes_milliseconds(text: str) -> None:
    """Every failure is scrubbed before it is written: a pattern slow on some text would stall a worker."""
    started = time.perf_counter()
    redact_text(text, {SECRET})
    assert time.perf_counter() - started < 1.0


@pytest.mark.backends("sqlite")  # about the scrubbing of a value, not a database
def test_keys_that_scrub_alike_keep_each_its_value() -> None:
    redactor = Redactor(f"postgresql://app:{SECRET}@db/app?token=Other-Secret-7")
    shown = redactor.value({SECRET: 1, "Other-Secret-7": 2, "kept": [SECRET]})
    assert shown == {"***": 1, "*** (2)": 2, "kept": ["***"]}
