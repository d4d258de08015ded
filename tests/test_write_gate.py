"""The write gate of a SQLite file: long writes one at a time, and lease renewals ahead of them."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sa_taskqueue.backends import backend_for
from sa_taskqueue.backends.write_gate import WriteGate
from tests.helpers import wait_until

pytestmark = pytest.mark.backends("sqlite")  # about files beside the database, not a server


def locked(path: str) -> bool:
    """Whether some passage holds a lock on ``path`` (probed without waiting)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_renewal_passes_ahead_of_the_writers_waiting(tmp_path: Path) -> None:
    gate = WriteGate(tmp_path / "queue.db")
    inside = gate.writer()
    inside.enter()
    order: list[str] = []
    order_lock = threading.Lock()

    def through(name: str, renewal: bool) -> None:
        with gate.renewal() if renewal else gate.writer(), order_lock:
            order.append(name)

    writers = [threading.Thread(target=through, args=(f"writer {n}", False)) for n in range(3)]
    for writer in writers:
        writer.start()
    renewal = threading.Thread(target=through, args=("renewal", True))
    renewal.start()
    wait_until(lambda: locked(gate.renewing_path), 10, "the renewal to announce itself")
    inside.leave()
    for thread in [*writers, renewal]:
        thread.join(10)
    assert order[0] == "renewal", order
    assert sorted(order[1:]) == ["writer 0", "writer 1", "writer 2"]


def test_writers_pass_one_at_a_time(tmp_path: Path) -> None:
    gate = WriteGate(tmp_path / "queue.db")
    inside = 0
    most = 0
    lock = threading.Lock()

    def write() -> None:
        nonlocal inside, most
        for _ in range(50):
            with gate.writer():
                with lock:
                    inside += 1
                    most = max(most, inside)
                with lock:
                    inside -= 1

    threads = [threading.Thread(target=write) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most == 1


def test_a_writer_killed_inside_leaves_the_gate_open(tmp_path: Path) -> None:
    gate = WriteGate(tmp_path / "queue.db")
    code = (
        "import sys, time\n"
        "from sa_taskqueue.backends.write_gate import WriteGate\n"
        "WriteGate(sys.argv[1]).writer().enter()\n"
        "print('inside', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "queue.db")], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"inside\n"
        assert locked(gate.gate_path)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        with gate.renewal():
            assert locked(gate.gate_path)
    finally:
        child.kill()
        child.wait()
    assert not locked(gate.gate_path)


def run_then_sleep(running: Any) -> None:
    running.set()
    time.sleep(60)


def test_a_process_forked_while_a_write_is_inside_does_not_keep_the_gate_shut(tmp_path: Path) -> None:
    # A task process is forked from a worker whose other threads may be at the gate just then.
    gate = WriteGate(tmp_path / "queue.db")
    passage = gate.writer()
    passage.enter()
    context = multiprocessing.get_context("fork")
    running = context.Event()
    child = context.Process(target=run_then_sleep, args=(running,))
    child.start()
    try:
        assert running.wait(30), "the child never ran"
        passage.leave()
        assert not locked(gate.gate_path), "the forked child's copy of the file kept the gate shut"
    finally:
        child.kill()
        child.join(10)


def test_only_a_database_file_has_a_gate(tmp_path: Path) -> None:
    backend = backend_for(sa.create_engine("sqlite://").dialect)
    assert backend.write_gate(sa.make_url("sqlite://")) is None
    assert backend.write_gate(sa.make_url("sqlite:///:memory:")) is None
    assert backend.write_gate(sa.make_url("sqlite:///file:queue?mode=memory&uri=true")) is None
    gate = backend.write_gate(sa.make_url(f"sqlite:///{tmp_path}/queue.db"))
    assert gate is not None and gate.gate_path == f"{tmp_path}/queue.db-sa_taskqueue-gate"
    postgres = sa.create_engine("postgresql+psycopg://localhost/test")
    assert backend_for(postgres.dialect).write_gate(postgres.url) is None


def test_a_gate_that_cannot_be_opened_lets_the_write_through(tmp_path: Path) -> None:
    gate = WriteGate(tmp_path / "missing-directory" / "queue.db")
    with gate.writer(), gate.renewal():
        pass  # no gate to wait at: SQLite's own lock decides
