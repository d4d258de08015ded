"""A Flask shop whose orders are confirmed by a background task, queued in the order's own transaction.

Run it from the repository's root (``pip install -e '.[flask]'`` first)::

    export DATABASE_URL=sqlite:///shop.db            # or postgresql+psycopg://..., mariadb+pymysql://...
    flask --app examples.flask_app.app create-tables
    flask --app examples.flask_app.app run
    flask --app examples.flask_app.app sa-taskqueue worker --concurrency 4   # in a second shell
    # or: sa-taskqueue worker examples.flask_app.app:queue --concurrency 4

    curl -X POST localhost:5000/orders -H 'Content-Type: application/json' -d '{"item": "tea", "quantity": 2}'
    curl localhost:5000/orders/1

``POST /orders`` writes the order and its ``send_confirmation`` task in one
transaction: both commit, or (an order over ``MAX_QUANTITY``, an error) neither
does.  The worker then runs the task once, which writes the confirmation mail
to the outbox table and marks the order confirmed.

The task table is the app's own (``Job``, `sa_taskqueue.TaskMixin` on
``db.Model``), so ``db.create_all()`` or the app's own alembic autogenerate
creates it with the rest.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

from flask import Flask, abort, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import ForeignKey, String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import sa_taskqueue as tq
from sa_taskqueue.integrations.flask import TaskQueueExtension

#: The most of one item one order may hold; a larger order is refused after its rows were written.
MAX_QUANTITY = 10


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "shop_order"

    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(100))
    quantity: Mapped[int]
    confirmed_at: Mapped[datetime | None]


class OutboxMail(db.Model):  # type: ignore[name-defined,misc]
    """A mail the shop has sent: one row per sending, so a task run twice would show as two."""

    __tablename__ = "shop_outbox_mail"

    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("shop_order.id"), index=True)
    body: Mapped[str] = mapped_column(String(200))


class Job(tq.TaskMixin, db.Model):  # type: ignore[name-defined,misc]
    """The shop's task table, mapped on the app's own model base."""

    __tablename__ = "shop_job"


app = Flask(__name__)
app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get("DATABASE_URL", "sqlite:///shop.db")
db.init_app(app)
tasks = TaskQueueExtension(app, db, model=Job)
#: The queue, for ``sa-taskqueue worker examples.flask_app.app:queue``.
queue = tasks.queue


@tasks.task(max_attempts=5)
def send_confirmation(order_id: int) -> None:
    """Mail the customer and mark the order confirmed, in one transaction of the task's own."""
    order = db.session.get_one(Order, order_id)
    db.session.add(OutboxMail(order_id=order.id, body=f"{order.quantity} x {order.item}: confirmed"))
    order.confirmed_at = datetime.now(UTC)
    db.session.commit()


@app.post("/orders")
def create_order() -> tuple[dict[str, object], int]:
    payload = request.get_json(silent=True) or {}
    item, quantity = payload.get("item"), payload.get("quantity")
    if not isinstance(item, str) or not item or not isinstance(quantity, int) or quantity < 1:
        abort(400, "give an item (a string) and a quantity (a positive integer)")
    order = Order(item=item, quantity=quantity)
    db.session.add(order)
    db.session.flush()  # the order's id, for the task's params
    send_confirmation.enqueue(db.session, order_id=order.id)
    if quantity > MAX_QUANTITY:
        # Refused after both rows were written: without a commit, Flask-SQLAlchemy
        # rolls the request's transaction back when the request ends, task included.
        abort(422, f"at most {MAX_QUANTITY} of one item per order")
    db.session.commit()
    return {"id": order.id}, 201


@app.get("/orders/<int:order_id>")
def show_order(order_id: int) -> dict[str, object]:
    order = db.get_or_404(Order, order_id)
    mails = db.session.scalar(select(func.count()).where(OutboxMail.order_id == order.id))
    return {
        "id": order.id,
        "item": order.item,
        "quantity": order.quantity,
        "confirmed": order.confirmed_at is not None,
        "mails": mails,
    }


@app.cli.command("create-tables")
def create_tables() -> None:
    """Create the shop's tables, its task table included (an app with alembic migrates instead)."""
    db.create_all()
