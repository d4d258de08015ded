"""``python -m benchmarks``: drain, enqueue, pickup latency and depth scaling, beside the raw driver.

``python -m benchmarks soak [options]`` runs the reliability soak instead
(workers under injected faults; see ``python -m benchmarks soak --help``).

Every throughput figure is the median of ``--repeats`` runs with min and max
beside it; every ratio compares figures measured in this run on this server.
Latency percentiles are taken over all samples of one run.  The drain,
peers and controls sections print each drain's cost a task beside its rate:
the workers' CPU, the server's CPU and the statements it ran, counted
rather than timed (`benchmarks.costs`), medians of the repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.backends import BenchBackend, backend
from benchmarks.batching import DELAYS, DRAIN_SLOTS, PROBE_SLOTS, WORKLOADS, beside_a_slow_task, timed_drain
from benchmarks.controls import DRAINS, LIMIT, LIMITED_EVERY, PAUSED_TASKS, TASKS_PER_KEY, controls_drain
from benchmarks.depth import claim_latencies, claim_plan
from benchmarks.drain import DrainResult, drain, statements_used
from benchmarks.enqueue import RAW_PATHS, enqueue_rate
from benchmarks.failures import OUTCOMES, outcome_drain
from benchmarks.galera import SLOTS, WORKERS, galera_rows
from benchmarks.latency import percentiles, pickup_latency
from benchmarks.observability import MODES, observed_drain
from benchmarks.peers import IMPLEMENTATIONS, PEERS, missing_peers, worker_drain
from benchmarks.rates import DRAINS as RATE_DRAINS
from benchmarks.rates import RATE_LIMIT, claim_statements, rates_drain
from benchmarks.rates import TASKS_PER_KEY as RATE_TASKS_PER_KEY
from benchmarks.raw_batch import QUEUE_BATCH, RAW_BATCH
from benchmarks.statements import StatementCosts, statement_costs
from benchmarks.worker_cost import WorkerCost, worker_cost
from benchmarks.workflows import KINDS as WORKFLOW_KINDS
from benchmarks.workflows import LABELS as WORKFLOW_LABELS
from benchmarks.workflows import PLAIN_KINDS, WorkflowCost, baseline_cost, derived, workflow_cost

RESULTS = Path("benchmarks/results")
SECTIONS = (
    "drain",
    "enqueue",
    "latency",
    "peers",
    "depth",
    "controls",
    "rates",
    "batching",
    "statements",
    "running",
    "worker_cost",
    "failures",
    "observability",
    "workflows",
    "galera",
)
#: Sections run only when asked for by name (``--sections galera``): they start servers of their own.
OPT_IN = ("galera",)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(figure: dict[str, float]) -> str:
    return f"{figure['median']:,.0f} ({figure['min']:,.0f}-{figure['max']:,.0f})"


def yes_no(once: bool) -> str:
    """The "exactly once" cell: a failure is shouted, so it is not read past."""
    return "yes" if once else "NO"


#: The mark on a server CPU figure that other databases' statements on the same server shared.
SHARED = "*"
SHARED_NOTE = (
    f"{SHARED} other databases on the server ran statements during the run: "
    "the server CPU includes their work"
)


def _median(values: list[float | None]) -> float | None:
    """The median, or None if any run lacked the figure."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present and len(present) == len(values) else None


def cost_figures(results: list[DrainResult]) -> dict[str, Any]:
    """An implementation's cost a task over its runs: medians of client and server CPU µs and statements.

    ``elsewhere`` sums the statements other databases ran on the server
    during the runs (PostgreSQL), whose work the server CPU includes.
    """
    elsewhere = [result.elsewhere for result in results]
    return {
        "client_us": _median([result.client_us for result in results]),
        "server_us": _median([result.server_us for result in results]),
        "statements": _median([result.statements_per_task for result in results]),
        "elsewhere": None if None in elsewhere else sum(e or 0 for e in elsewhere),
    }


def cost_notes(results: Iterable[list[DrainResult]]) -> list[str]:
    """Why cost figures are missing from these runs, each said once."""
    return sorted({note for runs in results for result in runs for note in result.cost_notes})


def cost_cell(cost: dict[str, Any]) -> str:
    """``client + server µs, statements`` a task: ``412 + 130 µs, 2.00``; ``n/a`` what was not measured.

    Where the client is the server (SQLite) the cell is ``412 µs, n/a``.
    """
    client = "n/a" if cost["client_us"] is None else f"{cost['client_us']:,.0f}"
    statements = "n/a" if cost["statements"] is None else f"{cost['statements']:.2f}"
    if cost.get("in_client"):
        return f"{client} µs, {statements}"
    server = "n/a" if cost["server_us"] is None else f"{cost['server_us']:,.0f}"
    if cost["server_us"] is not None and cost["elsewhere"]:
        server += SHARED
    return f"{client} + {server} µs, {statements}"


def cost_table(title: str, columns: Iterable[str]) -> Table:
    return new_table(f"{title}: client CPU + server CPU, µs a task, and statements a task", columns)


def print_cost_table(run: Run, table: Table, rows: list[dict[str, Any]]) -> None:
    """The cost table, then once each why a figure is missing or shared."""
    run.console.print(table)
    notes = sorted({note for row in rows for note in row["cost_notes"]})
    if any(cost["elsewhere"] for row in rows for cost in row["cost"].values()):
        notes.append(SHARED_NOTE)
    for note in notes:
        run.console.print(f"  {note}", markup=False, highlight=False)


