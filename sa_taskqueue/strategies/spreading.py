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
  tasks of other shares that this node would have taken before the oldest
  one it took last and that have waited `SpreadingOptions.grace` past that
  (of a better priority, due for the grace; of the same, due the grace
  before it), so a share whose node has no workers is served even while
  this node's own share never runs dry.

When: by default, from a claim's first certification conflict on, for
`SpreadingOptions.contended_for` after the last one.  Spreading gives up the
queue's one order (priority, then due time, then id) for an order per
share, so a node whose workers meet no other node's (the only node with
workers, or a cluster kept for failover) claims in the queue's order, with
the plain claim's statements, until another node's claims meet its own.
``SpreadingOptions(enabled=True)`` spreads every claim from the first.

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

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    or_,
    select,
    union_all,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError

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
BEHIND_NOW = "spread_behind_now"
#: The column a candidate's part comes in: `OWN` for its own share, else how many shares after it.
PART = "spread_part"
OWN = 0


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
    server is a node of a multi-primary cluster (`Backend.galera`), from a
    claim's first certification conflict on for ``contended_for`` (each
    conflict starts it again): workers of one node alone, meeting no other
    node's, claim in the queue's own order.  True spreads every claim
    wherever the server can name its node (`Backend.node_partition`); False
    never.  ``grace``: how long a task of another node's share may wait
    past its turn before this node takes it anyway.
    """

    enabled: bool | None = None
    contended_for: timedelta = timedelta(seconds=60)
    grace: timedelta = timedelta(seconds=5)

    def __post_init__(self) -> None:
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise TypeError(f"SpreadingOptions.enabled must be None, True or False, got {self.enabled!r}")
        for name in ("contended_for", "grace"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value < timedelta(0):
                raise ValueError(f"SpreadingOptions.{name} must be a timedelta, zero or more, not {value!r}")


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
        #: Until when (`time.monotonic`) claims spread by default: a certification conflict's time, and more.
        self._contended_until = -math.inf

    @contextmanager
    def watching(self, dialect: Dialect) -> Iterator[None]:
        """Within: a claim's transaction; a certification conflict that ends it has the claims spread."""
        try:
            yield
        except DBAPIError as error:
            if error.orig is not None and backend_for(dialect).certification_conflict(error.orig):
                self._contended_until = time.monotonic() + self.options.contended_for.total_seconds()
            raise

    @property
    def contended(self) -> bool:
        """Whether a claim of this strategy lost a certification conflict within `contended_for`."""
        return time.monotonic() < self._contended_until

    def partition(self, conn: Connection) -> NodePartition | None:
        """The node partition a claim on ``conn`` takes first, or None to claim as on one server.

        Costs no statement where spreading does not apply (a plain server, a
        Galera node without conflicts of late, or turned off); elsewhere one
        every `REFRESH_SECONDS` per connection.
        """
        enabled = self.options.enabled
        if enabled is False:
            return None
        backend = backend_for(conn.dialect)
        if enabled is None and not (backend.galera and self.contended):
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
            **victims(partition),
        }
        taker = _Taker(prepared, conn, table, request, params, partition.nodes)
        behind = self._sweep_due(key, request.now)
        if behind is not None:
            priority, run_at = behind
            extra = {
                BEHIND_PRIORITY: priority,
                BEHIND_RUN_AT: run_at,
                BEHIND_NOW: request.now - self.options.grace,
            }
            taker.take("behind", behind_select, extra)
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
        nodes: int,
    ) -> None:
        self.prepared = prepared
        self.nodes = nodes
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
        candidates: Callable[[Table, ClaimRequest, int], Select[Any] | CompoundSelect[Any]],
        extra: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Up to `wanted` rows of ``step``'s `WINDOW` candidates, locked; added to `rows` and returned."""
        table, request, shape = self.table, self.request, self.request.shape
        wanted = self.wanted
        nodes = self.nodes
        found = self.prepared(
            ("spread_candidates", step, shape, nodes), lambda: candidates(table, request, nodes)
        )
        values = {**self.params, **(extra or {}), LIMIT: wanted * WINDOW}
        # Own share first, then the shares after it in turn, each in the
        # order read (a step without parts after those).  (Rows this claim
        # locked already are still queued to a read: its locks are its own.)
        read = sorted(found.rows(self.conn, values), key=lambda row: row.get(PART, self.nodes))
        part = {row["id"]: row.get(PART, self.nodes) for row in read if row["id"] not in self._taken}
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


def stolen_select(table: Table, request: ClaimRequest, nodes: int) -> Select[Any] | CompoundSelect[Any]:
    """The ids of due rows of the other nodes' shares, each share from its back (reverse claim order).

    The nearest share after its own first (part 1), then the next (part 2),
    and so on: nodes whose own shares ran dry each steal from another share.
    Each share's ids are limited to the claim's limit.
    """
    parts = [
        select(table.c.id, literal_column(str(distance)).label(PART))
        .where(due_clause(table, request), _share(table) == bindparam(_victim(distance), type_=Integer()))
        .order_by(*(column.desc() for column in claim_order(table)))
        .limit(limit_param())
        for distance in range(1, nodes)
    ]
    return parts[0] if len(parts) == 1 else union_all(*parts)


def own_then_stolen_select(table: Table, request: ClaimRequest, nodes: int) -> CompoundSelect[Any]:
    """`own_select` and `stolen_select` at once, each row with its part (`OWN`, or its share's distance)."""
    own = own_select(table, request).add_columns(literal_column(str(OWN)).label(PART))
    stolen = stolen_select(table, request, nodes)
    return union_all(own, *(stolen.selects if isinstance(stolen, CompoundSelect) else [stolen]))


def _victim(distance: int) -> str:
    return f"spread_share_{distance}"


def victims(partition: NodePartition) -> dict[str, int]:
    """The values of `stolen_select`'s parameters: the share ``distance`` after the node's own, for each."""
    return {
        _victim(distance): (partition.index + distance) % partition.nodes
        for distance in range(1, partition.nodes)
    }


def behind_select(table: Table, request: ClaimRequest, nodes: int) -> Select[Any]:
    """The ids of due rows of the other shares that fell behind, in claim order (no locks).

    Behind: this node would have taken it before its own oldest, and it has
    waited `SpreadingOptions.grace` longer than that: of a better priority
    and due since the grace, or of the same and due the grace before it.
    """
    priority = bindparam(BEHIND_PRIORITY, type_=table.c.priority.type)
    fell_behind = and_(
        _not_own_share(table),
        or_(
            and_(
                table.c.priority < priority,
                table.c.run_at <= bindparam(BEHIND_NOW, type_=table.c.run_at.type),
            ),
            and_(
                table.c.priority == priority,
                table.c.run_at <= bindparam(BEHIND_RUN_AT, type_=table.c.run_at.type),
            ),
        ),
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
    "victims",
]
