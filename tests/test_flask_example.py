"""The Flask example (examples/flask_app) through Flask's own test client, on the backend under test.

A request writes an order and its task in one transaction; a refused one
writes neither; a worker (in this process, through ``flask sa-taskqueue
worker``, or as the ``sa-taskqueue worker`` command the example's docstring
gives) runs the task exactly once, and the order shows it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import sqlalchemy as sa

import sa_taskqueue as tq
from tests.backends import Backend
from tests.helpers import run_cli

# The examples' models keep plain integer primary keys, as an app's would; Oracle needs an Identity
# for those to number themselves, so the examples are not run there.
pytestmark = pytest.mark.backends("sqlite", "postgres", "mysql", "mariadb")

EXAMPLE = "examples.flask_app.app"


@pytest.fixture
def shop(backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The example app, imported afresh with ``DATABASE_URL`` naming the backend, on empty tables."""
    url = f"sqlite:///{tmp_path / 'shop.db'}" if backend.is_sqlite else backend.url
    monkeypatch.setenv("DATABASE_URL", url)
    sys.modules.pop(EXAMPLE, None)
    module = importlib.import_module(EXAMPLE)
    with module.app.app_context():
        module.db.drop_all()
        module.db.create_all()
    yield module
    module.queue.close()
    with module.app.app_context():
        module.db.drop_all()
        module.db.engine.dispose()
    sys.modules.pop(EXAMPLE, None)


def rows(shop: ModuleType, model: type) -> list[object]:
    with shop.app.app_context():
        found = list(shop.db.session.scalars(sa.select(model).order_by(model.id)))
        shop.db.session.expunge_all()
        return found


def order_and_job(shop: ModuleType) -> int:
    response = shop.app.test_client().post("/orders", json={"item": "tea", "quantity": 2})
    assert response.status_code == 201, response.get_data(as_text=True)
    order_id: int = response.json["id"]
    return order_id


def test_an_order_and_its_task_commit_together_and_the_task_runs_once(shop: ModuleType) -> None:
    order_id = order_and_job(shop)

    [order] = rows(shop, shop.Order)
    [job] = rows(shop, shop.Job)
    assert order.id == order_id
    assert order.confirmed_at is None
    assert job.name == shop.send_confirmation.name
    assert job.params == {"order_id": order_id}
    assert job.status is tq.TaskStatus.QUEUED

    shop.queue.run_worker(burst=True)

    [job] = rows(shop, shop.Job)
    assert job.status is tq.TaskStatus.COMPLETED
    assert job.attempts == 1
    assert [mail.order_id for mail in rows(shop, shop.OutboxMail)] == [order_id]
    shown = shop.app.test_client().get(f"/orders/{order_id}").json
    assert shown == {"id": order_id, "item": "tea", "quantity": 2, "confirmed": True, "mails": 1}

    shop.queue.run_worker(burst=True)  # nothing is left to run
    assert len(rows(shop, shop.OutboxMail)) == 1


def test_a_refused_order_leaves_neither_the_order_nor_its_task(shop: ModuleType) -> None:
    client = shop.app.test_client()
    too_many = client.post("/orders", json={"item": "tea", "quantity": shop.MAX_QUANTITY + 1})
    assert too_many.status_code == 422
    bad = client.post("/orders", json={"item": "tea", "quantity": "two"})
    assert bad.status_code == 400

    assert rows(shop, shop.Order) == []
    assert rows(shop, shop.Job) == []

    # The next request starts from a clean session and commits as usual.
    order_id = order_and_job(shop)
    assert [order.id for order in rows(shop, shop.Order)] == [order_id]
    assert len(rows(shop, shop.Job)) == 1


def test_a_task_called_directly_in_a_request_uses_the_request_s_session(shop: ModuleType) -> None:
    order_id = order_and_job(shop)
    with shop.app.test_request_context():
        shop.send_confirmation(order_id)  # commits the request's db.session itself
        assert shop.db.session.get(shop.Order, order_id).confirmed_at is not None
    assert len(rows(shop, shop.OutboxMail)) == 1


def test_flask_sa_taskqueue_worker_runs_the_app_s_tasks(shop: ModuleType) -> None:
    order_id = order_and_job(shop)

    command = ["sa-taskqueue", "worker", "--burst", "--concurrency", "2"]
    result = shop.app.test_cli_runner().invoke(args=command)

    assert result.exit_code == 0, result.output
    assert [mail.order_id for mail in rows(shop, shop.OutboxMail)] == [order_id]
    [job] = rows(shop, shop.Job)
    assert (job.status, job.attempts) == (tq.TaskStatus.COMPLETED, 1)


@pytest.mark.slow
def test_the_sa_taskqueue_command_runs_the_example_s_queue(shop: ModuleType) -> None:
    order_id = order_and_job(shop)
    url = shop.app.config["SQLALCHEMY_DATABASE_URI"]

    done = run_cli("worker", f"{EXAMPLE}:queue", "--burst", url=url, DATABASE_URL=url)

    assert done.returncode == 0, done.stderr
    assert [mail.order_id for mail in rows(shop, shop.OutboxMail)] == [order_id]
    [job] = rows(shop, shop.Job)
    assert (job.status, job.attempts) == (tq.TaskStatus.COMPLETED, 1)
