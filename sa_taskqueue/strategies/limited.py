"""The limited claim: take due tasks of concurrency-limited names, each into a free slot of its key.

A limited task runs only while it holds a slot ``0 <= concurrency_slot < N``
of its ``concurrency_key``, and the task table's unique index on the running
rows' (key, slot) (``ux_<table>_slot``) lets no two running rows hold the
same one.  So the database itself keeps at most N running per key, whatever
claimers race: the claim here only has to pick slots that are likely free.

In one transaction, as the strategy's own claim locks and fences:

1. read the slots taken by running rows of the limited names;
2. read due candidates in claim order, leaving out keys already full
   (locked with SKIP LOCKED where the strategy locks rows);
3. give each candidate the lowest free slot of its key, skipping those
   whose key has none left, up to the claim's limit;
4. UPDATE them to RUNNING, each with its slot, fenced on the attempt seen
   (the compare-and-set of ``conditional_update``): one UPDATE a row, in
   (key, slot) order, so that two claimers wait on each other's slots in
   one order; or, where the database runs one writer at a time (SQLite),
   one UPDATE for them all, since no other claimer can be waiting.

Two claimers that read the same free slot at once both try to take it: the
unique index refuses the second (on PostgreSQL and InnoDB once the first
commits), its transaction rolls back whole, and it tries once more, reading
the slots again.  A second refusal returns nothing: the next poll tries again.
SQLite runs one writing transaction at a time, so it never gets that far.
InnoDB can also end two such claimers' wait for each other's slots as a
deadlock: the one it rolls back tries again the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, Select, Table, and_, bindparam, case, or_, select, update
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError, IntegrityError

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.rate_limit import Rates
from sa_taskqueue.strategies.claiming import (
    ClaimRequest,
    apply_claim,
    claimed_values,
    due_clause,
    due_select,
    name_params,
    read_back,
)
from sa_taskqueue.strategies.executor import StatementExecutor


class LimitedClaimer(Protocol):
    """What the limited claim needs of the strategy running it (`ClaimStrategy` satisfies it)."""

    executor: StatementExecutor

    def transaction(self, engine: Engine) -> AbstractContextManager[Connection]:
        """A connection in a transaction of the strategy's kind, committed when the block ends."""

    def limited_candidates(self, dialect: Dialect, query: Select[Any], request: ClaimRequest) -> Any:
        """The candidates query as the strategy locks it (or not)."""


CANDIDATE_ID = "limited_id"
CANDIDATE_ATTEMPTS = "limited_attempts"
KEY = "limited_key"
SLOT = "limited_slot"

#: How many tries a claim makes when another claimer took a slot it had picked.
TRIES = 2


@dataclass(frozen=True)
class Limits:
    """The limited task names a claim asks for: each name's N, and the key of a row enqueued without one.

    ``key_of(name, params_text)`` gives the key of a row written before its
    task had a limit (or around the queue), so that it still runs limited.
    """

    limits: Mapping[str, int]
    key_of: Callable[[str, Any], str]
    #: The rate-limited names among those asked for, claimed by `sa_taskqueue.strategies.rated`.
    rates: Rates | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.limits))


def running_slots_statement(table: Table, name_count: int) -> Select[Any]:
    """The key and slot of every running row holding one, of the names bound by `name_params`."""
    names = [bindparam(name, type_=table.c.name.type) for name in name_params(name_count)]
    return select(table.c.name, table.c.concurrency_key, table.c.concurrency_slot).where(
        table.c.running_slot_key.is_not(None), table.c.name.in_(names)
    )


def candidates_query(table: Table, request: ClaimRequest, full_keys: Sequence[str]) -> Select[Any]:
    """Due rows of the limited names in claim order, but those of keys with no slot free."""
    query = due_select(table, request, *read_back(table), table.c.concurrency_key)
    if full_keys:
        key = table.c.concurrency_key
        query = query.where(or_(key.is_(None), key.not_in(list(full_keys))))
    return query


