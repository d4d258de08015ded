"""Running the command line and the test application as real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq

ROOT = Path(__file__).resolve().parent.parent


def cli_env(url: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "SA_TASKQUEUE_DATABASE_URL": url, **extra}


def run_cli(*args: str, url: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    """``python -m sa_taskqueue ARGS`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "sa_taskqueue", *args],
        cwd=ROOT,
        env=cli_env(url, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(*args: str, url: str, **extra: str) -> subprocess.Popen[str]:
    """``python -m sa_taskqueue ARGS`` in the background."""
    return subprocess.Popen(
        [sys.executable, "-m", "sa_taskqueue", *args],
        cwd=ROOT,
        env=cli_env(url, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until(condition: Callable[[], object], seconds: float, what: str) -> None:
    """Poll ``condition`` until it is truthy, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {seconds}s waiting for {what}")


def task_rows(engine: sa.Engine) -> list[tq.Task]:
    with Session(engine) as session:
        rows = list(session.scalars(sa.select(tq.Task).order_by(tq.Task.id)))
        session.expunge_all()
        return rows


def task_row(engine: sa.Engine, task_id: int) -> tq.Task:
    with Session(engine) as session:
        row = session.get(tq.Task, task_id)
        assert row is not None
        session.expunge(row)
        return row
