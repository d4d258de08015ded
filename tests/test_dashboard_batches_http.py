"""The dashboard's batches pages over HTTP (Starlette's TestClient) on the live database.

The list shows each batch's own counts; a batch's page shows them, its
members by status as their rows stand (each a link to the task list
filtered to them) and its callbacks.
"""

from __future__ import annotations

import html
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.features.workflows import batches

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from sa_taskqueue.integrations.dashboard import create_app


@dataclass(frozen=True)
class Finished:
    batch_id: int | None
    status: tq.TaskStatus


@pytest.fixture
def queue(engine: sa.Engine) -> Iterator[tq.TaskQueue]:
    queue = tq.TaskQueue(engine)

    @queue.task(name="thumbs.make")
    def make(n: int) -> None: ...

    @queue.task(name="thumbs.report")
    def report(batch: dict[str, int], to: str) -> None: ...

    yield queue
    queue.close()


def end_members(engine: sa.Engine, ids: list[int], status: tq.TaskStatus, batch_id: int) -> None:
    """Members put in a final status with their batch's bookkeeping in one transaction, as a worker does."""
    table = tq.Task.__table__
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.id.in_(ids)).values(status=status, finished_at=now))
        batches.members_finished(conn, table, [Finished(batch_id, status) for _ in ids], now)


@dataclass
class SeededBatches:
    finished: int
    running: int
    members: list[int]


@pytest.fixture
def seeded(queue: tq.TaskQueue, engine: sa.Engine) -> SeededBatches:
    report = queue.registered("thumbs.report")
    assert report is not None
    with Session(engine) as session:
        with queue.batch(session, "all thumbs", on_complete=(report, {"to": "ops@example.com"})) as done:
            done.enqueue_many("thumbs.make", [{"n": n} for n in range(2)])
        running = queue.batch(session, "more thumbs <b>", on_failure=(report, {"to": "oncall@example.com"}))
        assert isinstance(running, tq.Batch)
        members = [running.enqueue("thumbs.make", n=n).id for n in range(5)]
        session.commit()
    end_members(engine, member_ids(engine, done.id), tq.TaskStatus.COMPLETED, done.id)
    end_members(engine, members[:2], tq.TaskStatus.COMPLETED, running.id)
    end_members(engine, members[2:3], tq.TaskStatus.FAILED, running.id)
    return SeededBatches(done.id, running.id, members)


def member_ids(engine: sa.Engine, batch_id: int) -> list[int]:
    table = tq.Task.__table__
    with engine.connect() as conn:
        return list(conn.scalars(sa.select(table.c.id).where(table.c.batch_id == batch_id)))


def field(page: str, row: str, name: str) -> str:
    found = re.search(rf'{row}.*?data-field="{name}"[^>]*>(.*?)</t[dh]>', page, re.S)
    assert found is not None, f"{name} in {row}"
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def test_the_batches_page_lists_each_batch_with_its_counts(
    queue: tq.TaskQueue, seeded: SeededBatches
) -> None:
    client = TestClient(create_app(queue))
    page = client.get("/batches")
    assert page.status_code == 200
    text = page.text
    assert 'data-nav="batches"' in text
    ids = [int(i) for i in re.findall(r'<tr data-batch-id="(\d+)"', text)]
    assert ids == [seeded.running, seeded.finished]
    running = f'data-batch-id="{seeded.running}"'
    assert field(text, running, "status") == "open"
    assert (field(text, running, "total"), field(text, running, "succeeded")) == ("5", "2")
    assert (field(text, running, "failed"), field(text, running, "pending")) == ("1", "2")
    finished = f'data-batch-id="{seeded.finished}"'
    assert field(text, finished, "status") == "finished succeeded"
    assert "more thumbs &lt;b&gt;" in text  # escaped, as every value is

    unfinished = client.get("/batches?unfinished=1").text
    assert re.findall(r'<tr data-batch-id="(\d+)"', unfinished) == [str(seeded.running)]


def test_a_batch_page_shows_its_counts_members_and_callbacks(
    queue: tq.TaskQueue, seeded: SeededBatches
) -> None:
    client = TestClient(create_app(queue))
    page = client.get(f"/batches/{seeded.running}")
    assert page.status_code == 200
    text = html.unescape(page.text)
    assert re.search(r'data-field="pending">2<', text)
    assert re.search(r'data-status="queued"><a href="/tasks\?batch=\d+&status=queued">2</a>', text)
    assert re.search(r'data-status="completed"><a [^>]*>2</a>', text)
    assert 'data-callback="failure"' in text and "oncall@example.com" in text
    assert "open: members may still join" in text

    # The members link lists exactly the batch's members.
    members = client.get(f"/tasks?batch={seeded.running}")
    assert members.status_code == 200
    shown = sorted(int(i) for i in re.findall(r'<tr data-task-id="(\d+)"', members.text))
    assert shown == sorted(seeded.members)
    assert "data-batch-filter" in members.text
    queued = client.get(f"/tasks?batch={seeded.running}&status=queued")
    assert sorted(int(i) for i in re.findall(r'<tr data-task-id="(\d+)"', queued.text)) == seeded.members[3:]

    # A member's page links back to its batch.
    task = client.get(f"/tasks/{seeded.members[0]}")
    assert f'href="/batches/{seeded.running}"' in task.text


def test_a_missing_batch_is_404_and_a_bad_id_400(queue: tq.TaskQueue, seeded: SeededBatches) -> None:
    client = TestClient(create_app(queue))
    assert client.get(f"/batches/{seeded.running + 1000}").status_code == 404
    assert client.get("/tasks?batch=nope").status_code == 400
    assert client.get("/batches?before=nope").status_code == 400


def test_the_batches_list_pages_by_id(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session:
        ids = []
        for n in range(53):
            b = queue.batch(session, f"b{n}")
            assert isinstance(b, tq.Batch)
            ids.append(b.id)
        session.commit()
    client = TestClient(create_app(queue))
    first = client.get("/batches").text
    shown = [int(i) for i in re.findall(r'<tr data-batch-id="(\d+)"', first)]
    assert shown == sorted(ids, reverse=True)[:50]
    older = re.search(r'href="([^"]+)" data-older', first)
    assert older is not None
    rest = client.get(html.unescape(older.group(1))).text
    assert [int(i) for i in re.findall(r'<tr data-batch-id="(\d+)"', rest)] == sorted(ids, reverse=True)[50:]
    assert "data-older" not in rest
