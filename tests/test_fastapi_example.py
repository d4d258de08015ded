"""The FastAPI example (examples/fastapi_app) through Starlette's TestClient, on the backend under test.

Entering the client runs the app's lifespan, and with it a worker in the
app's own event loop.  A request writes an order and its task in one
transaction, committed before the response; a refused one writes neither;
the lifespan's worker runs the task exactly once, and the order shows it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.async_drivers import async_url
from tests.backends import Backend
from tests.helpers import wait_until

# The examples' models keep plain integer primary keys, as an app's would; Oracle needs an Identity
# for those to number themselves, so the examples are not run there.
pytestmark = pytest.mark.backends("sqlite", "postgres", "mysql", "mariadb")

EXAMPLE = "examples.fastapi_app.app"


class Shop:
    """The imported example, and a plain engine of the test's own to look at its tables."""

    def __init__(self, module: ModuleType, sync_url: str) -> None:
        self.module = module
        self.engine = sa.create_engine(sync_url)

    def rows(self, model: type) -> list[object]:
        with Session(self.engine) as session:
            found = list(session.scalars(sa.select(model).order_by(model.id)))
            session.expunge_all()
            return found


@pytest.fixture
def shop(backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Shop]:
    """The example imported afresh with ``DATABASE_URL`` naming the backend, on empty tables."""
    sync_url = f"sqlite:///{tmp_path / 'shop.db'}" if backend.is_sqlite else backend.url
    monkeypatch.setenv("DATABASE_URL", async_url(sync_url))
    sys.modules.pop(EXAMPLE, None)
    found = Shop(importlib.import_module(EXAMPLE), sync_url)
    found.module.Base.metadata.drop_all(found.engine)
    yield found
    found.module.Base.metadata.drop_all(found.engine)
    found.engine.dispose()
    sys.modules.pop(EXAMPLE, None)


def test_an_order_and_its_task_commit_before_the_response_and_the_lifespan_worker_runs_it_once(
    shop: Shop,
) -> None:
    app = shop.module.app
    with TestClient(app) as client:
        response = client.post("/orders", json={"item": "tea", "quantity": 2})
        assert response.status_code == 201, response.text
        order_id = response.json()["id"]
        # Committed before the response: another connection sees both rows now.
        assert [order.id for order in shop.rows(shop.module.Order)] == [order_id]
        [job] = shop.rows(shop.module.Job)
        assert job.params == {"order_id": order_id}

        wait_until(
            lambda: client.get(f"/orders/{order_id}").json()["confirmed"],
            30,
            "the lifespan's worker to confirm the order",
        )
        shown = client.get(f"/orders/{order_id}").json()
        assert shown == {"id": order_id, "item": "tea", "quantity": 2, "confirmed": True, "mails": 1}

    # The lifespan has stopped the worker; the task ran once, and once only.
    [job] = shop.rows(shop.module.Job)
    assert (job.status, job.attempts) == (tq.TaskStatus.COMPLETED, 1)
    assert [mail.order_id for mail in shop.rows(shop.module.OutboxMail)] == [order_id]


def test_a_refused_order_leaves_neither_the_order_nor_its_task(shop: Shop) -> None:
    with TestClient(shop.module.app) as client:
        too_many = client.post("/orders", json={"item": "tea", "quantity": shop.module.MAX_QUANTITY + 1})
        assert too_many.status_code == 422
        assert too_many.json() == {"detail": f"at most {shop.module.MAX_QUANTITY} of one item per order"}
        assert client.post("/orders", json={"item": "tea", "quantity": 0}).status_code == 422

        assert shop.rows(shop.module.Order) == []
        assert shop.rows(shop.module.Job) == []

        # The next request commits as usual.
        assert client.post("/orders", json={"item": "tea", "quantity": 1}).status_code == 201
        assert len(shop.rows(shop.module.Order)) == 1
        assert len(shop.rows(shop.module.Job)) == 1