def machine() -> dict[str, Any]:
    import sqlalchemy

    cpu = "unknown"
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as info:
        cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "sqlalchemy": sqlalchemy.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, kept apart so each section reads plain values rather than argparse calls."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--backends", default="postgres,mariadb,sqlite")
    parser.add_argument("--tasks", type=int, default=3000, help="tasks per drain run (the full grid: 20000)")
    parser.add_argument("--workers", default="1,4", help="worker processes (full: 1,2,4,8)")
    parser.add_argument("--batches", default="1,10")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enqueue-tasks", type=int, default=5000)
    parser.add_argument("--latency-samples", type=int, default=40)
    parser.add_argument("--depths", default="0,100000,1000000", help="finished rows (SQLite stops at 100000)")
    parser.add_argument("--peer-tasks", type=int, default=1000, help="tasks per worker-against-worker run")
    parser.add_argument(
        "--statement-tasks", type=int, default=2000, help="tasks per drain of the statements section"
    )
    parser.add_argument(
        "--running", default="0,10000", help="tasks running all along, in the running section"
    )
    parser.add_argument(
        "--worker-cost-tasks", type=int, default=20000, help="tasks per run of the worker_cost section"
    )
    parser.add_argument(
        "--galera-tasks", type=int, default=3000, help="tasks per drain of the galera section"
    )
    parser.add_argument(
        "--workflow-tasks", type=int, default=2000, help="tasks per run of the workflows section"
    )
    parser.add_argument(
        "--baseline-source",
        default=None,
        help="another checkout's root (the release before): the workflows section measures its plain tasks",
    )
    parser.add_argument(
        "--sections",
        default=",".join(name for name in SECTIONS if name not in OPT_IN),
        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all but {', '.join(OPT_IN)})",
    )
    parser.add_argument("--json", default=str(RESULTS / "latest.json"))
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Run:
    """What every section needs: the options, with the comma lists split once, and where to print."""

    args: argparse.Namespace
    backends: list[BenchBackend]
    workers: list[int]
    batches: list[int]
    console: Console

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Run:
        return cls(
            args=args,
            backends=[backend(name) for name in args.backends.split(",")],
            workers=[int(w) for w in args.workers.split(",")],
            batches=[int(b) for b in args.batches.split(",")],
            # Written to a file or a pipe, rich would lay the tables out at 80
            # columns and cut the wider ones; a terminal keeps its own width.
            console=Console(width=None if sys.stdout.isatty() else 240),
        )


def new_table(title: str, columns: Iterable[str]) -> Table:
    """A table whose columns are all right-aligned, since nearly every cell is a number."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    return table


def repeated_drains(
    run_one: Callable[[str], DrainResult],
    implementations: Iterable[str],
    repeats: int,
    sink: dict[str, list[DrainResult]] | None = None,
) -> tuple[dict[str, list[float]], bool]:
    """Each implementation's rate per repeat, and whether every run ran every task exactly once.

    ``sink``, when given, gets every run's whole result, by implementation.

    The implementations take turns within a repeat, so a drift in the server
    over the run (autovacuum, cache warming) falls on all of them alike.
    """
    names = tuple(implementations)
    rates: dict[str, list[float]] = {name: [] for name in names}
    once = True
    for _ in range(repeats):
        for name in names:
            result = run_one(name)
            rates[name].append(result.rate)
            once = once and result.exactly_once
            if sink is not None:
                sink.setdefault(name, []).append(result)
    return rates, once


#: The drain's implementations: the library's claim loop completing each task
#: (``sa_taskqueue``) or each claimed batch in one call (``sa_taskqueue_batch``),
#: its worker (``worker``: ``run_worker(concurrency=B, burst=True)``), and the
#: raw driver's two loops.  At B = 1 a batch is one task: the batch loops are
#: the per-task ones, and are not run twice.
PER_TASK = ("sa_taskqueue", "raw")
BATCH_ONLY = (QUEUE_BATCH, RAW_BATCH)
WORKER = "worker"
#: The drain's cost table's columns, by implementation.
DRAIN_COLUMNS = {
    "sa_taskqueue": "sa_taskqueue, complete()",
    "raw": "raw, per task",
    QUEUE_BATCH: "sa_taskqueue, complete_many()",
    RAW_BATCH: "raw, per batch",
    WORKER: "worker",
}
DRAIN_COSTS = tuple(DRAIN_COLUMNS)


def _drain_one(implementation: str, url: str, tasks: int, workers: int, batch: int) -> DrainResult:
    if implementation == WORKER:
        drained = worker_drain("sa_taskqueue", url, tasks, workers, batch)
        drained.claims, drained.completions = statements_used(url)
        return drained
    return drain(implementation, url, tasks, workers, batch)


def drain_row(run: Run, target: BenchBackend, w: int, b: int) -> dict[str, Any]:
    """One backend/W/B cell of the drain table: sa_taskqueue's loops and worker against the raw loops.

    ``raw`` completes each task with its own statement, ``raw_batch`` a
    claimed batch in one: the limit of the pattern at B > 1.
    """
    names = (*PER_TASK, WORKER, *(BATCH_ONLY if b > 1 else ()))
    results: dict[str, list[DrainResult]] = {}
    rates, once = repeated_drains(
        lambda implementation: _drain_one(implementation, target.url, run.args.tasks, w, b),
        names,
        run.args.repeats,
        results,
    )
    # The worker's claims and completion statements for each B tasks: 1 and 1 when no batch splits.
    per_batch = b / run.args.tasks
    cost = {name: cost_figures(runs) for name, runs in results.items()}
    if b == 1:
        rates[QUEUE_BATCH], rates[RAW_BATCH] = rates["sa_taskqueue"], rates["raw"]
        cost[QUEUE_BATCH], cost[RAW_BATCH] = cost["sa_taskqueue"], cost["raw"]
    median = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "backend": target.name,
        "workers": w,
        "batch": b,
        **{name: spread(values) for name, values in rates.items()},
        "ratio": median["sa_taskqueue"] / median["raw"],
        "ratio_batch": median[QUEUE_BATCH] / median[RAW_BATCH],
        "ratio_worker": median[WORKER] / median[RAW_BATCH],
        "worker_claims_per_batch": statistics.median(r.claims or 0 for r in results[WORKER]) * per_batch,
        "worker_completions_per_batch": statistics.median(r.completions or 0 for r in results[WORKER])
        * per_batch,
        "exactly_once": once,
        "cost": cost,
        "cost_notes": cost_notes(results.values()),
    }


def drain_section(run: Run) -> dict[str, Any]:
    """Drain throughput for every backend, worker count and batch size: the library's cost over raw SQL."""
    args = run.args
    table = new_table(
        f"drain throughput, tasks/s, {args.tasks} no-op tasks, median (min-max) of {args.repeats}",
        (
            "backend",
            "W",
            "B",
            "sa_taskqueue, complete()",
            "raw, per task",
            "ratio",
            "sa_taskqueue, complete_many()",
            "raw, per batch",
            "ratio",
            "worker",
            "worker / raw per batch",
            "worker's claims, completions a batch",
            "exactly once",
        ),
    )
    costs = cost_table(
        f"drain cost, {args.tasks} no-op tasks, median of {args.repeats}",
        ("backend", "W", "B", *(DRAIN_COLUMNS[name] for name in DRAIN_COSTS)),
    )
    rows = []
    for target in run.backends:
        in_client = target.dialect == "sqlite"
        for w in run.workers:
            for b in run.batches:
                row = drain_row(run, target, w, b)
                rows.append(row)
                costs.add_row(
                    target.name,
                    str(w),
                    str(b),
                    *(cost_cell({**row["cost"][name], "in_client": in_client}) for name in DRAIN_COSTS),
                )
                table.add_row(
                    target.name,
                    str(w),
                    str(b),
                    fmt(row["sa_taskqueue"]),
                    fmt(row["raw"]),
                    f"{row['ratio']:.0%}",
                    fmt(row[QUEUE_BATCH]),
                    fmt(row[RAW_BATCH]),
                    f"{row['ratio_batch']:.0%}",
                    fmt(row[WORKER]),
                    f"{row['ratio_worker']:.0%}",
                    f"{row['worker_claims_per_batch']:.2f}, {row['worker_completions_per_batch']:.2f}",
                    yes_no(row["exactly_once"]),
                )
    run.console.print(table)
    print_cost_table(run, costs, rows)
    return {"drain": rows}


