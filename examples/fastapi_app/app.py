"""A FastAPI shop on async SQLAlchemy whose orders are confirmed by a worker in the app's own event loop.

Run it from the repository's root (``pip install -e '.[fastapi]'`` and uvicorn first)::

    export DATABASE_URL=sqlite+aiosqlite:///shop.db     # or postgresql+psycopg://..., mariadb+aiomysql://...
    uvicorn examples.fastapi_app.app:app

    curl -X POST localhost:8000/orders -H 'Content-Type: application/json' -d '{"item": "tea", "quantity": 2}'
    curl localhost:8000/orders/1

The app's lifespan creates the tables and runs a worker as a task of the
server's event loop, stopped gracefully at shutdown; no second process is
needed (``sa-taskqueue worker examples.fastapi_app.app:queue`` would still
run more workers beside it).  ``POST /orders`` writes the order and its
``send_confirmation`` task in one transaction that commits before the
response is sent: both exist, or (an order over ``MAX_QUANTITY``, an error)
neither does.  The worker then runs the task once; it writes the
confirmation mail to the outbox and marks the order confirmed.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import ForeignKey, String, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import sa_taskqueue as tq
from sa_taskqueue.integrations.fastapi import running_worker, session_dependency

#: The most of one item one order may hold; a larger order is refused after its rows were written.
MAX_QUANTITY = 10


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "shop_order"

    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(100))
    quantity: Mapped[int]
    confirmed_at: Mapped[datetime | None]


class OutboxMail(Base):
    """A mail the shop has sent: one row per sending, so a task run twice would show as two."""

    __tablename__ = "shop_outbox_mail"

    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("shop_order.id"), index=True)
    body: Mapped[str] = mapped_column(String(200))


class Job(tq.TaskMixin, Base):
    """The shop's task table, on the app's own declarative base."""

    __tablename__ = "shop_job"


engine = create_async_engine(os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///shop.db"))
Session = async_sessionmaker(engine, expire_on_commit=False)
queue = tq.TaskQueue(engine, model=Job)
#: A session per request, committed before the response is sent (rolled back if the endpoint raises).
DbSession = Annotated[AsyncSession, session_dependency(Session)]


@queue.task(max_attempts=5)
async def send_confirmation(order_id: int) -> None:
    """Mail the customer and mark the order confirmed, in one transaction of the task's own."""
    async with Session() as session, session.begin():
        order = await session.get_one(Order, order_id)
        session.add(OutboxMail(order_id=order.id, body=f"{order.quantity} x {order.item}: confirmed"))
        order.confirmed_at = datetime.now(UTC)


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    async with engine.begin() as conn:  # an app with alembic migrates instead
        await conn.run_sync(Base.metadata.create_all)
    async with running_worker(queue, concurrency=4):
        yield
    await engine.dispose()


app = FastAPI(lifespan=lifespan)


class NewOrder(BaseModel):
    item: str = Field(min_length=1, max_length=100)
    quantity: int = Field(ge=1)


@app.post("/orders", status_code=201)
async def create_order(new: NewOrder, session: DbSession) -> dict[str, int]:
    order = Order(item=new.item, quantity=new.quantity)
    session.add(order)
    await session.flush()  # the order's id, for the task's params
    await send_confirmation.enqueue(session, order_id=order.id)
    if new.quantity > MAX_QUANTITY:
        # Refused after both rows were written: the dependency rolls the transaction back, task included.
        raise HTTPException(422, f"at most {MAX_QUANTITY} of one item per order")
    return {"id": order.id}


@app.get("/orders/{order_id}")
async def show_order(order_id: int, session: DbSession) -> dict[str, object]:
    order = await session.get(Order, order_id)
    if order is None:
        raise HTTPException(404, "no such order")
    mails = await session.scalar(select(func.count()).where(OutboxMail.order_id == order.id))
    return {
        "id": order.id,
        "item": order.item,
        "quantity": order.quantity,
        "confirmed": order.confirmed_at is not None,
        "mails": mails,
    }
