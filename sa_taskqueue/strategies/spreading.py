"""Claims spread over the nodes of a multi-primary cluster, so that workers on two nodes rarely want one row.

On a MariaDB Galera cluster every node takes writes, but a row lock is
local to the node that took it: a worker on node A and a worker on node B
can both lock the same due row with ``FOR UPDATE SKIP LOCKED``, and the
cluster settles it at commit (certification), failing one of the two
transactions as a deadlock, to be retried.  Workers on every node racing
for the head of one queue meet there.

So each node takes its own share of the candidates first.  The share is the
task's id (over the step the ids are handed out in) modulo the number of
nodes (`NodePartition`): with ids handed out in turn, each node's share is
as large as any other's, and one node's workers never lock a row of another
node's share while both have work.  Within a node, SKIP LOCKED keeps its
workers apart as on one server.  No task is left to a node without workers:

- **own first**: up to the claim's limit from the node's own share, in claim order;
- **then steal from the back**: when its own share has fewer, the rest from
  the other shares in reverse claim order, the end their own nodes reach
  last, so a node that is done helps the others without meeting their
  workers until the last few tasks.  (Both are read in one statement.  A
  node whose own share was dry while the others' were not steals alone for
  `DRY_FOR` before it looks at its own again: finding none of its own
  walks the whole queue.)
- **and sweep what fell behind**: at most once a second a claim first takes
  tasks of other shares due `SpreadingOptions.grace` before the oldest one
  this node took last (and no later in priority), so a share whose node has
  no workers is served even while this node's own share never runs dry.

Each step reads its candidates without locks, then locks those by id
(`_Taker`): a locking read would lock every row it walks past in the claim
index, other shares' too, and a write replicated from another node that
meets such a lock aborts the transaction holding it.  So a claim here is
three statements (read, lock, update) where the plain one is two.

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

from sqlalchemy import (
    CompoundSelect,
    Connection,
    Integer,
    Select,
    Table,
    and_,
    bindparam,
    func,
    literal_column,
    select,
    union_all,
)

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
#: How many candidates a step of a claim reads for each row it wants: a
#: worker of the same node may hold some of the first ones.
WINDOW = 2
#: How often a claim sweeps the other shares for tasks that fell behind.
SWEEP_EVERY = timedelta(seconds=1)
#: How long a claim that found its own share dry, and the others' not, steals without looking at its own.
DRY_FOR = timedelta(seconds=1)
#: Where a connection keeps its node partition and when it was read (`Connection.info`).
_KEPT_AS = "sa_taskqueue_node_partition"

# The spreading claim's parameters.
NODES = "spread_nodes"
NODE = "spread_node"
STEP = "spread_step"
BEHIND_PRIORITY = "spread_behind_priority"
BEHIND_RUN_AT = "spread_behind_run_at"
#: The column a candidate's part comes in, and the parts: its own share, or another's.
PART = "spread_part"
OWN, STOLEN = 0, 1


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
        self._dry_until: dict[Any, datetime] = {}
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
        taker = _Taker(prepared, conn, table, request, params)
        behind = self._sweep_due(key, request.now)
        if behind is not None:
            priority, run_at = behind
            taker.take("behind", behind_select, {BEHIND_PRIORITY: priority, BEHIND_RUN_AT: run_at})
        if taker.wanted > 0 and self._dry(key, request.now):
            taker.take("stolen", stolen_select)
        elif taker.wanted > 0:
            # Its own share's candidates and the others' from the back, read at once.
            got = taker.take("own_then_stolen", own_then_stolen_select)
            own = [row for row in got if row[PART] == OWN]
            self._note_own(key, request.now, taker.own_candidates, own, stolen=len(got) - len(own))
        for row in taker.rows:
            row.pop(PART, None)
        return taker.rows

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

    def _dry(self, key: Any, now: datetime) -> bool:
        """Whether its own share was found dry, while the others' had work, less than `DRY_FOR` ago."""
        with self._lock:
            until = self._dry_until.get(key)
            return until is not None and until - DRY_FOR <= now < until

    def _note_own(
        self, key: Any, now: datetime, candidates: int, own: list[dict[str, Any]], *, stolen: int
    ) -> None:
        """What a claim found of its own share: the oldest it took, or that it found none."""
        with self._lock:
            if candidates:
                self._dry_until.pop(key, None)
                if own:
                    self._heads[key] = min((row["priority"], row["run_at"]) for row in own)
                return
            # Its own share ran dry: every claim steals now, no sweep needed.
            self._heads.pop(key, None)
            if stolen:
                # Finding none of its own walked the whole queue in the claim
                # index: while the others' shares keep it busy, look again
                # only after a while (with the queue empty, at every claim).
                self._dry_until[key] = now + DRY_FOR