def enqueue_section(run: Run) -> dict[str, Any]:
    """Enqueue throughput in one commit: enqueue() one by one, enqueue_many(), the driver's fastest path."""
    args = run.args
    table = new_table(
        f"enqueue throughput, tasks/s, {args.enqueue_tasks} tasks, one commit",
        (
            "backend",
            "enqueue() loop",
            "enqueue_many()",
            "enqueue_many() async",
            "raw driver, fastest",
            "bulk / raw",
        ),
    )
    rows = []
    methods = ("enqueue", "enqueue_many", "async_enqueue_many", "raw")
    for target in run.backends:
        # The methods take turns within each repeat, each repeat starting
        # one further along, so that a machine slowing down for a while, or
        # what one method leaves behind, weighs on all of them, not on one.
        rates: dict[str, list[float]] = {method: [] for method in methods}
        for repeat in range(args.repeats):
            turn = repeat % len(methods)
            for method in methods[turn:] + methods[:turn]:
                rates[method].append(enqueue_rate(method, target.url, args.enqueue_tasks))
        figures = {method: spread(rates[method]) for method in methods}
        ratio = figures["enqueue_many"]["median"] / figures["raw"]["median"]
        raw_path = RAW_PATHS[target.dialect]
        rows.append({"backend": target.name, **figures, "raw_path": raw_path, "bulk_ratio": ratio})
        table.add_row(
            target.name,
            fmt(figures["enqueue"]),
            fmt(figures["enqueue_many"]),
            fmt(figures["async_enqueue_many"]),
            f"{fmt(figures['raw'])} {raw_path}",
            f"{ratio:.0%}",
        )
    run.console.print(table)
    return {"enqueue": rows}


def latency_modes(target: BenchBackend) -> list[tuple[str, bool]]:
    """How a worker learns of new work there: only PostgreSQL has LISTEN/NOTIFY besides polling."""
    polling = ("polling (1 s max)", False)
    return [("LISTEN/NOTIFY", True), polling] if target.name == "postgres" else [polling]


def latency_section(run: Run) -> dict[str, Any]:
    """Pickup latency from commit() to the task's first line, per backend and wake-up mode."""
    samples = run.args.latency_samples
    table = new_table(
        f"pickup latency, ms from commit() to the task's first line, {samples} samples",
        ("backend", "wake-up", "p50", "p95", "p99"),
    )
    rows = []
    for target in run.backends:
        for label, listen in latency_modes(target):
            figure = percentiles(pickup_latency(target.url, listen, samples))
            rows.append({"backend": target.name, "mode": label, **figure})
            table.add_row(target.name, label, *(f"{figure[k]:.1f}" for k in ("p50", "p95", "p99")))
    run.console.print(table)
    return {"latency": rows}


def peers_row(run: Run, url: str, w: int, b: int) -> dict[str, Any]:
    """One W/B cell of the peers table: every implementation's drain, ours against the best peer.

    The async queue is also set against the same loop on bare asyncpg, as the
    drain table sets the sync one against psycopg: what the library costs there.
    """
    results: dict[str, list[DrainResult]] = {}
    rates, once = repeated_drains(
        lambda name: worker_drain(name, url, run.args.peer_tasks, w, b),
        IMPLEMENTATIONS,
        run.args.repeats,
        results,
    )
    figures = {name: spread(values) for name, values in rates.items()}
    best_peer = max(figures[name]["median"] for name in PEERS)
    lead = figures["sa_taskqueue"]["median"] / best_peer
    async_cost = figures["sa_taskqueue_async"]["median"] / figures["raw_asyncpg"]["median"]
    return {
        "workers": w,
        "batch": b,
        **figures,
        "vs_best_peer": lead,
        "async_vs_raw_asyncpg": async_cost,
        "exactly_once": once,
        "cost": {name: cost_figures(runs) for name, runs in results.items()},
        "cost_notes": cost_notes(results.values()),
    }


