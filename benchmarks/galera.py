"""Workers on a MariaDB Galera cluster: tasks/s, conflicts a thousand tasks, cost a task, by where they run.

Three worker processes of 4 slots each (``run_worker(concurrency=4,
burst=True)``, no-op tasks) drain the same no-op tasks, enqueued on the
first node, in each of these places:

- **one plain server**: the MariaDB the other sections use, not a cluster;
- **one Galera node**: a cluster of one node, all three workers on it;
- **3 nodes, workers on one**: a 3-node cluster, all three workers on node 0;
- **3 nodes, workers on all**: a 3-node cluster, one worker on each node.

The 3-node rows run three ways: the default (on a Galera node, claims
spread over the nodes from a worker's first certification conflict on),
``always`` (`SpreadingOptions` ``enabled=True``: each node's workers take
their own share first from the first claim) and ``off`` (``enabled=False``:
every worker races for the head of the queue, as on one server).  The plain
server runs with the default, and with spreading turned off: the two must
send the same statements a task.

Conflicts are the cluster's own count, summed over its nodes: transactions
that failed certification (``wsrep_local_cert_failures``) or were aborted
for a replicated write that needed their locks (``wsrep_local_bf_aborts``).
Costs are as in the other sections (`benchmarks.costs`), summed over the
nodes: the workers' CPU, every node's ``mariadbd`` CPU, the statements the
nodes were sent (``Questions``; the plain server's count includes any other
client's).  All nodes and workers share this machine's cores, so a cluster
row's rate says what the machine can do, not what three machines would.

The clusters are started here (``tests.galera``, from Debian's ``mariadbd``
and ``galera-4``) and stopped afterwards; where they cannot be started the
section says why and is left out.  Not run by default: ``--sections galera``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from benchmarks.backends import fresh_table
from benchmarks.clients import LEASE
from benchmarks.costs import Meter, Usage
from benchmarks.drain import _timed, seed

#: Worker processes and slots each, as in a first try of a cluster: one worker of 4 on each of 3 nodes.
WORKERS = 3
SLOTS = 4

#: Each place: its name, the cluster's size (0: the plain server), and the node each worker is on.
PLACES: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("one plain server", 0, (0, 0, 0)),
    ("one Galera node", 1, (0, 0, 0)),
    ("3 nodes, workers on one", 3, (0, 0, 0)),
    ("3 nodes, workers on all", 3, (0, 1, 2)),
)
#: How each place runs: the spreading option (None: the default), and its label.
ON, OFF, DEFAULT = True, False, None
CONFLICTS = sa.text(
    "SELECT COALESCE(SUM(VARIABLE_VALUE), 0) FROM information_schema.GLOBAL_STATUS"
    " WHERE VARIABLE_NAME IN ('WSREP_LOCAL_CERT_FAILURES', 'WSREP_LOCAL_BF_ABORTS')"
)


@dataclass
class GaleraRun:
    """One drain: how long, how many ran, whether each once, and what it cost."""

    seconds: float
    tasks: int
    exactly_once: bool
    conflicts: int
    client_cpu: float
    usage: Usage

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds

    def per_task(self, total: float | None, scale: float) -> float | None:
        return None if total is None or not self.tasks else total / self.tasks * scale


def _worker(url: str, spreading: bool | None, ready: Any, go: Any, results: Any) -> None:
    import sa_taskqueue as tq
    from sa_taskqueue.strategies import SkipLockedStrategy, SpreadingOptions

    ran: list[int] = []
    stamps: list[float] = []

    def noop(n: int) -> None:
        ran.append(n)
        stamps.append(time.perf_counter())

    engine = sa.create_engine(url)
    strategy = SkipLockedStrategy(spreading=SpreadingOptions(enabled=spreading))
    queue = tq.TaskQueue(engine, strategy=strategy, lease=LEASE)
    queue.task(name="noop")(noop)
    queue.strategy  # noqa: B018 - connect and pick the strategy before the clock starts
    ready.release()
    go.wait()
    queue.run_worker(concurrency=SLOTS, burst=True, poll_interval=0.05)
    queue.close()
    engine.dispose()
    results.put((ran, max(stamps, default=0.0)))


def _scalar(url: str, statement: Any, *, sync: bool = False) -> int:
    """One number read on ``url``'s server; ``sync`` waits for the node to apply every earlier write."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if sync:
                conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 1")
            return int(conn.execute(statement).scalar() or 0)
    finally:
        engine.dispose()


def conflicts(urls: list[str]) -> int:
    """The transactions every node failed at certification or aborted for a replicated write, so far."""
    return sum(_scalar(url, CONFLICTS) for url in urls)


def _not_completed(url: str, cluster: bool) -> int:
    import sa_taskqueue as tq

    table = tq.Task.__table__
    query = sa.select(sa.func.count()).select_from(table).where(table.c.status != tq.TaskStatus.COMPLETED)
    return _scalar(url, query, sync=cluster)


