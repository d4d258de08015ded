"""Claims spread over a cluster's nodes: which rows each node's claim locks, on a real server.

A node's share is found from the server it is on; here, on one MariaDB or
MySQL server, the share is given, and the statements the spreading claim
sends run for real: own share first in claim order, the others' from the
back when it runs dry, the others' that fell behind on a sweep, rows locked
by another transaction skipped.  On a server that is no cluster node the
claim sends exactly what it sent before.  The live cluster's tests are in
``tests/test_spreading_cluster.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa

import sa_taskqueue as tq
from sa_taskqueue.backends import backend_for
from sa_taskqueue.strategies import SkipLockedStrategy, SpreadingOptions
from sa_taskqueue.strategies.claiming import ClaimRequest
from sa_taskqueue.strategies.spreading import NodePartition
from tests.app import make_queue
from tests.helpers import MovableClock, statements_sent
from tests.helpers import enqueue_records as enqueue

pytestmark = pytest.mark.backends("mariadb", "mysql")

TABLE = tq.Task.__table__


@pytest.fixture
def strategy() -> Iterator[SkipLockedStrategy]:
    strategy = SkipLockedStrategy(spreading=SpreadingOptions(enabled=True, grace=timedelta(seconds=5)))
    yield strategy
    strategy.close()


def share(task_id: int, partition: NodePartition) -> int:
    return (task_id // partition.step) % partition.nodes


def node_of(engine: sa.Engine, task_id: int) -> NodePartition:
    """The node of three whose share ``task_id`` is in, ids stepping as the server hands them out."""
    step = stride(engine)
    return NodePartition(index=(task_id // step) % 3, nodes=3, step=step)


def stride(engine: sa.Engine) -> int:
    """How far apart the ids of rows inserted one after another on ``engine``'s server are."""
    with engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT @@auto_increment_increment").scalar_one())


def stolen_order(ids: list[int], partition: NodePartition) -> list[int]:
    """The order a node steals ``ids`` of other shares in: the next share's from its back, then the next's."""
    return [
        task_id
        for distance in range(1, partition.nodes)
        for task_id in sorted(ids, reverse=True)
        if share(task_id, partition) == (partition.index + distance) % partition.nodes
    ]


def claim_as_node(
    strategy: SkipLockedStrategy,
    engine: sa.Engine,
    partition: NodePartition,
    limit: int,
    clock: MovableClock,
) -> list[int]:
    """The ids a claim of node ``partition`` locks (in the order it locks them), then rolled back."""
    now = clock.now()
    request = ClaimRequest(
        limit=limit, queues=None, worker_id="w", now=now, lease_until=now + timedelta(minutes=1)
    )
    with engine.connect() as conn, conn.begin() as transaction:
        backend_for(conn.dialect).begin_locking_reads(conn)
        rows = strategy.spreading.locked_rows(
            lambda name, build: strategy.executor.prepared(name, conn.dialect, TABLE, build),
            conn,
            TABLE,
            request,
            partition,
        )
        transaction.rollback()
    return [row["id"] for row in rows]


def test_a_node_takes_its_own_share_first_in_claim_order(
    engine: sa.Engine, strategy: SkipLockedStrategy, clock: MovableClock
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5), clock.now)
    ids = enqueue(queue, engine, 12)
    partition = node_of(engine, ids[0])
    own = [task_id for task_id in ids if share(task_id, partition) == partition.index]
    assert len(own) == 4
    assert claim_as_node(strategy, engine, partition, 3, clock) == own[:3]


def test_ids_spread_over_the_shares_by_the_step_the_server_hands_them_out_in(
    engine: sa.Engine, strategy: SkipLockedStrategy, clock: MovableClock
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5), clock.now)
    ids = enqueue(queue, engine, 9)
    step = stride(engine)
    assert [b - a for a, b in itertools.pairwise(ids)] == [step] * 8
    by_share = [
        [task_id for task_id in ids if share(task_id, NodePartition(n, 3, step)) == n] for n in range(3)
    ]
    assert [len(own) for own in by_share] == [3, 3, 3]
    if step > 1:
        # (A Galera node steps by the cluster's size: modulo the size alone, one share would hold them all.)
        assert len({task_id % 3 for task_id in ids}) == 1
    partition = node_of(engine, ids[0])
    assert claim_as_node(strategy, engine, partition, 3, clock) == by_share[partition.index]