def peers_section(run: Run) -> dict[str, Any]:
    """Worker against worker on PostgreSQL; left out, with a note, where a peer is not installed."""
    absent = missing_peers()
    postgres = [target for target in run.backends if target.name == "postgres"]
    if absent:
        run.console.print(
            f"peers: left out, not installed: {', '.join(absent)} (install '.[bench-peers]')", markup=False
        )
        return {}
    if not postgres:
        return {}
    args = run.args
    table = new_table(
        f"worker drain on PostgreSQL, tasks/s, {args.peer_tasks} no-op tasks, "
        f"median (min-max) of {args.repeats}",
        (
            "W",
            "B",
            *IMPLEMENTATIONS,
            "sa_taskqueue vs best peer",
            "sa_taskqueue_async / raw_asyncpg",
            "exactly once",
        ),
    )
    costs = cost_table(
        f"worker drain cost on PostgreSQL, {args.peer_tasks} no-op tasks, median of {args.repeats}",
        ("W", "B", *IMPLEMENTATIONS),
    )
    rows = []
    for w in run.workers:
        for b in run.batches:
            row = peers_row(run, postgres[0].url, w, b)
            rows.append(row)
            costs.add_row(str(w), str(b), *(cost_cell(row["cost"][name]) for name in IMPLEMENTATIONS))
            table.add_row(
                str(w),
                str(b),
                *(fmt(row[name]) for name in IMPLEMENTATIONS),
                f"{row['vs_best_peer']:.2f}x",
                f"{row['async_vs_raw_asyncpg']:.0%}",
                yes_no(row["exactly_once"]),
            )
    run.console.print(table)
    print_cost_table(run, costs, rows)
    return {"peers": rows}


def controls_section(run: Run) -> dict[str, Any]:
    """The claim with unique keys, a concurrency limit and a paused queue in use, against the plain claim."""
    args = run.args
    table = new_table(
        f"drain with the scheduling controls in use, tasks/s, {args.tasks} no-op tasks, "
        f"median (min-max) of {args.repeats}; controls: every task keyed, {PAUSED_TASKS:,} due tasks "
        f"in a paused queue, a limited task registered (limit {LIMIT} per key of {TASKS_PER_KEY} tasks), "
        f"1 task in {LIMITED_EVERY} of it; limited: the same, 1 task in 2 of it",
        (
            "backend",
            "W",
            "B",
            "plain",
            "controls",
            "controls / plain",
            "limited",
            "limited / plain",
            "exactly once",
        ),
    )
    costs = cost_table(
        f"drain cost with the scheduling controls in use, {args.tasks} no-op tasks, median of {args.repeats}",
        ("backend", "W", "B", *DRAINS),
    )
    rows = []
    for target in run.backends:
        in_client = target.dialect == "sqlite"
        for w in run.workers:
            for b in run.batches:
                row = controls_row(run, target, w, b)
                rows.append(row)
                costs.add_row(
                    target.name,
                    str(w),
                    str(b),
                    *(cost_cell({**row["cost"][kind], "in_client": in_client}) for kind in DRAINS),
                )
                table.add_row(
                    target.name,
                    str(w),
                    str(b),
                    fmt(row["plain"]),
                    fmt(row["controls"]),
                    f"{row['controls_ratio']:.0%}",
                    fmt(row["limited"]),
                    f"{row['limited_ratio']:.0%}",
                    yes_no(row["exactly_once"]),
                )
    run.console.print(table)
    print_cost_table(run, costs, rows)
    return {"controls": rows}


def rates_section(run: Run) -> dict[str, Any]:
    """The claim with rate limits (`benchmarks.rates`): none; one registered, none queued; all rated."""
    args = run.args
    table = new_table(
        f"drain with rate limits, tasks/s, {args.tasks} no-op tasks, median (min-max) of {args.repeats}; "
        f"registered: a task of rate_limit={RATE_LIMIT!r} registered, none queued; rated: every task of it, "
        f"{RATE_TASKS_PER_KEY} tasks a key (never over the limit)",
        (
            "backend",
            "W",
            "B",
            "plain",
            "registered",
            "registered / plain",
            "rated",
            "rated / plain",
            "exactly once",
        ),
    )
    costs = cost_table(
        f"drain cost with rate limits, {args.tasks} no-op tasks, median of {args.repeats}",
        ("backend", "W", "B", *RATE_DRAINS),
    )
    rows = []
    for target in run.backends:
        in_client = target.dialect == "sqlite"
        for w in run.workers:
            for b in run.batches:
                results: dict[str, list[DrainResult]] = {}
                rates, once = repeated_drains(
                    lambda kind, w=w, b=b, target=target: rates_drain(target.url, args.tasks, w, b, kind),
                    RATE_DRAINS,
                    args.repeats,
                    results,
                )
                plain = statistics.median(rates["plain"])
                row: dict[str, Any] = {"backend": target.name, "workers": w, "batch": b, "exactly_once": once}
                for kind in RATE_DRAINS:
                    row[kind] = spread(rates[kind])
                    row[f"{kind}_ratio"] = statistics.median(rates[kind]) / plain
                row["cost"] = {kind: cost_figures(runs) for kind, runs in results.items()}
                row["cost_notes"] = cost_notes(results.values())
                rows.append(row)
                costs.add_row(
                    target.name,
                    str(w),
                    str(b),
                    *(cost_cell({**row["cost"][kind], "in_client": in_client}) for kind in RATE_DRAINS),
                )
                table.add_row(
                    target.name,
                    str(w),
                    str(b),
                    fmt(row["plain"]),
                    fmt(row["registered"]),
                    f"{row['registered_ratio']:.0%}",
                    fmt(row["rated"]),
                    f"{row['rated_ratio']:.0%}",
                    yes_no(once),
                )
    run.console.print(table)
    print_cost_table(run, costs, rows)
    sent = new_table(
        f"statements and transactions the claims send, a task, counted in the client, one process "
        f"draining {args.tasks} tasks",
        ("backend", "B", *RATE_DRAINS),
    )
    for target in run.backends:
        for b in run.batches:
            counted = {kind: claim_statements(target.url, args.tasks, b, kind) for kind in RATE_DRAINS}
            rows.append({"backend": target.name, "batch": b, "claims_sent": counted})
            sent.add_row(
                target.name,
                str(b),
                *(f"{c['statements']:.2f} in {c['transactions']:.2f}" for c in counted.values()),
            )
    run.console.print(sent)
    return {"rates": rows}