def drain_on(
    nodes: list[str], places: tuple[int, ...], tasks: int, spreading: bool | None, *, cluster: bool
) -> GaleraRun:
    """``tasks`` no-op tasks enqueued on ``nodes[0]``, run by a worker on ``nodes[i]`` per i in ``places``.

    ``cluster``: the nodes are a Galera cluster's, whose conflicts are counted.
    """
    fresh_table(nodes[0])
    seed(nodes[0], tasks, numbered=True)
    for url in nodes:  # every node has the seed applied before the clock starts
        _not_completed(url, cluster)
    before = conflicts(nodes) if cluster else 0
    context = multiprocessing.get_context("spawn")
    ready = context.Semaphore(0)
    go = context.Event()
    results = context.Queue()
    processes = [
        context.Process(target=_timed, args=(_worker, (nodes[place], spreading), ready, go, results))
        for place in places
    ]
    with contextlib.ExitStack() as stack:
        meters = [stack.enter_context(Meter(url)) for url in nodes]
        for process in processes:
            process.start()
        for _ in processes:
            ready.acquire()
        for meter in meters:
            meter.start()
        started = time.perf_counter()
        go.set()
        timed = [results.get(timeout=900) for _ in processes]
        usages = [meter.stop() for meter in meters]
    for process in processes:
        process.join()
    done = [n for (ran, _last), _cpu in timed for n in ran]
    finished = max(last for (_ran, last), _cpu in timed)
    return GaleraRun(
        seconds=max(finished - started, 1e-9),
        tasks=len(done),
        exactly_once=len(done) == tasks
        and len(set(done)) == tasks
        and _not_completed(nodes[0], cluster) == 0,
        conflicts=(conflicts(nodes) - before) if cluster else 0,
        client_cpu=sum(cpu for _outcome, cpu in timed),
        usage=_summed(usages),
    )


def _summed(usages: list[Usage]) -> Usage:
    def total(values: list[Any]) -> Any:
        return None if any(value is None for value in values) else sum(values)

    return Usage(
        server_cpu=total([usage.server_cpu for usage in usages]),
        statements=total([usage.statements for usage in usages]),
        notes=frozenset().union(*(usage.notes for usage in usages)),
    )


def row(place: str, spreading: bool | None, runs: list[GaleraRun], cluster: bool) -> dict[str, Any]:
    """A place's figures over its runs: medians, with the rate's min and max."""
    rates = [run.rate for run in runs]

    def median(values: list[float | None]) -> float | None:
        return None if any(value is None for value in values) else statistics.median(values)  # type: ignore[type-var]

    return {
        "place": place,
        "spreading": {ON: "always", OFF: "off", DEFAULT: "default"}[spreading],
        "tasks_per_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)},
        "conflicts_per_1000": median([run.conflicts * 1000 / run.tasks for run in runs]) if cluster else None,
        "client_us": median([run.per_task(run.client_cpu, 1e6) for run in runs]),
        "server_us": median([run.per_task(run.usage.server_cpu, 1e6) for run in runs]),
        "statements": median([run.per_task(run.usage.statements, 1) for run in runs]),
        "exactly_once": all(run.exactly_once for run in runs),
        "notes": sorted(set().union(*(run.usage.notes for run in runs))),
    }


@contextlib.contextmanager
def cluster_of(nodes: int) -> Iterator[list[str]]:
    """A running Galera cluster of ``nodes`` nodes (`tests.galera`), stopped afterwards: its URLs."""
    from tests.galera import galera_cluster

    with galera_cluster(nodes) as cluster:
        yield cluster.urls


def galera_rows(plain_url: str, tasks: int, repeats: int) -> Iterator[dict[str, Any]]:
    """Every place's row, the cluster rows with and without spreading, taking turns within each repeat."""
    plain = [("one plain server", DEFAULT, (0, 0, 0)), ("one plain server", OFF, (0, 0, 0))]
    yield from _rows([plain_url], plain, tasks, repeats, cluster=False)
    for size in (1, 3):
        places = [
            (name, spreading, where)
            for name, nodes, where in PLACES
            if nodes == size
            # (One node has no other to spread over: the default is all there is.)
            for spreading in ((DEFAULT, ON, OFF) if size > 1 else (DEFAULT,))
        ]
        with cluster_of(size) as urls:
            yield from _rows(urls, places, tasks, repeats, cluster=True)


def _rows(
    urls: list[str],
    places: list[tuple[str, bool | None, tuple[int, ...]]],
    tasks: int,
    repeats: int,
    *,
    cluster: bool,
) -> Iterator[dict[str, Any]]:
    runs: dict[int, list[GaleraRun]] = {index: [] for index in range(len(places))}
    for _ in range(repeats):
        for index, (_name, spreading, where) in enumerate(places):
            runs[index].append(drain_on(urls, where, tasks, spreading, cluster=cluster))
    for index, (name, spreading, _where) in enumerate(places):
        yield row(name, spreading, runs[index], cluster)


__all__ = ["PLACES", "SLOTS", "WORKERS", "GaleraRun", "conflicts", "drain_on", "galera_rows", "row"]