def take_statement(table: Table, request: ClaimRequest, count: int = 1) -> Any:
    """UPDATE ``count`` candidates to RUNNING, each in its slot, if queued, due, and at the attempt seen.

    One statement for the claim's every candidate, whose SQL is fixed per
    count: the candidate ``i`` is bound as ``limited_id_i`` and
    ``limited_attempts_i``, its key and slot as ``limited_key_i`` and
    ``limited_slot_i`` (`take_params`).
    """
    ids = [bindparam(f"{CANDIDATE_ID}_{i}", type_=table.c.id.type) for i in range(count)]
    attempts = [bindparam(f"{CANDIDATE_ATTEMPTS}_{i}", type_=table.c.attempts.type) for i in range(count)]
    keys = [bindparam(f"{KEY}_{i}", type_=table.c.concurrency_key.type) for i in range(count)]
    slots = [bindparam(f"{SLOT}_{i}", type_=table.c.concurrency_slot.type) for i in range(count)]
    if count == 1:
        key: Any = keys[0]
        slot: Any = slots[0]
    else:
        key = case(*((table.c.id == ids[i], keys[i]) for i in range(count)), else_=table.c.concurrency_key)
        slot = case(*((table.c.id == ids[i], slots[i]) for i in range(count)), else_=table.c.concurrency_slot)
    return (
        update(table)
        .where(
            # The ids alone first, so the plan finds the rows by their key.
            table.c.id.in_(ids),
            or_(*(and_(table.c.id == ids[i], table.c.attempts == attempts[i]) for i in range(count))),
            due_clause(table, request),
        )
        .values(**claimed_values(table, request), concurrency_key=key, concurrency_slot=slot)
    )


def take_params(plan: Sequence[tuple[str, int, Mapping[str, Any]]]) -> dict[str, Any]:
    """The values of `take_statement` for ``plan``'s candidates, each with its key and slot."""
    params: dict[str, Any] = {}
    for i, (key, slot, row) in enumerate(plan):
        params[f"{CANDIDATE_ID}_{i}"] = row["id"]
        params[f"{CANDIDATE_ATTEMPTS}_{i}"] = row["attempts"]
        params[f"{KEY}_{i}"] = key
        params[f"{SLOT}_{i}"] = slot
    return params


def candidate_window(request: ClaimRequest) -> int:
    """How many candidates a claim reads: some beyond its limit, for rows whose key fills up meanwhile."""
    return request.limit * 2 + 8


def claim_limited(
    strategy: LimitedClaimer, engine: Engine, table: Table, request: ClaimRequest, limits: Limits
) -> list[dict[str, Any]]:
    """Claim up to ``request.limit`` tasks of ``limits``' names (``request.names``), each into a free slot."""
    for _ in range(TRIES):
        try:
            with strategy.transaction(engine) as conn:
                return _claim(strategy, conn, table, request, limits)
        except DBAPIError as error:
            # Rolled back whole (PostgreSQL aborts the transaction anyway).
            if not lost_slot_race(engine, error):
                raise
    return []


def lost_slot_race(engine: Engine, error: DBAPIError) -> bool:
    """Whether ``error`` only says another claimer got there first, so the claim may try again.

    Another claimer took a slot this one picked (the unique violation on
    ``ux_<table>_slot``, the only unique index a claim's UPDATE can break),
    or the server ended a deadlock between the two by rolling this one back.
    """
    if isinstance(error, IntegrityError):
        return True
    return error.orig is not None and backend_for(engine.dialect).lost_lock_race(error.orig)