def controls_row(run: Run, target: BenchBackend, w: int, b: int) -> dict[str, Any]:
    """One backend/W/B cell of the controls table: each drain's rate, and its ratio to the plain one."""
    results: dict[str, list[DrainResult]] = {}
    rates, once = repeated_drains(
        lambda kind: controls_drain(target.url, run.args.tasks, w, b, kind), DRAINS, run.args.repeats, results
    )
    plain = statistics.median(rates["plain"])
    row: dict[str, Any] = {"backend": target.name, "workers": w, "batch": b, "exactly_once": once}
    for kind in DRAINS:
        row[kind] = spread(rates[kind])
        row[f"{kind}_ratio"] = statistics.median(rates[kind]) / plain
    row["cost"] = {kind: cost_figures(runs) for kind, runs in results.items()}
    row["cost_notes"] = cost_notes(results.values())
    return row


def depth_rows(run: Run, target: BenchBackend, table: Table) -> list[dict[str, Any]]:
    """One backend's claim latency at each depth, each p50 also as a multiple of the first depth's."""
    rows = []
    base = None
    for depth in (int(d) for d in run.args.depths.split(",")):
        if target.name == "sqlite" and depth > 100_000:
            continue
        figure = percentiles(claim_latencies(target.url, depth))
        base = base or figure["p50"]
        rows.append({"backend": target.name, "finished": depth, **figure, "p50_ratio": figure["p50"] / base})
        table.add_row(
            target.name,
            f"{depth:,}",
            f"{figure['p50']:.2f}",
            f"{figure['p99']:.2f}",
            f"{figure['p50'] / base:.2f}x",
        )
    return rows


def depth_section(run: Run) -> dict[str, Any]:
    """Claim latency as finished rows pile up, and the claim's plan, to show the index keeps it flat."""
    table = new_table(
        "claim+complete latency, ms per batch of 10, W=4, 10,000 queued tasks",
        ("backend", "finished rows", "p50", "p99", "p50 vs 0 rows"),
    )
    rows = []
    plans: dict[str, str] = {}
    for target in run.backends:
        rows.extend(depth_rows(run, target, table))
        plans[target.name] = claim_plan(target.url)
    run.console.print(table)
    for name, plan in plans.items():
        run.console.print(
            f"[bold]EXPLAIN of the claim on {name}[/bold] (with the last depth's rows in the table)"
        )
        run.console.print(plan, markup=False, highlight=False)
    return {"depth": rows, "plans": plans}


def batching_section(run: Run) -> dict[str, Any]:
    """What waiting for a batch costs a success: completion_delay at 0, 1 ms (the default) and 5 ms.

    Drain rates are medians (min-max) over the repeats, the delays taking
    turns; statements and waits are medians over the repeats too.
    """
    samples = run.args.latency_samples
    mixed = new_table(
        f"drains on {DRAIN_SLOTS} slots, median (min-max) of {run.args.repeats}; "
        "ms from a task's end to its success's statement",
        (
            "backend",
            "tasks",
            "completion_delay ms",
            "tasks/s",
            "statements",
            "wait p50",
            "wait p95",
            "wait max",
            "all once",
        ),
    )
    beside = new_table(
        f"beside a slow task: {samples} no-op probes, {PROBE_SLOTS} slots, one busy throughout; "
        "ms from commit() to the probe starting, and to its success's statement",
        (
            "backend",
            "completion_delay ms",
            "pickup p50",
            "sent p50",
            "sent p95",
            "wait p50",
            "wait max",
            "all once",
        ),
    )
    rows = []
    for target in run.backends:
        for label, tasks, longest_ms in WORKLOADS:
            runs: dict[float, list[dict[str, Any]]] = {delay: [] for delay in DELAYS}
            for _ in range(run.args.repeats):
                for delay in DELAYS:  # taking turns, as the drains do
                    runs[delay].append(timed_drain(target.url, delay, tasks, longest_ms))
            for delay, drains in runs.items():
                row = {
                    "backend": target.name,
                    "section": "drain",
                    "tasks": label,
                    "delay_ms": delay * 1000,
                    "rate": spread([drained["rate"] for drained in drains]),
                    "statements": statistics.median(drained["statements"] for drained in drains),
                    "wait": {
                        key: statistics.median(drained["wait"][key] for drained in drains)
                        for key in ("p50", "p95", "max")
                    },
                    "exactly_once": all(drained["exactly_once"] for drained in drains),
                }
                rows.append(row)
                mixed.add_row(
                    target.name,
                    f"{tasks:,} {label}",
                    f"{delay * 1000:g}",
                    fmt(row["rate"]),
                    f"{row['statements']:,.0f}",
                    *(f"{row['wait'][k]:.1f}" for k in ("p50", "p95", "max")),
                    yes_no(row["exactly_once"]),
                )
        for delay in DELAYS:
            probed = beside_a_slow_task(target.url, delay, samples)
            rows.append({"backend": target.name, "section": "beside_slow", **probed})
            ms = f"{delay * 1000:g}"
            beside.add_row(
                target.name,
                ms,
                f"{probed['pickup']['p50']:.1f}",
                *(f"{probed['sent'][k]:.1f}" for k in ("p50", "p95")),
                *(f"{probed['wait'][k]:.1f}" for k in ("p50", "max")),
                yes_no(probed["exactly_once"]),
            )
    run.console.print(mixed)
    run.console.print(beside)
    return {"batching": rows}


