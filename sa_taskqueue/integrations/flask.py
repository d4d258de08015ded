"""Flask and Flask-SQLAlchemy: a queue on the app's engine, tasks that run in the app's context.

Without it, a Flask app builds its queue inside ``with app.app_context():``
(Flask-SQLAlchemy makes ``db.engine`` there and nowhere else), and every task
that touches ``db.session`` or ``current_app`` fails in the worker with
"Working outside of application context": worker threads have none.  So::

    db = SQLAlchemy(model_class=Base)
    app = Flask(__name__)
    db.init_app(app)
    tasks = TaskQueueExtension(app, db, model=Job)   # Job: tq.TaskMixin on db.Model

    @tasks.task(max_attempts=5)
    def confirm_order(order_id: int) -> None:
        db.session.get(Order, order_id).confirmed = True   # runs inside app.app_context()
        db.session.commit()

In a view, ``confirm_order.enqueue(db.session, order_id=order.id)`` adds the
task to the request's transaction, which commits with ``db.session.commit()``
or rolls back when the request ends without one.  Workers run as
``flask --app APP sa-taskqueue worker`` or ``sa-taskqueue worker APP_MODULE:queue``.
Needs the ``flask`` extra (``pip install 'sa_taskqueue[flask]'``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

import click
from flask import Flask, current_app, has_app_context
from flask.cli import with_appcontext

from sa_taskqueue.cli.main import configure_logging, parse_queues, worker_options
from sa_taskqueue.core.model import Task, TaskMixin
from sa_taskqueue.core.registered import RegisteredTask
from sa_taskqueue.queue import TaskQueue

if TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

#: Where the extension keeps itself in ``app.extensions``.
EXTENSION_NAME = "sa_taskqueue"


class TaskQueueExtension:
    """One `TaskQueue` on a Flask app's Flask-SQLAlchemy engine, and a ``flask sa-taskqueue`` command.

    ``TaskQueueExtension(app, db, model=Job, **queue_options)``, or create it
    with ``db`` and the options and call ``init_app(app)`` in an app factory.
    ``queue_options`` are `TaskQueue`'s (``strategy``, ``lease``, ...).  One
    extension serves one app: its queue is bound to that app's engine.
    """

    def __init__(
        self,
        app: Flask | None = None,
        db: SQLAlchemy | None = None,
        *,
        model: type[TaskMixin] = Task,
        **queue_options: Any,
    ) -> None:
        self.db = db
        self.model = model
        self.queue_options = queue_options
        self._app: Flask | None = None
        self._queue: TaskQueue | None = None
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Create the queue on ``db.engine`` of ``app`` and add the ``sa-taskqueue`` command group."""
        if self._app is not None:
            raise RuntimeError(
                f"this TaskQueueExtension already serves the app {self._app.name!r}; "
                "create one extension per app"
            )
        if self.db is None:
            raise TypeError("TaskQueueExtension needs the app's flask_sqlalchemy.SQLAlchemy object as db")
        if EXTENSION_NAME in app.extensions:
            raise RuntimeError(f"the app {app.name!r} already has a TaskQueueExtension")
        with app.app_context():
            # Flask-SQLAlchemy creates its engines per app, reachable only in the app's context.
            engine = self.db.engine
        self._queue = TaskQueue(engine, model=self.model, **self.queue_options)
        self._app = app
        app.extensions[EXTENSION_NAME] = self
        app.cli.add_command(_command_group())

    @property
    def app(self) -> Flask:
        """The app this extension was initialised with."""
        if self._app is None:
            raise RuntimeError("this TaskQueueExtension has no app yet: call init_app(app) first")
        return self._app

    @property
    def queue(self) -> TaskQueue:
        """The queue, on the app's engine: enqueue, run workers and inspect tasks through it."""
        if self._queue is None:
            raise RuntimeError("this TaskQueueExtension has no app yet: call init_app(app) first")
        return self._queue

    @overload
    def task(self, func: Callable[P, R], /) -> RegisteredTask[P, R]: ...

    @overload
    def task(
        self, func: None = None, /, **options: Any
    ) -> Callable[[Callable[P, R]], RegisteredTask[P, R]]: ...

    def task(
        self, func: Callable[P, R] | None = None, /, **options: Any
    ) -> RegisteredTask[P, R] | Callable[[Callable[P, R]], RegisteredTask[P, R]]:
        """Register ``func`` (``@tasks.task`` or ``@tasks.task(**options)``) to run in the app's context.

        ``options`` are `TaskQueue.task`'s (``name``, ``queue``, ``max_attempts``,
        ``timeout``, ...).  A run inside a context of this app already (a direct
        call from a view) uses that one, and so the request's ``db.session``.
        """
        queue = self.queue  # registering before init_app is an error now, not at the first run

        def register(func: Callable[P, R]) -> RegisteredTask[P, R]:
            return queue.task(**options)(self._in_app_context(func))

        return register if func is None else register(func)

    def _in_app_context(self, func: Callable[P, R]) -> Callable[P, R]:
        app = self.app
        if inspect.iscoroutinefunction(func):
            return self._in_app_context_async(func)

        # functools.wraps keeps the name the task registers under and, through
        # __wrapped__, the signature enqueue checks params against.
        @functools.wraps(func)
        def in_app_context(*args: P.args, **kwargs: P.kwargs) -> R:
            if has_app_context() and current_app._get_current_object() is app:  # type: ignore[attr-defined]
                return func(*args, **kwargs)
            # Popping the context ends Flask-SQLAlchemy's session for this run.
            with app.app_context():
                return func(*args, **kwargs)

        return in_app_context

    def _in_app_context_async(self, func: Callable[P, Awaitable[T]]) -> Callable[P, R]:
        """The same for an ``async def`` task, which must stay a coroutine function to be run as one."""
        app = self.app

        @functools.wraps(func)
        async def in_app_context(*args: P.args, **kwargs: P.kwargs) -> T:
            if has_app_context() and current_app._get_current_object() is app:  # type: ignore[attr-defined]
                return await func(*args, **kwargs)
            with app.app_context():  # Flask's context is a contextvar: it follows the coroutine
                return await func(*args, **kwargs)

        return in_app_context  # type: ignore[return-value]