def test_a_node_whose_share_ran_dry_takes_the_others_from_the_back(
    engine: sa.Engine, strategy: SkipLockedStrategy, clock: MovableClock
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5), clock.now)
    ids = enqueue(queue, engine, 9)
    partition = node_of(engine, ids[0])
    own = [task_id for task_id in ids if share(task_id, partition) == partition.index]
    others = stolen_order(ids, partition)
    assert len(others) == 6
    assert claim_as_node(strategy, engine, partition, len(own) + 2, clock) == own + others[:2]


def test_a_node_whose_share_ran_dry_while_others_had_work_looks_at_its_own_again_a_second_later(
    engine: sa.Engine, strategy: SkipLockedStrategy, clock: MovableClock
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5), clock.now)
    ids = enqueue(queue, engine, 6)
    partition = node_of(engine, ids[0])
    with engine.begin() as conn:
        conn.execute(TABLE.delete().where(_share_is(partition)))
    others = stolen_order(ids, partition)
    assert claim_as_node(strategy, engine, partition, 1, clock) == others[:1]
    later = enqueue(queue, engine, 3)
    [new_own] = [task_id for task_id in later if share(task_id, partition) == partition.index]
    # Its own share was dry and the others' were not: for a second it only steals.
    first_stolen = stolen_order([*ids, *later], partition)[0]
    assert claim_as_node(strategy, engine, partition, 1, clock) == [first_stolen]
    clock.advance(timedelta(seconds=1))
    assert claim_as_node(strategy, engine, partition, 1, clock) == [new_own]


def test_a_node_that_found_nothing_anywhere_looks_at_its_own_share_at_the_next_claim(
    engine: sa.Engine, strategy: SkipLockedStrategy, clock: MovableClock
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5), clock.now)
    assert claim_as_node(strategy, engine, node_of(engine, 0), 1, clock) == []
    ids = enqueue(queue, engine, 3)
    partition = node_of(engine, ids[-1])
    assert claim_as_node(strategy, engine, partition, 1, clock) == ids[-1:]


def test_rows_another_transaction_holds_are_skipped_in_every_share(
    engine: sa.Engine, strategy: SkipLockedStrategy, clock: MovableClock
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5), clock.now)
    ids = enqueue(queue, engine, 9)
    partition = node_of(engine, ids[0])
    own = [task_id for task_id in ids if share(task_id, partition) == partition.index]
    others = stolen_order(ids, partition)
    held = [own[0], others[0]]
    with engine.connect() as holder, holder.begin():
        backend_for(holder.dialect).begin_locking_reads(holder)
        for task_id in held:
            # One primary-key lookup a row: a locking read of ``id IN (...)``
            # may scan a covering secondary index instead, when the table's
            # statistics are not yet refreshed, and InnoDB then keeps a lock
            # on every row that scan passed, even at READ COMMITTED.
            holder.execute(sa.select(TABLE.c.id).where(TABLE.c.id == task_id).with_for_update())
        taken = claim_as_node(strategy, engine, partition, len(ids), clock)
    assert taken == own[1:] + others[1:]
    assert not set(taken) & set(held)


def test_a_sweep_takes_the_others_tasks_that_fell_behind_before_its_own(
    engine: sa.Engine, strategy: SkipLockedStrategy, clock: MovableClock
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5), clock.now)
    start = clock.now()
    old = enqueue(queue, engine, 6, run_at=start - timedelta(minutes=1))
    recent = enqueue(queue, engine, 6, run_at=start)
    partition = node_of(engine, recent[0])
    old_own = [task_id for task_id in old if share(task_id, partition) == partition.index]
    with engine.begin() as conn:
        # This node's share has only recent tasks; the others' have old ones too.
        conn.execute(TABLE.delete().where(TABLE.c.id.in_(old_own)))
    old_others = [task_id for task_id in old if task_id not in old_own]
    recent_own = [task_id for task_id in recent if share(task_id, partition) == partition.index]
    # Its first claim knows no oldest task of its own yet: its own share first.
    assert claim_as_node(strategy, engine, partition, 1, clock) == recent_own[:1]
    # Its oldest is a minute newer than the others' old ones, more than the
    # grace: those fell behind, and a sweep takes them before its own.
    assert claim_as_node(strategy, engine, partition, 2, clock) == old_others[:2]
    first_stolen = stolen_order([*old_others, *recent], partition)[0]
    # At most once a second: now its own (both), then one of the others' from the back.
    assert claim_as_node(strategy, engine, partition, 3, clock) == [*recent_own, first_stolen]
    clock.advance(timedelta(seconds=1))
    assert claim_as_node(strategy, engine, partition, 3, clock) == old_others[:3]