def statements_section(run: Run) -> dict[str, Any]:
    """Client CPU and wall time of one claim and one completion of B tasks, against the raw driver's.

    One process, no other running: sa_taskqueue's calls and the raw batch
    client's take turns within each repeat, the one going first swapped
    from one repeat to the next; figures are medians over the repeats of
    each drain's mean µs per call.
    """
    tasks = run.args.statement_tasks
    table = new_table(
        f"client cost per call, µs, one process draining {tasks:,} tasks, median of {run.args.repeats}: "
        "CPU (wall)",
        (
            "backend",
            "B",
            "claim, sa_taskqueue",
            "claim, raw",
            "completion, sa_taskqueue",
            "completion, raw",
            "CPU a task, sa_taskqueue / raw",
            "wall a task, raw / sa_taskqueue",
        ),
    )
    implementations = (QUEUE_BATCH, RAW_BATCH)
    rows = []
    for target in run.backends:
        for b in run.batches:
            measured: dict[str, list[StatementCosts]] = {name: [] for name in implementations}
            for repeat in range(run.args.repeats):
                for name in implementations[:: 1 if repeat % 2 == 0 else -1]:
                    measured[name].append(statement_costs(name, target.url, tasks, b))
            row: dict[str, Any] = {"backend": target.name, "batch": b}
            for name, costs in measured.items():
                row[name] = {
                    field: statistics.median(getattr(cost, field) for cost in costs)
                    for field in ("claim_wall", "claim_cpu", "complete_wall", "complete_cpu")
                }
                row[name]["task_cpu"] = statistics.median(cost.per_task(cpu=True) for cost in costs)
                row[name]["task_wall"] = statistics.median(cost.per_task(cpu=False) for cost in costs)
            ours, raw = row[QUEUE_BATCH], row[RAW_BATCH]
            row["cpu_ratio"] = ours["task_cpu"] / raw["task_cpu"]
            row["wall_ratio"] = raw["task_wall"] / ours["task_wall"]
            rows.append(row)
            table.add_row(
                target.name,
                str(b),
                *(
                    f"{costs[kind + '_cpu']:,.0f} ({costs[kind + '_wall']:,.0f})"
                    for kind in ("claim", "complete")
                    for costs in (ours, raw)
                ),
                f"{ours['task_cpu']:,.0f} / {raw['task_cpu']:,.0f} = {row['cpu_ratio']:.1f}x",
                f"{row['wall_ratio']:.0%}",
            )
    run.console.print(table)
    return {"statements": rows}


def workflows_section(run: Run) -> dict[str, Any]:
    """Plain tasks beside batch members and dependents: statements and CPU a task, enqueue and drain.

    One process, B at a time (`benchmarks.workflows`); figures are medians
    over the repeats, the kinds taking turns within each repeat.  The last
    columns give the cost of one batch member and of one dependency edge.
    """
    tasks = run.args.workflow_tasks
    table = new_table(
        f"workflows: statements / CPU µs a task, one process, {tasks:,} tasks, median of {run.args.repeats}",
        ("backend", "B", *(WORKFLOW_LABELS[kind] for kind in WORKFLOW_KINDS), "a member", "an edge"),
    )
    rows = []
    source = run.args.baseline_source
    kinds = (*WORKFLOW_KINDS, *(f"{kind}_before" for kind in PLAIN_KINDS if source))
    for target in run.backends:
        for b in run.batches:
            measured: dict[str, list[WorkflowCost]] = {kind: [] for kind in kinds}
            for repeat in range(run.args.repeats):
                for kind in kinds if repeat % 2 == 0 else kinds[::-1]:
                    if kind.endswith("_before"):
                        cost = baseline_cost(source, target.url, kind.removesuffix("_before"), tasks, b)
                    else:
                        cost = workflow_cost(target.url, kind, tasks, b)
                    measured[kind].append(cost)
            medians = {
                kind: WorkflowCost(
                    kind=kind,
                    tasks=tasks,
                    edges=costs[0].edges,
                    **{
                        field: statistics.median(getattr(cost, field) for cost in costs)
                        for field in ("enqueue_statements", "enqueue_cpu", "drain_statements", "drain_cpu")
                    },
                )
                for kind, costs in measured.items()
            }
            extra = derived(medians)
            for kind in PLAIN_KINDS:
                before = medians.get(f"{kind}_before")
                if before is not None:
                    now = medians[kind]
                    extra[f"{kind}_drain_statements_change"] = now.drain_statements - before.drain_statements
                    extra[f"{kind}_drain_cpu_ratio"] = now.drain_cpu / before.drain_cpu
            row: dict[str, Any] = {
                "backend": target.name,
                "batch": b,
                **{kind: cost.as_json() for kind, cost in medians.items()},
                **extra,
            }
            rows.append(row)
            table.add_row(
                target.name,
                str(b),
                *(
                    f"enqueue {cost.enqueue_statements:.2f} / {cost.enqueue_cpu:,.0f}, "
                    f"drain {cost.drain_statements:.2f} / {cost.drain_cpu:,.0f}"
                    for kind, cost in medians.items()
                    if kind in WORKFLOW_KINDS
                ),
                f"{extra['member_statements']:+.2f} / {extra['member_cpu']:+,.0f}",
                f"{extra['edge_statements']:+.2f} / {extra['edge_cpu']:+,.0f}",
            )
    run.console.print(table)
    if source:
        before = new_table(
            f"plain tasks against {source}: drain statements / CPU µs a task, before -> now",
            ("backend", "B", *(WORKFLOW_LABELS[kind] for kind in PLAIN_KINDS)),
        )
        for row in rows:
            before.add_row(
                row["backend"],
                str(row["batch"]),
                *(
                    f"{then['drain_statements']:.3f} / {then['drain_cpu']:,.0f}"
                    f" -> {now['drain_statements']:.3f} / {now['drain_cpu']:,.0f}"
                    f" ({row[kind + '_drain_cpu_ratio']:.2f}x)"
                    for kind in PLAIN_KINDS
                    for then, now in [(row[kind + "_before"], row[kind])]
                ),
            )
        run.console.print(before)
    return {"workflows": rows}


