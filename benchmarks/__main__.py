"""``python -m benchmarks``: drain, enqueue, pickup latency and depth scaling, beside the raw driver.

Every throughput figure is the median of ``--repeats`` runs with min and max
beside it; every ratio compares figures measured in this run on this server.
Latency percentiles are taken over all samples of one run.
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
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.backends import backend
from benchmarks.depth import claim_latencies, claim_plan
from benchmarks.drain import drain
from benchmarks.enqueue import enqueue_rate
from benchmarks.latency import percentiles, pickup_latency
from benchmarks.peers import IMPLEMENTATIONS, PEERS, missing_peers, worker_drain

RESULTS = Path("benchmarks/results")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(figure: dict[str, float]) -> str:
    return f"{figure['median']:,.0f} ({figure['min']:,.0f}-{figure['max']:,.0f})"


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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--backends", default="postgres,mariadb,sqlite")
    parser.add_argument(
        "--tasks", type=int, default=3000, help="tasks per drain run (the issue's full run: 20000)"
    )
    parser.add_argument("--workers", default="1,4", help="worker processes (full: 1,2,4,8)")
    parser.add_argument("--batches", default="1,10")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enqueue-tasks", type=int, default=5000)
    parser.add_argument("--latency-samples", type=int, default=40)
    parser.add_argument("--depths", default="0,100000,1000000", help="finished rows (SQLite stops at 100000)")
    parser.add_argument("--peer-tasks", type=int, default=1000, help="tasks per worker-against-worker run")
    parser.add_argument("--sections", default="drain,enqueue,latency,peers,depth")
    parser.add_argument("--json", default=str(RESULTS / "latest.json"))
    args = parser.parse_args()

    console = Console()
    sections = set(args.sections.split(","))
    backends = [backend(name) for name in args.backends.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, Any] = {
        "machine": machine(),
        "drain": [],
        "enqueue": [],
        "latency": [],
        "peers": [],
        "depth": [],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    console.print(f"machine: {results['machine']}")

    if "drain" in sections:
        table = Table(
            title=f"drain throughput, tasks/s, {args.tasks} no-op tasks, median (min-max) of {args.repeats}"
        )
        for column in ("backend", "W", "B", "sa_taskqueue", "raw driver", "ratio", "exactly once"):
            table.add_column(column, justify="right")
        for target in backends:
            for w in workers:
                for b in batches:
                    ours, raw, once = [], [], True
                    for _ in range(args.repeats):
                        for implementation, sink in (("sa_taskqueue", ours), ("raw", raw)):
                            run = drain(implementation, target.url, args.tasks, w, b)
                            sink.append(run.rate)
                            once = once and run.exactly_once
                    row = {
                        "backend": target.name,
                        "workers": w,
                        "batch": b,
                        "sa_taskqueue": spread(ours),
                        "raw": spread(raw),
                        "ratio": statistics.median(ours) / statistics.median(raw),
                        "exactly_once": once,
                    }
                    results["drain"].append(row)
                    table.add_row(
                        target.name,
                        str(w),
                        str(b),
                        fmt(row["sa_taskqueue"]),
                        fmt(row["raw"]),
                        f"{row['ratio']:.0%}",
                        "yes" if once else "NO",
                    )
        console.print(table)

    if "enqueue" in sections:
        table = Table(title=f"enqueue throughput, tasks/s, {args.enqueue_tasks} tasks, one commit")
        for column in ("backend", "enqueue() loop", "enqueue_many()", "raw executemany", "bulk / raw"):
            table.add_column(column, justify="right")
        for target in backends:
            figures = {
                method: spread(
                    [enqueue_rate(method, target.url, args.enqueue_tasks) for _ in range(args.repeats)]
                )
                for method in ("enqueue", "enqueue_many", "raw")
            }
            ratio = figures["enqueue_many"]["median"] / figures["raw"]["median"]
            results["enqueue"].append({"backend": target.name, **figures, "bulk_ratio": ratio})
            table.add_row(
                target.name,
                fmt(figures["enqueue"]),
                fmt(figures["enqueue_many"]),
                fmt(figures["raw"]),
                f"{ratio:.0%}",
            )
        console.print(table)

    if "latency" in sections:
        table = Table(
            title=f"pickup latency, ms from commit() to the task's first line, {args.latency_samples} samples"
        )
        for column in ("backend", "wake-up", "p50", "p95", "p99"):
            table.add_column(column, justify="right")
        for target in backends:
            modes = (
                [("LISTEN/NOTIFY", True), ("polling (1 s max)", False)]
                if target.name == "postgres"
                else [("polling (1 s max)", False)]
            )
            for label, listen in modes:
                figure = percentiles(pickup_latency(target.url, listen, args.latency_samples))
                results["latency"].append({"backend": target.name, "mode": label, **figure})
                table.add_row(target.name, label, *(f"{figure[k]:.1f}" for k in ("p50", "p95", "p99")))
        console.print(table)

    if "peers" in sections:
        absent = missing_peers()
        postgres = [target for target in backends if target.name == "postgres"]
        if absent:
            console.print(f"peers: left out, not installed: {', '.join(absent)} (install '.[bench-peers]')")
        elif postgres:
            table = Table(
                title=f"worker drain on PostgreSQL, tasks/s, {args.peer_tasks} no-op tasks, "
                f"median (min-max) of {args.repeats}"
            )
            for column in ("W", "B", *IMPLEMENTATIONS, "sa_taskqueue vs best peer", "exactly once"):
                table.add_column(column, justify="right")
            for w in workers:
                for b in batches:
                    rates: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
                    once = True
                    for _ in range(args.repeats):
                        for name in IMPLEMENTATIONS:
                            run = worker_drain(name, postgres[0].url, args.peer_tasks, w, b)
                            rates[name].append(run.rate)
                            once = once and run.exactly_once
                    figures = {name: spread(values) for name, values in rates.items()}
                    best_peer = max(figures[name]["median"] for name in PEERS)
                    lead = figures["sa_taskqueue"]["median"] / best_peer
                    results["peers"].append(
                        {"workers": w, "batch": b, **figures, "vs_best_peer": lead, "exactly_once": once}
                    )
                    table.add_row(
                        str(w),
                        str(b),
                        *(fmt(figures[name]) for name in IMPLEMENTATIONS),
                        f"{lead:.2f}x",
                        "yes" if once else "NO",
                    )
            console.print(table)

    if "depth" in sections:
        table = Table(title="claim+complete latency, ms per batch of 10, W=4, 10,000 queued tasks")
        for column in ("backend", "finished rows", "p50", "p99", "p50 vs 0 rows"):
            table.add_column(column, justify="right")
        plans: dict[str, str] = {}
        for target in backends:
            base = None
            for depth in (int(d) for d in args.depths.split(",")):
                if target.name == "sqlite" and depth > 100_000:
                    continue
                figure = percentiles(claim_latencies(target.url, depth))
                base = base or figure["p50"]
                results["depth"].append(
                    {"backend": target.name, "finished": depth, **figure, "p50_ratio": figure["p50"] / base}
                )
                table.add_row(
                    target.name,
                    f"{depth:,}",
                    f"{figure['p50']:.2f}",
                    f"{figure['p99']:.2f}",
                    f"{figure['p50'] / base:.2f}x",
                )
            plans[target.name] = claim_plan(target.url)
        results["plans"] = plans
        console.print(table)
        for name, plan in plans.items():
            console.print(
                f"[bold]EXPLAIN of the claim on {name}[/bold] (with the last depth's rows in the table)"
            )
            console.print(plan, markup=False, highlight=False)

    results["seconds"] = time.perf_counter() - started
    Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    console.print(f"done in {results['seconds']:.0f}s; results in {args.json}")


if __name__ == "__main__":
    sys.exit(main())
