"""Worker drains of two checkouts of the library, taking turns: is this code faster than that one?

``python -m benchmarks.checkouts URL --old PATH [--new PATH] --workers W --batch B --tasks N --rounds R``
runs R rounds of one drain with each checkout (old, new; and old again at the end: A-B-A), each drain W
worker processes of ``run_worker(concurrency=B, burst=True)`` over N no-op tasks, and prints and
appends to ``--json`` (JSON lines) each drain's rate and client CPU a task.

It uses nothing of the library but `TaskQueue`, `Task`, `TaskStatus` and `metadata`, so that it runs on
old checkouts whose benchmark harness differs; a checkout is the directory holding its ``sa_taskqueue``
package, imported first in each process through ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa


def _worker(url: str, batch: int, ready: Any, go: Any, out: Any) -> None:
    import sa_taskqueue as tq

    engine = sa.create_engine(url)
    queue = tq.TaskQueue(engine, lease=timedelta(minutes=5))
    queue.task(name="noop")(lambda: None)
    queue.strategy  # noqa: B018 - connect and pick the strategy before the clock starts
    ready.release()
    go.wait()
    started = time.process_time()
    queue.run_worker(concurrency=batch, burst=True, poll_interval=0.05)
    out.put((time.process_time() - started, time.perf_counter()))


def drain(url: str, workers: int, batch: int, tasks: int) -> dict[str, Any]:
    """One drain with the library this process imports: its rate, client CPU a task, and tasks left."""
    import sa_taskqueue as tq

    engine = sa.create_engine(url)
    tq.metadata.drop_all(engine)
    tq.metadata.create_all(engine)
    now = datetime.now(UTC)
    row = {
        "name": "noop",
        "queue": "default",
        "priority": 0,
        "params": {},
        "status": tq.TaskStatus.QUEUED,
        "run_at": now - timedelta(seconds=1),
        "attempts": 0,
        "max_attempts": 3,
        "created_at": now,
    }
    with engine.begin() as conn:
        conn.execute(tq.Task.__table__.insert(), [row] * tasks)
    context = multiprocessing.get_context("spawn")
    ready, go, out = context.Semaphore(0), context.Event(), context.Queue()
    processes = [context.Process(target=_worker, args=(url, batch, ready, go, out)) for _ in range(workers)]
    for process in processes:
        process.start()
    for _ in processes:
        ready.acquire()
    started = time.perf_counter()
    go.set()
    outcomes = [out.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
    table = tq.Task.__table__
    with engine.connect() as conn:
        left = conn.scalar(
            sa.select(sa.func.count()).select_from(table).where(table.c.status != tq.TaskStatus.COMPLETED)
        )
    engine.dispose()
    finished = max(stamp for _cpu, stamp in outcomes)
    return {
        "rate": tasks / (finished - started),
        "client_us": sum(cpu for cpu, _stamp in outcomes) / tasks * 1e6,
        "left": int(left or 0),
        "library": os.path.dirname(os.path.realpath(tq.__file__)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--old", required=True, help="directory holding the older sa_taskqueue package")
    parser.add_argument("--new", default=os.getcwd(), help="directory holding the newer one (default: here)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="append each drain as a JSON line to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (a child run: which checkout this is)
    args = parser.parse_args(argv)
    if args.one is not None:
        figures = drain(args.url, args.workers, args.batch, args.tasks)
        figures.update(
            checkout=args.one,
            workers=args.workers,
            batch=args.batch,
            tasks=args.tasks,
            when=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        print(json.dumps(figures), flush=True)
        return
    order = [("old", args.old), ("new", args.new)] * args.rounds + [("old", args.old)]
    for label, path in order:
        # Run from the checkout's directory: ``-m`` puts the working directory
        # first on the path, ahead of PYTHONPATH (which brings this harness).
        here = os.getcwd()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(path), here])}
        command = [sys.executable, "-m", "benchmarks.checkouts", args.url, "--old", args.old, "--one", label]
        command += ["--workers", str(args.workers), "--batch", str(args.batch), "--tasks", str(args.tasks)]
        line = subprocess.run(
            command, env=env, cwd=os.path.abspath(path), check=True, capture_output=True, text=True
        ).stdout.strip()
        figures = json.loads(line.splitlines()[-1])
        print(
            f"{label:>3} ({path}): {figures['rate']:,.0f} tasks/s,"
            f" {figures['client_us']:.0f} µs client CPU a task, {figures['left']} left",
            flush=True,
        )
        if args.json:
            with open(os.path.join(here, args.json), "a", encoding="utf-8") as sink:
                sink.write(json.dumps({**figures, "path": os.path.abspath(path)}) + "\n")


if __name__ == "__main__":
    main()