def running_section(run: Run) -> dict[str, Any]:
    """A claim's and a completion's client cost as tasks pile up running under other workers' claims.

    The statements section's drain, with ``--running`` tasks held by another
    worker all along (long tasks, or many workers): each figure a median over
    the repeats, beside the same figure with none running.  A completion that
    found its rows by walking every running one would grow with them.  Each
    count of running tasks is measured twice: as the table is filled, and
    once the planner's statistics have caught up (ANALYZE).
    """
    tasks = run.args.statement_tasks
    table = new_table(
        f"claim and completion as tasks run elsewhere, µs a call, one process draining {tasks:,} tasks, "
        f"median of {run.args.repeats}: CPU (wall)",
        ("backend", "B", "running", "statistics", "claim", "completion", "completion wall vs none running"),
    )
    counts = [int(count) for count in run.args.running.split(",")]
    settings = [(count, analyzed) for count in counts for analyzed in ((False, True) if count else (False,))]
    rows = []
    for target in run.backends:
        for b in run.batches:
            base = None
            for running, analyzed in settings:
                costs = [
                    statement_costs(QUEUE_BATCH, target.url, tasks, b, running=running, analyzed=analyzed)
                    for _ in range(run.args.repeats)
                ]
                row: dict[str, Any] = {
                    "backend": target.name,
                    "batch": b,
                    "running": running,
                    "analyzed": analyzed,
                }
                for field in ("claim_wall", "claim_cpu", "complete_wall", "complete_cpu"):
                    row[field] = statistics.median(getattr(cost, field) for cost in costs)
                base = base or row["complete_wall"]
                row["complete_wall_ratio"] = row["complete_wall"] / base
                rows.append(row)
                table.add_row(
                    target.name,
                    str(b),
                    f"{running:,}",
                    "current" if analyzed else "as filled",
                    f"{row['claim_cpu']:,.0f} ({row['claim_wall']:,.0f})",
                    f"{row['complete_cpu']:,.0f} ({row['complete_wall']:,.0f})",
                    f"{row['complete_wall_ratio']:.2f}x",
                )
    run.console.print(table)
    return {"running": rows}


def worker_cost_section(run: Run) -> dict[str, Any]:
    """A worker's own CPU a task, beside its statements: `run_worker` with the database answered from memory.

    No server: one row per B, each figure the median over the repeats, each
    repeat a worker in a fresh process.
    """
    tasks = run.args.worker_cost_tasks
    table = new_table(
        f"the worker's own cost, {tasks:,} no-op tasks, claims and completions answered from memory, "
        f"median (min-max) of {run.args.repeats}",
        ("B", "tasks/s", "client CPU a task, µs", "thread switches a task"),
    )
    rows = []
    for b in run.batches:
        costs: list[WorkerCost] = [worker_cost(tasks, b) for _ in range(run.args.repeats)]
        row = {
            "batch": b,
            "tasks": tasks,
            "rate": spread([cost.rate for cost in costs]),
            "cpu_per_task_us": spread([cost.cpu_per_task_us for cost in costs]),
            "switches_per_task": spread([cost.switches_per_task for cost in costs]),
        }
        rows.append(row)
        table.add_row(
            str(b),
            fmt(row["rate"]),
            f"{row['cpu_per_task_us']['median']:.1f} ({row['cpu_per_task_us']['min']:.1f}-"
            f"{row['cpu_per_task_us']['max']:.1f})",
            f"{row['switches_per_task']['median']:.2f}",
        )
    run.console.print(table)
    return {"worker_cost": rows}


def failures_row(run: Run, target: BenchBackend, w: int, b: int) -> dict[str, Any]:
    """One backend/W/B cell of the failures table: the two drains taking turns, and their ratio."""
    drains: dict[str, list[dict[str, Any]]] = {outcome: [] for outcome in OUTCOMES}
    for _ in range(run.args.repeats):
        for outcome in OUTCOMES:
            drains[outcome].append(outcome_drain(target.url, run.args.tasks, w, b, outcome))
    row: dict[str, Any] = {"backend": target.name, "workers": w, "batch": b}
    for outcome, runs in drains.items():
        row[outcome] = spread([drained["rate"] for drained in runs])
        row[f"{outcome}_statements"] = statistics.median(drained["statements"] for drained in runs)
    row["ratio"] = row["fail"]["median"] / row["succeed"]["median"]
    row["exactly_once"] = all(drained["exactly_once"] for runs in drains.values() for drained in runs)
    return row


def failures_section(run: Run) -> dict[str, Any]:
    """A worker draining tasks that fail, beside the same worker draining tasks that succeed.

    The two take turns within each repeat; the ratio is of their medians.
    Statements are those that wrote the outcomes, medians over the repeats.
    """
    args = run.args
    table = new_table(
        f"worker drains of {args.tasks} tasks that succeed or fail (one attempt each), tasks/s, "
        f"median (min-max) of {args.repeats}; statements that wrote the outcomes",
        ("backend", "W", "B", "succeed", "statements", "fail", "statements", "fail / succeed", "all once"),
    )
    rows = []
    for target in run.backends:
        for w in run.workers:
            for b in run.batches:
                row = failures_row(run, target, w, b)
                rows.append(row)
                table.add_row(
                    target.name,
                    str(w),
                    str(b),
                    fmt(row["succeed"]),
                    f"{row['succeed_statements']:,.0f}",
                    fmt(row["fail"]),
                    f"{row['fail_statements']:,.0f}",
                    f"{row['ratio']:.0%}",
                    yes_no(row["exactly_once"]),
                )
    run.console.print(table)
    return {"failures": rows}


def percent(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.1%}"