class _Taker:
    """One claim's rows, taken in steps: each step reads candidates, then locks those by id.

    The candidates are read without locks (a consistent read of the latest
    committed rows) and only then locked, by id.  A locking read would lock
    every row it walks past on its way through the claim index, other
    nodes' shares among them (InnoDB keeps them, even those the WHERE then
    turns down), and a write replicated from another node that meets such a
    lock aborts the transaction holding it: the very conflict the shares are
    there to avoid.  The lock rechecks that each row is still due and skips
    those another transaction holds.
    """

    def __init__(
        self,
        prepared: PreparedFor,
        conn: Connection,
        table: Table,
        request: ClaimRequest,
        params: dict[str, Any],
    ) -> None:
        self.prepared = prepared
        self.conn = conn
        self.table = table
        self.request = request
        self.params = params
        self.rows: list[dict[str, Any]] = []
        #: How many of its own share's rows the last step read.
        self.own_candidates = 0
        self._taken: set[int] = set()

    @property
    def wanted(self) -> int:
        return self.request.limit - len(self.rows)

    def take(
        self,
        step: str,
        candidates: Callable[[Table, ClaimRequest], Select[Any] | CompoundSelect[Any]],
        extra: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Up to `wanted` rows of ``step``'s `WINDOW` candidates, locked; added to `rows` and returned."""
        table, request, shape = self.table, self.request, self.request.shape
        wanted = self.wanted
        found = self.prepared(("spread_candidates", step, shape), lambda: candidates(table, request))
        values = {**self.params, **(extra or {}), LIMIT: wanted * WINDOW}
        # Own share first, each part in the order read.  (Rows this claim
        # locked already are still queued to a read: its locks are its own.)
        read = sorted(found.rows(self.conn, values), key=lambda row: row.get(PART, STOLEN))
        part = {row["id"]: row.get(PART, STOLEN) for row in read if row["id"] not in self._taken}
        self.own_candidates = sum(1 for value in part.values() if value == OWN)
        window = list(part)
        got: list[dict[str, Any]] = []
        start = 0
        while len(got) < wanted and start < len(window):
            chunk = window[start : start + wanted - len(got)]
            start += len(chunk)
            lock = self.prepared(
                ("spread_lock", len(chunk), shape), _lock_builder(table, request, len(chunk))
            )
            ids = dict(zip(_id_params(len(chunk)), chunk, strict=True))
            got += lock.rows(self.conn, {**request.params(), **ids})
        place = {task_id: index for index, task_id in enumerate(window)}
        got.sort(key=lambda row: place[row["id"]])
        for row in got:
            row[PART] = part[row["id"]]
        self._taken.update(row["id"] for row in got)
        self.rows += got
        return got


def _id_params(count: int) -> list[str]:
    return [f"spread_id_{index}" for index in range(count)]


def _lock_builder(table: Table, request: ClaimRequest, count: int) -> Callable[[], Select[Any]]:
    return lambda: locking_by_ids(table, request, count)


def locking_by_ids(table: Table, request: ClaimRequest, count: int) -> Select[Any]:
    """The rows of ``count`` ids (bound one parameter each) that are still due, locked, skipping locked ones.

    Found by primary key alone, so the lock touches no row but these.
    """
    ids = [bindparam(name, type_=table.c.id.type) for name in _id_params(count)]
    query = select(*read_back(table)).where(table.c.id.in_(ids), due_clause(table, request))
    return query.with_for_update(skip_locked=True)


def _share(table: Table) -> Any:
    step = bindparam(STEP, type_=Integer())
    return func.mod(table.c.id // step, bindparam(NODES, type_=Integer()))


def _not_own_share(table: Table) -> Any:
    return _share(table) != bindparam(NODE, type_=Integer())


def own_select(table: Table, request: ClaimRequest) -> Select[Any]:
    """The ids of due rows of this node's share, in claim order, limited (no locks)."""
    query = due_select(table, request, table.c.id).where(_share(table) == bindparam(NODE, type_=Integer()))
    return query.limit(limit_param())


def stolen_select(table: Table, request: ClaimRequest) -> Select[Any]:
    """The ids of due rows of the other nodes' shares, in reverse claim order, limited (no locks)."""
    query = (
        select(table.c.id)
        .where(due_clause(table, request), _not_own_share(table))
        .order_by(*(column.desc() for column in claim_order(table)))
    )
    return query.limit(limit_param())


def own_then_stolen_select(table: Table, request: ClaimRequest) -> CompoundSelect[Any]:
    """`own_select` and `stolen_select` in one statement, each row with its part (`OWN` or `STOLEN`)."""
    return union_all(
        own_select(table, request).add_columns(literal_column(str(OWN)).label(PART)),
        stolen_select(table, request).add_columns(literal_column(str(STOLEN)).label(PART)),
    )


def behind_select(table: Table, request: ClaimRequest) -> Select[Any]:
    """The ids of due rows of the other shares that fell behind this node's own oldest, in claim order.

    Behind: no later in priority, and due `SpreadingOptions.grace` before it.
    """
    fell_behind = and_(
        _not_own_share(table),
        table.c.priority <= bindparam(BEHIND_PRIORITY, type_=table.c.priority.type),
        table.c.run_at <= bindparam(BEHIND_RUN_AT, type_=table.c.run_at.type),
    )
    return due_select(table, request, table.c.id).where(fell_behind).limit(limit_param())


__all__ = [
    "REFRESH_SECONDS",
    "SWEEP_EVERY",
    "NodePartition",
    "NodeSpreading",
    "SpreadingOptions",
    "behind_select",
    "locking_by_ids",
    "own_select",
    "own_then_stolen_select",
    "stolen_select",
]