def extension_of(app: Flask) -> TaskQueueExtension:
    """The `TaskQueueExtension` initialised on ``app``."""
    found = app.extensions.get(EXTENSION_NAME)
    if not isinstance(found, TaskQueueExtension):
        raise RuntimeError(f"the app {app.name!r} has no TaskQueueExtension: call init_app(app) first")
    return found


def _command_group() -> click.Group:
    """``flask sa-taskqueue worker``: the app's own worker, with no MODULE:QUEUE_OBJECT to name."""

    @click.group("sa-taskqueue", help="Run the app's task queue workers.")
    def group() -> None:
        pass

    @group.command("worker")
    @worker_options
    @with_appcontext
    def worker(
        concurrency: int,
        queues: str | None,
        isolation: str,
        burst: bool,
        poll_interval: float,
        shutdown_timeout: float,
        cancel_grace: float,
        completion_delay: float,
        no_listen: bool,
        no_self_test: bool,
        log_format: str,
        log_level: str,
    ) -> None:
        """Run a worker for the app's queue until SIGTERM (or, with --burst, until nothing is due)."""
        configure_logging(log_format, log_level)
        queue = extension_of(current_app._get_current_object()).queue  # type: ignore[attr-defined]
        ran = queue.run_worker(
            concurrency=concurrency,
            queues=parse_queues(queues),
            burst=burst,
            poll_interval=poll_interval,
            isolation=isolation,
            shutdown_timeout=shutdown_timeout,
            cancel_grace=cancel_grace,
            listen=not no_listen,
            self_test=not no_self_test,
            completion_delay=completion_delay,
        )
        if ran.abandoned:
            # As `sa-taskqueue worker` does: threads of tasks given back may still
            # run, so leave without waiting for them.
            logging.shutdown()
            os._exit(0)

    return group


__all__ = ["TaskQueueExtension", "extension_of"]
