"""Claims spread over the nodes of a multi-primary cluster, so that workers on two nodes rarely want one row.

On a MariaDB Galera cluster every node takes writes, but a row lock is
local to the node that took it: a worker on node A and a worker on node B
can both lock the same due row with ``FOR UPDATE SKIP LOCKED``, and the
cluster settles it at commit (certification), failing the later transaction
as a deadlock.  Retrying that costs a whole claim; workers on every node
racing for the head of one queue lose most of their claims.

So each node takes its own share of the candidates first.  The share is the
task's id (over the step the ids are handed out in) modulo the number of
nodes (`NodePartition`): with ids handed out in turn, each node's share is
as large as any other's, and one node's workers never lock a row of another
node's share while both have work.  Within a node, SKIP LOCKED keeps its
workers apart as on one server.  No task is left
to a node without workers:

- **own first**: up to the claim's limit from the node's own share, in claim order;
- **then steal from the back**: when its own share has fewer, the rest from
  the other shares in reverse claim order, the end their own nodes reach
  last, so a node that is done helps the others without meeting their
  workers until the last few tasks;
- **and sweep what fell behind**: at most once a second a claim first takes
  tasks of other shares due `SpreadingOptions.grace` before the oldest one
  this node took last (and no later in priority), so a share whose node has
  no workers is served even while this node's own share never runs dry.

A node's index and the cluster's size come from the server the connection
is on (`Backend.node_partition`), read again every `REFRESH_SECONDS`: a
node leaving or joining renumbers the others, and a stale figure only costs
conflicts until the next read.  Which rows a node takes is a choice of the
claim, never a promise: any node may take any task, so exactly-once rests on
the claim's locks and the cluster's certification as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Integer, Select, Table, and_, bindparam, func, select

from sa_taskqueue.backends import backend_for
from sa_taskqueue.strategies.claiming import (
    LIMIT,
    ClaimRequest,
    claim_order,
    due_clause,
    due_select,
    limit_param,
    read_back,
)
from sa_taskqueue.strategies.prepared import PreparedStatement

#: Seconds a connection's node partition is trusted before it is read again.
REFRESH_SECONDS = 10.0
#: How often a claim sweeps the other shares for tasks that fell behind.
SWEEP_EVERY = timedelta(seconds=1)
#: Where a connection keeps its node partition and when it was read (`Connection.info`).
_KEPT_AS = "sa_taskqueue_node_partition"

# The spreading claim's parameters.
NODES = "spread_nodes"
NODE = "spread_node"
STEP = "spread_step"
BEHIND_PRIORITY = "spread_behind_priority"
BEHIND_RUN_AT = "spread_behind_run_at"


@dataclass(frozen=True)
class NodePartition:
    """Which share of the tasks a node takes first: those whose ``id // step`` modulo ``nodes`` is ``index``.

    ``step`` is the distance between ids one node hands out in turn: on a
    cluster numbering each node's rows from its own offset, the ids of one
    node's rows are all alike modulo the cluster size, and would all fall in
    one share without it.
    """

    index: int
    nodes: int
    step: int = 1


@dataclass(frozen=True)
class SpreadingOptions:
    """How a claim spreads over a cluster's nodes.

    ``enabled``: None (the default) spreads where the backend says the
    server is a node of a multi-primary cluster (`Backend.galera`); True
    wherever the server can name its node (`Backend.node_partition`); False
    never.  ``grace``: how much longer than this node's own oldest task a
    task of another node's share waits before this node takes it anyway.
    """

    enabled: bool | None = None
    grace: timedelta = timedelta(seconds=5)

    def __post_init__(self) -> None:
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise TypeError(f"SpreadingOptions.enabled must be None, True or False, got {self.enabled!r}")
        if not isinstance(self.grace, timedelta) or self.grace < timedelta(0):
            raise ValueError(f"SpreadingOptions.grace must be a timedelta, zero or more, not {self.grace!r}")


PreparedFor = Callable[[tuple[Any, ...], Callable[[], Any]], PreparedStatement]


class NodeSpreading:
    """The spreading part of one strategy: when it applies, and which rows a claim locks.

    Keeps, per claim shape, the oldest task this node took last and when it
    last swept the other shares; threads share it (a lost update only moves
    a sweep by one claim).
    """

    def __init__(self, options: SpreadingOptions | None = None) -> None:
        self.options = options or SpreadingOptions()
        self._heads: dict[Any, tuple[int, datetime]] = {}
        self._next_sweep: dict[Any, datetime] = {}
        self._lock = threading.Lock()

    def partition(self, conn: Connection) -> NodePartition | None:
        """The node partition a claim on ``conn`` takes first, or None to claim as on one server.

        Costs no statement where spreading does not apply (a plain server,
        or turned off); elsewhere one every `REFRESH_SECONDS` per connection.
        """
        enabled = self.options.enabled
        if enabled is False:
            return None
        backend = backend_for(conn.dialect)
        if enabled is None and not getattr(backend, "galera", False):
            return None
        kept = conn.info.get(_KEPT_AS)
        now = time.monotonic()
        if kept is None or now - kept[1] > REFRESH_SECONDS:
            found = backend.node_partition(conn)
            kept = (NodePartition(*found) if found is not None else None, now)
            conn.info[_KEPT_AS] = kept
        partition: NodePartition | None = kept[0]
        return partition if partition is not None and partition.nodes > 1 else None

    def locked_rows(
        self,
        prepared: PreparedFor,
        conn: Connection,
        table: Table,
        request: ClaimRequest,
        partition: NodePartition,
    ) -> list[dict[str, Any]]:
        """Lock up to ``request.limit`` due rows, this node's share first (see the module); the rows, whole.

        ``prepared(name, build)`` gives the compiled statement ``name``.  The
        rows are locked in the caller's transaction, for its UPDATE.
        """
        key = (request.queues, request.names, request.paused)
        params = {
            **request.params(),
            NODES: partition.nodes,
            NODE: partition.index,
            STEP: partition.step,
        }
        shape = request.shape
        rows: list[dict[str, Any]] = []
        swept = False
        behind = self._sweep_due(key, request.now)
        if behind is not None:
            priority, run_at = behind
            sweep = prepared(("spread_sweep", shape), lambda: behind_select(table, request))
            rows = sweep.rows(conn, {**params, BEHIND_PRIORITY: priority, BEHIND_RUN_AT: run_at})
            swept = bool(rows)
        wanted = request.limit - len(rows)
        if wanted > 0:
            statement = prepared(("spread_own", shape), lambda: own_select(table, request))
            own = statement.rows(conn, {**params, LIMIT: wanted})
            rows += own
            self._note_head(key, own)
        wanted = request.limit - len(rows)
        # (Not after a sweep that took rows: its rows are this transaction's
        # own locks, which SKIP LOCKED does not skip, so they would come twice.)
        if wanted > 0 and not swept:
            steal = prepared(("spread_steal", shape), lambda: stolen_select(table, request))
            rows += steal.rows(conn, {**params, LIMIT: wanted})
        return rows

    def _sweep_due(self, key: Any, now: datetime) -> tuple[int, datetime] | None:
        """Where a sweep looks now (the oldest own task's priority, less the grace its run_at), or None."""
        with self._lock:
            head = self._heads.get(key)
            if head is None:
                return None
            due = self._next_sweep.get(key)
            if due is not None and due - SWEEP_EVERY <= now < due:
                return None
            self._next_sweep[key] = now + SWEEP_EVERY
        priority, run_at = head
        return priority, run_at - self.options.grace

    def _note_head(self, key: Any, own: list[dict[str, Any]]) -> None:
        with self._lock:
            if not own:
                # (Its own share ran dry: every claim steals now, no sweep needed.)
                self._heads.pop(key, None)
                return
            self._heads[key] = min((row["priority"], row["run_at"]) for row in own)


def _share(table: Table) -> Any:
    step = bindparam(STEP, type_=Integer())
    return func.mod(table.c.id // step, bindparam(NODES, type_=Integer()))


def _not_own_share(table: Table) -> Any:
    return _share(table) != bindparam(NODE, type_=Integer())


def own_select(table: Table, request: ClaimRequest) -> Select[Any]:
    """Due rows of this node's share in claim order, locked, skipping locked ones, limited."""
    query = due_select(table, request, *read_back(table)).where(
        _share(table) == bindparam(NODE, type_=Integer())
    )
    return query.limit(limit_param()).with_for_update(skip_locked=True)


def stolen_select(table: Table, request: ClaimRequest) -> Select[Any]:
    """Due rows of the other nodes' shares in reverse claim order, locked, skipping locked ones, limited."""
    query = (
        select(*read_back(table))
        .where(due_clause(table, request), _not_own_share(table))
        .order_by(*(column.desc() for column in claim_order(table)))
    )
    return query.limit(limit_param()).with_for_update(skip_locked=True)


def behind_select(table: Table, request: ClaimRequest) -> Select[Any]:
    """Due rows of the other shares that fell behind this node's own oldest, in claim order, locked.

    Behind: no later in priority, and due `SpreadingOptions.grace` before it.
    """
    fell_behind = and_(
        _not_own_share(table),
        table.c.priority <= bindparam(BEHIND_PRIORITY, type_=table.c.priority.type),
        table.c.run_at <= bindparam(BEHIND_RUN_AT, type_=table.c.run_at.type),
    )
    query = due_select(table, request, *read_back(table)).where(fell_behind)
    return query.limit(limit_param()).with_for_update(skip_locked=True)


__all__ = [
    "REFRESH_SECONDS",
    "SWEEP_EVERY",
    "NodePartition",
    "NodeSpreading",
    "SpreadingOptions",
    "behind_select",
    "own_select",
    "stolen_select",
]