def _claim(
    strategy: LimitedClaimer, conn: Connection, table: Table, request: ClaimRequest, limits: Limits
) -> list[dict[str, Any]]:
    params = request.params()
    taken = taken_slots(conn, table, request, limits)
    full = sorted(key for key, (limit, slots) in taken.items() if len(slots) >= limit)
    query = strategy.limited_candidates(conn.dialect, candidates_query(table, request, full), request)
    window = candidate_window(request)
    cursor = conn.execute(query, params)
    candidates = [dict(row) for row in cursor.mappings().fetchmany(window)]
    cursor.close()
    plan = assign_slots(candidates, taken, limits, request.limit)
    store_missing_keys(conn, table, candidates, {row["id"] for _, _, row in plan}, limits)
    if not plan:
        return []
    plan.sort(key=lambda item: (item[0], item[1]))
    if not backend_for(conn.dialect).serialised_writes:
        # One UPDATE writes its rows in the order its plan finds them, not in
        # (key, slot) order: two claimers could then each hold a slot the
        # other waits for, a deadlock PostgreSQL sees only after a second.
        taken_rows = (_take_one(strategy, conn, table, request, params, item) for item in plan)
        return [row for row in taken_rows if row is not None]
    take = strategy.executor.prepared(
        ("limited_take", len(plan), request.shape),
        conn.dialect,
        table,
        lambda: take_statement(table, request, len(plan)),
    )
    won = take.execute(conn, {**params, **take_params(plan)}).rowcount
    if won == len(plan):
        taken_ids = {row["id"] for _, _, row in plan}
    else:
        # (Rare: a candidate changed since it was read, where the strategy
        # does not lock them.)  The rows taken are those this claim wrote.
        taken_ids = set(
            conn.execute(
                select(table.c.id).where(
                    table.c.id.in_([row["id"] for _, _, row in plan]),
                    table.c.locked_by == request.worker_id,
                    table.c.started_at == request.now,
                )
            ).scalars()
        )
    return [
        {**apply_claim(row, request), "concurrency_key": key, "concurrency_slot": slot}
        for key, slot, row in plan
        if row["id"] in taken_ids
    ]


def _take_one(
    strategy: LimitedClaimer,
    conn: Connection,
    table: Table,
    request: ClaimRequest,
    params: Mapping[str, Any],
    item: tuple[str, int, Mapping[str, Any]],
) -> dict[str, Any] | None:
    """UPDATE one planned candidate into its slot; its claimed row, or None if it was no longer to be had."""
    key, slot, row = item
    take = strategy.executor.prepared(
        ("limited_take", 1, request.shape), conn.dialect, table, lambda: take_statement(table, request, 1)
    )
    if take.execute(conn, {**params, **take_params([item])}).rowcount != 1:
        return None
    return {**apply_claim(row, request), "concurrency_key": key, "concurrency_slot": slot}


def store_missing_keys(
    conn: Connection, table: Table, candidates: Sequence[Mapping[str, Any]], taken: set[int], limits: Limits
) -> None:
    """Store the key of candidates left queued that were enqueued without one (``session.add``, say).

    The claim's SQL leaves out rows of full keys by the stored key alone, so
    without this, rows of a full key with no stored key could fill every
    claim's window and hold up the due rows of other keys behind them.
    """
    for row in candidates:
        if row["concurrency_key"] is None and row["id"] not in taken:
            conn.execute(
                update(table)
                .where(table.c.id == row["id"], table.c.concurrency_key.is_(None))
                .values(concurrency_key=limits.key_of(row["name"], row["params"]))
            )


def taken_slots(
    conn: Connection, table: Table, request: ClaimRequest, limits: Limits
) -> dict[str, tuple[int, set[int]]]:
    """Each key with running rows: its limit, and the slots its running rows hold."""
    names = limits.names
    statement = running_slots_statement(table, len(names))
    taken: dict[str, tuple[int, set[int]]] = {}
    for name, key, slot in conn.execute(statement, dict(zip(name_params(len(names)), names, strict=True))):
        taken.setdefault(key, (limits.limits.get(name, 1), set()))[1].add(slot)
    return taken


def assign_slots(
    candidates: Sequence[Mapping[str, Any]],
    taken: dict[str, tuple[int, set[int]]],
    limits: Limits,
    wanted: int,
) -> list[tuple[str, int, Mapping[str, Any]]]:
    """Candidates in claim order, each with the lowest slot of its key still free; full keys skipped.

    A key's limit is its task's N here; slots a worker with a larger N took
    count as taken, so the largest N among the workers is what holds.
    """
    plan: list[tuple[str, int, Mapping[str, Any]]] = []
    for row in candidates:
        name = row["name"]
        key = row["concurrency_key"] or limits.key_of(name, row["params"])
        limit = limits.limits[name]
        _, slots = taken.setdefault(key, (limit, set()))
        free = next((slot for slot in range(limit) if slot not in slots), None)
        if free is None:
            continue
        slots.add(free)
        plan.append((key, free, row))
        if len(plan) == wanted:
            break
    return plan


__all__ = [
    "Limits",
    "assign_slots",
    "candidate_window",
    "candidates_query",
    "claim_limited",
    "running_slots_statement",
    "take_params",
    "take_statement",
    "taken_slots",
]