def observability_section(run: Run) -> dict[str, Any]:
    """The worker's drain with metrics and tracing off and on, taking turns: rate, and cost a task."""
    args = run.args
    table = new_table(
        f"worker drain with metrics and tracing off and on, tasks/s, {args.tasks} no-op tasks, "
        f"median (min-max) of {args.repeats}; metrics: Prometheus; on: Prometheus metrics and "
        "OpenTelemetry tracing (SDK, every span sampled, batch processor, exporter dropping them), "
        "every task traced",
        (
            "backend",
            "W",
            "B",
            "off",
            "metrics",
            "on",
            "metrics / off",
            "on / off",
            "client CPU metrics / off",
            "client CPU on / off",
            "exactly once",
        ),
    )
    costs = cost_table(
        f"worker drain cost with metrics and tracing off and on, {args.tasks} no-op tasks, "
        f"median of {args.repeats}",
        ("backend", "W", "B", *MODES),
    )
    rows = []
    for target in run.backends:
        in_client = target.dialect == "sqlite"
        for w in run.workers:
            for b in run.batches:
                results: dict[str, list[DrainResult]] = {}
                rates, once = repeated_drains(
                    lambda mode, target=target, w=w, b=b: observed_drain(target.url, args.tasks, w, b, mode),
                    MODES,
                    args.repeats,
                    results,
                )
                row: dict[str, Any] = {"backend": target.name, "workers": w, "batch": b, "exactly_once": once}
                for mode in MODES:
                    row[mode] = spread(rates[mode])
                row["cost"] = {mode: cost_figures(runs) for mode, runs in results.items()}
                row["cost_notes"] = cost_notes(results.values())
                off_cpu = row["cost"]["off"]["client_us"]
                for mode in MODES[1:]:
                    row[f"{mode}_ratio"] = row[mode]["median"] / row["off"]["median"]
                    cpu = row["cost"][mode]["client_us"]
                    row[f"{mode}_client_cpu_ratio"] = None if None in (cpu, off_cpu) else cpu / off_cpu
                rows.append(row)
                table.add_row(
                    target.name,
                    str(w),
                    str(b),
                    *(fmt(row[mode]) for mode in MODES),
                    *(f"{row[f'{mode}_ratio']:.1%}" for mode in MODES[1:]),
                    *(
                        "n/a"
                        if row[f"{mode}_client_cpu_ratio"] is None
                        else f"{row[f'{mode}_client_cpu_ratio']:.1%}"
                        for mode in MODES[1:]
                    ),
                    yes_no(once),
                )
                costs.add_row(
                    target.name,
                    str(w),
                    str(b),
                    *(cost_cell({**row["cost"][mode], "in_client": in_client}) for mode in MODES),
                )
    run.console.print(table)
    print_cost_table(run, costs, rows)
    return {"observability": rows, "observability_worker_cost": observability_worker_cost(run)}


def observability_worker_cost(run: Run) -> list[dict[str, Any]]:
    """The worker's own CPU a task with metrics and tracing off and on, its claims answered from memory.

    Without a database the figure is the library's own work and the SDK's, free of the server's noise:
    what observing adds to each task, to set beside a drain's client CPU a task.
    """
    tasks = run.args.worker_cost_tasks
    table = new_table(
        f"the worker's own cost with metrics and tracing off and on, {tasks:,} no-op tasks, claims and "
        f"completions answered from memory, client CPU µs a task, median (min-max) of {run.args.repeats}",
        ("B", *MODES, *(f"{mode} - off" for mode in MODES[1:])),
    )
    rows = []
    for b in run.batches:
        cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(run.args.repeats):
            for mode in MODES:
                cpu[mode].append(worker_cost(tasks, b, mode).cpu_per_task_us)
        row: dict[str, Any] = {"batch": b, "tasks": tasks}
        for mode in MODES:
            row[mode] = spread(cpu[mode])
        for mode in MODES[1:]:
            row[f"{mode}_added_us"] = row[mode]["median"] - row["off"]["median"]
        rows.append(row)
        table.add_row(
            str(b),
            *(f"{row[mode]['median']:.1f} ({row[mode]['min']:.1f}-{row[mode]['max']:.1f})" for mode in MODES),
            *(f"{row[f'{mode}_added_us']:+.1f}" for mode in MODES[1:]),
        )
    run.console.print(table)
    return rows


def galera_section(run: Run) -> dict[str, Any]:
    """Workers on a Galera cluster beside one plain server, with and without spreading (benchmarks.galera)."""
    from tests.galera import GaleraUnavailable

    args = run.args
    plain = backend("mariadb")
    table = new_table(
        f"galera: {WORKERS} workers of {SLOTS} slots, {args.galera_tasks} no-op tasks, median (min-max) of "
        f"{args.repeats}; cost: client + server CPU µs a task, statements a task",
        ["where", "spreading", "tasks/s", "conflicts / 1000 tasks", "cost", "exactly once"],
    )
    rows: list[dict[str, Any]] = []
    try:
        for found in galera_rows(plain.url, args.galera_tasks, args.repeats):
            rows.append(found)
            conflicts = found["conflicts_per_1000"]
            cost = {key: found[key] for key in ("client_us", "server_us", "statements")}
            table.add_row(
                found["place"],
                found["spreading"],
                fmt(found["tasks_per_s"]),
                "n/a" if conflicts is None else f"{conflicts:.1f}",
                cost_cell({**cost, "elsewhere": None}),
                yes_no(found["exactly_once"]),
            )
    except GaleraUnavailable as error:
        run.console.print(f"galera: no cluster could be started, section left out: {error}", markup=False)
    run.console.print(table)
    for note in sorted({note for found in rows for note in found["notes"]}):
        run.console.print(f"  {note}", markup=False, highlight=False)
    return {"galera": rows}


SECTION_RUNNERS: dict[str, Callable[[Run], dict[str, Any]]] = {
    "drain": drain_section,
    "enqueue": enqueue_section,
    "latency": latency_section,
    "peers": peers_section,
    "depth": depth_section,
    "controls": controls_section,
    "rates": rates_section,
    "batching": batching_section,
    "statements": statements_section,
    "running": running_section,
    "worker_cost": worker_cost_section,
    "failures": failures_section,
    "observability": observability_section,
    "workflows": workflows_section,
    "galera": galera_section,
}


def write_results(run: Run, results: dict[str, Any], started: float) -> None:
    """Stamp the run's duration and write the JSON, so a run can be compared with a later one."""
    results["seconds"] = time.perf_counter() - started
    Path(run.args.json).write_text(json.dumps(results, indent=2, default=str))
    run.console.print(f"done in {results['seconds']:.0f}s; results in {run.args.json}")


def main(argv: list[str] | None = None) -> None:
    """Run the chosen sections in a fixed order; every section key is in the JSON, empty when not run.

    ``soak`` as the first argument runs the soak, with options of its own,
    and exits with its verdict.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["soak"]:
        from benchmarks.soak.command import main as soak

        sys.exit(soak(argv[1:]))
    run = Run.from_args(parse_args(argv))
    sections = set(run.args.sections.split(","))
    results: dict[str, Any] = {"machine": machine(), **{name: [] for name in SECTIONS}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    run.console.print(f"machine: {results['machine']}")
    for name, section in SECTION_RUNNERS.items():
        if name in sections:
            results.update(section(run))
    write_results(run, results, started)


if __name__ == "__main__":
    main()