def test_a_sweep_takes_the_others_tasks_of_a_better_priority_once_due_for_the_grace(
    engine: sa.Engine, strategy: SkipLockedStrategy, clock: MovableClock
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5), clock.now)
    start = clock.now()
    ids = enqueue(queue, engine, 6, run_at=start, priority=5)
    partition = node_of(engine, ids[0])
    urgent = enqueue(queue, engine, 3, run_at=start, priority=-1)
    [urgent_other, *_] = [task_id for task_id in urgent if share(task_id, partition) != partition.index]
    with engine.begin() as conn:
        conn.execute(TABLE.delete().where(TABLE.c.id.in_(urgent), TABLE.c.id != urgent_other))
    own = [task_id for task_id in ids if share(task_id, partition) == partition.index]
    assert claim_as_node(strategy, engine, partition, 1, clock) == own[:1]
    # Within the grace it is the other node's to take.
    assert claim_as_node(strategy, engine, partition, 1, clock) == own[:1]
    clock.advance(timedelta(seconds=5))
    assert claim_as_node(strategy, engine, partition, 1, clock) == [urgent_other]


def test_a_sweep_leaves_the_others_tasks_within_the_grace(
    engine: sa.Engine, strategy: SkipLockedStrategy, clock: MovableClock
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5), clock.now)
    start = clock.now()
    enqueue(queue, engine, 6, run_at=start - timedelta(seconds=4))
    recent = enqueue(queue, engine, 6, run_at=start)
    partition = node_of(engine, recent[0])
    with engine.begin() as conn:
        conn.execute(TABLE.delete().where(TABLE.c.id < recent[0], _share_is(partition)))
    recent_own = [task_id for task_id in recent if share(task_id, partition) == partition.index]
    assert claim_as_node(strategy, engine, partition, 1, clock) == recent_own[:1]
    assert claim_as_node(strategy, engine, partition, 2, clock) == recent_own[:2]


def _share_is(partition: NodePartition) -> sa.ColumnElement[bool]:
    return sa.func.mod(TABLE.c.id // partition.step, partition.nodes) == partition.index


def sent_by_claims(engine: sa.Engine, clock: MovableClock, strategy: SkipLockedStrategy) -> list[str]:
    """What two claims of one task each and an empty third send, on a queue of ``strategy``."""
    queue = tq.TaskQueue(engine, strategy=strategy, lease=timedelta(minutes=5), clock=clock.now)
    with engine.begin() as conn:
        conn.execute(TABLE.delete())
    enqueue(make_queue(engine, None, timedelta(minutes=5), clock.now), engine, 2)
    with statements_sent(queue, lambda sql: True) as sent:
        assert len(queue.claim(worker_id="w")) == 1
        assert len(queue.claim(worker_id="w")) == 1
        assert queue.claim(worker_id="w") == []
    queue.close()
    return sent


def test_by_default_a_claim_that_met_no_other_node_sends_the_plain_claim(
    engine: sa.Engine, clock: MovableClock
) -> None:
    """On a plain server, and on a Galera node whose claims have lost no conflict, nothing changes."""
    plain = sent_by_claims(engine, clock, SkipLockedStrategy(spreading=SpreadingOptions(enabled=False)))
    assert plain and not any("mod(" in sql.lower() for sql in plain)
    assert sent_by_claims(engine, clock, SkipLockedStrategy()) == plain


def test_spreading_asked_for_spreads_where_the_server_names_its_node_and_nowhere_else(
    engine: sa.Engine, clock: MovableClock
) -> None:
    plain = sent_by_claims(engine, clock, SkipLockedStrategy(spreading=SpreadingOptions(enabled=False)))
    asked = sent_by_claims(engine, clock, SkipLockedStrategy(spreading=SpreadingOptions(enabled=True)))
    asking = [sql for sql in asked if "GLOBAL_STATUS" in sql]
    assert len(asking) == 1, "it asked the server once which node it is"
    with engine.connect() as conn:
        node = backend_for(engine.dialect).node_partition(conn)
    if node is None:
        assert [sql for sql in asked if sql not in asking] == plain
    else:
        assert node == (0, 3, stride(engine)), "the suite's engine is on the first of three nodes"
        assert any("mod(" in sql.lower() for sql in asked), "its candidates read by share"
        assert len(asked) > len(plain) + 1, "candidates read, then locked by id"


def test_spreading_options_are_checked() -> None:
    with pytest.raises(ValueError, match="grace must be a timedelta, zero or more"):
        SpreadingOptions(grace=timedelta(seconds=-1))
    with pytest.raises(TypeError, match="enabled must be None, True or False"):
        SpreadingOptions(enabled="yes")  # type: ignore[arg-type]
