"""The Flask extension's own promises, apart from the example: one queue per app, set up in order."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from flask import Flask, current_app
from flask_sqlalchemy import SQLAlchemy

import sa_taskqueue as tq
from sa_taskqueue.integrations.flask import TaskQueueExtension, extension_of


def make_app(tmp_path: Path, name: str = "shop") -> tuple[Flask, SQLAlchemy]:
    app = Flask(name)
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / (name + '.db')}"
    db = SQLAlchemy()
    db.init_app(app)
    return app, db


def test_init_app_builds_the_queue_on_the_app_s_engine(tmp_path: Path) -> None:
    app, db = make_app(tmp_path)
    tasks = TaskQueueExtension(db=db)

    tasks.init_app(app)

    with app.app_context():
        assert tasks.queue.engine is db.engine
    assert tasks.queue.model is tq.Task
    assert tasks.app is app
    assert extension_of(app) is tasks
    assert "sa-taskqueue" in app.cli.commands


def test_a_task_registered_through_the_extension_keeps_its_name_and_signature(tmp_path: Path) -> None:
    app, _db = make_app(tmp_path)
    tasks = TaskQueueExtension(app, _db)

    @tasks.task(name="mail", max_attempts=2)
    def mail(to: str) -> str:
        return to

    assert tasks.queue.registered("mail") is mail
    assert mail.options.max_attempts == 2
    with pytest.raises(TypeError, match="mail"):
        mail.check_params({"recipient": "a@example.com"})
    assert mail("a@example.com") == "a@example.com"


def test_an_extension_serves_one_app(tmp_path: Path) -> None:
    app, db = make_app(tmp_path)
    tasks = TaskQueueExtension(app, db)
    other, _ = make_app(tmp_path, "other")
    with pytest.raises(RuntimeError, match="already serves the app 'shop'"):
        tasks.init_app(other)
    with pytest.raises(RuntimeError, match="already has a TaskQueueExtension"):
        TaskQueueExtension(app, db)


def test_tasks_and_the_queue_wait_for_init_app(tmp_path: Path) -> None:
    _app, db = make_app(tmp_path)
    tasks = TaskQueueExtension(db=db)
    with pytest.raises(RuntimeError, match="call init_app"):
        tasks.task(lambda: None)
    with pytest.raises(RuntimeError, match="call init_app"):
        _ = tasks.queue


def test_init_app_needs_the_app_s_sqlalchemy(tmp_path: Path) -> None:
    app, _db = make_app(tmp_path)
    with pytest.raises(TypeError, match=r"flask_sqlalchemy\.SQLAlchemy"):
        TaskQueueExtension(app)
    with pytest.raises(RuntimeError, match="has no TaskQueueExtension"):
        extension_of(app)


def test_an_async_task_stays_a_coroutine_function_and_runs_in_the_app_s_context(tmp_path: Path) -> None:
    app, db = make_app(tmp_path)
    tasks = TaskQueueExtension(app, db)
    seen: list[tuple[str, str]] = []

    @tasks.task(name="greet")
    async def greet(who: str) -> None:
        seen.append((current_app.name, who))

    assert inspect.iscoroutinefunction(greet.func)
    with app.app_context():
        tq.metadata.create_all(db.engine)
        greet.enqueue(db.session, who="ada")
        db.session.commit()

    tasks.queue.run_worker(burst=True)

    assert seen == [("shop", "ada")]
