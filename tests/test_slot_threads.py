"""A worker's slot threads: a task per thread at a time, no more threads than slots, none lost at shutdown.

`SlotThreads` holds no SQL; the worker's own tests (tests/test_worker.py,
tests/test_runtime.py) run it against every database.  These pin down what
the worker relies on: every task submitted is either run or handed back as
never taken up, and an idle thread never keeps the interpreter from exiting.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from sa_taskqueue.worker.slot_threads import IDLE_CHECK, SlotThreads
from tests.helpers import wait_until


def test_tasks_run_side_by_side_on_no_more_threads_than_slots() -> None:
    release = threading.Event()
    running: set[int] = set()
    most = [0]
    lock = threading.Lock()
    done: list[int] = []

    def run(item: int) -> None:
        with lock:
            running.add(item)
            most[0] = max(most[0], len(running))
        release.wait(10)
        with lock:
            running.discard(item)
            done.append(item)

    threads = SlotThreads(3, run, lambda item: None, name="test-slot")
    for item in range(7):
        threads.submit(item)
    wait_until(lambda: len(running) == 3, 10, "three tasks running at once")
    assert len(threads.threads) == 3
    release.set()
    wait_until(lambda: len(done) == 7, 10, "every task run")
    threads.shutdown()
    assert most[0] == 3
    assert sorted(done) == list(range(7))
    for thread in threads.threads:
        thread.join(10)
        assert not thread.is_alive()


def test_a_shutdown_hands_back_every_task_no_thread_took_up_and_lets_the_running_one_finish() -> None:
    started = threading.Event()
    release = threading.Event()
    ran: list[str] = []
    unstarted: list[str] = []

    def run(item: str) -> None:
        started.set()
        release.wait(10)
        ran.append(item)

    threads = SlotThreads(1, run, unstarted.append, name="test-slot")
    for item in ("first", "second", "third"):
        threads.submit(item)
    assert started.wait(10)
    threads.shutdown()
    assert unstarted == ["second", "third"]
    assert ran == []  # the running task runs on: shutdown does not wait for it
    release.set()
    threads.threads[0].join(10)
    assert ran == ["first"]
    with pytest.raises(RuntimeError, match="shut down"):
        threads.submit("late")


def test_an_error_a_task_lets_out_is_logged_and_its_thread_serves_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[int] = []

    def run(item: int) -> None:
        if item == 0:
            raise RuntimeError("broken slot")
        ran.append(item)

    threads = SlotThreads(1, run, lambda item: None, name="test-slot")
    for item in range(3):
        threads.submit(item)
    wait_until(lambda: ran == [1, 2], 10, "the tasks after the error run")
    threads.shutdown()
    assert "broken slot" in caplog.text


def _exit_with(body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter; it must exit within a few idle checks."""
    script = textwrap.dedent(
        """
        import threading, time
        from sa_taskqueue.worker.slot_threads import SlotThreads
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=10 * IDLE_CHECK + 20
    )


def test_an_idle_thread_does_not_keep_the_interpreter_from_exiting() -> None:
    # Not shut down: the main thread just ends, its slot threads idle.
    exited = _exit_with(
        """
        threads = SlotThreads(4, lambda item: None, lambda item: None, name="idle")
        for item in range(4):
            threads.submit(item)
        while len(threads.threads) < 4:
            time.sleep(0.01)
        print("main thread done", flush=True)
        """
    )
    # (an idle thread waiting for a task forever would hold the exit past the timeout)
    assert exited.returncode == 0, exited.stderr
    assert exited.stdout.strip() == "main thread done"


def test_an_exiting_interpreter_waits_for_a_task_still_running() -> None:
    exited = _exit_with(
        """
        def run(item):
            time.sleep(0.5)
            print("finished", item, flush=True)

        threads = SlotThreads(1, run, lambda item: None, name="busy")
        threads.submit("the task")
        while not threads.threads[0].is_alive():
            time.sleep(0.01)
        """
    )
    assert exited.returncode == 0, exited.stderr
    assert exited.stdout.strip() == "finished the task"


def test_a_submitter_still_running_at_exit_is_refused_and_the_interpreter_exits() -> None:
    # A worker in a daemon thread keeps claiming while the main thread ends:
    # its next task is refused, as an executor refuses one, rather than kept
    # running forever (or queued for idle threads that have ended).
    exited = _exit_with(
        """
        import sys

        threads = SlotThreads(2, lambda item: time.sleep(0.05), lambda item: None, name="busy")

        def submit_forever():
            while True:
                try:
                    threads.submit("task")
                except RuntimeError:
                    print("refused", flush=True)
                    return
                time.sleep(0.01)

        threading.Thread(target=submit_forever, daemon=True).start()
        time.sleep(0.3)
        """
    )
    assert exited.returncode == 0, exited.stderr
    assert exited.stdout.strip() == "refused"
