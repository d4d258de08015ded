"""The rated claim: take due tasks of rate-limited names while every window of theirs has room.

In one transaction, as the strategy's own claim locks and fences:

1. read due candidates of the rate-limited names in claim order (locked
   with SKIP LOCKED where the strategy locks rows);
2. read the state rows (`sa_taskqueue.core.rate_limit_table`) of their
   (task, window, key);
3. decide in Python, in claim order, which start now: those whose every
   window has room (`sa_taskqueue.core.rate_limit.plan_starts`);
4. write each changed state row back, in id order, with a compare-and-set
   on the version read (``UPDATE ... WHERE id = :id AND version = :seen``),
   or INSERT it where it was missing;
5. UPDATE the chosen candidates to RUNNING, fenced on the attempt seen;
6. move the ``run_at`` of the candidates held back by their windows to the
   time their windows next allow a start, so that later claims pass over
   them to the tasks behind, and take them again when they may start.

If a compare-and-set finds the version moved (another claimer wrote the row
after this one read it), or the INSERT finds the row there, or a candidate
was taken meanwhile, the claim's whole transaction rolls back and it tries
once more from the start; a second loss returns nothing this time.  So a
state row only ever moves from the state a claim read to that state plus
the starts the same transaction makes: the count is exact whatever
claimers race, on every database (PostgreSQL and InnoDB re-read the row's
current version under the UPDATE's row lock, SQLite runs one writer at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Table, and_, bindparam, insert, or_, select, update
from sqlalchemy.exc import DBAPIError

from sa_taskqueue.core.model import TaskStatus, has_status
from sa_taskqueue.core.rate_limit import (
    Rates,
    RateWindow,
    WindowState,
    decode,
    encode,
    from_micros,
    micros,
    plan_starts,
    state_id,
)
from sa_taskqueue.core.rate_limit_table import rate_limit_table_of
from sa_taskqueue.strategies.claiming import (
    ClaimRequest,
    apply_claim,
    claimed_values,
    due_clause,
    due_select,
    read_back,
)
from sa_taskqueue.strategies.limited import TRIES, LimitedClaimer, candidate_window, lost_slot_race


class LostRace(Exception):
    """Another claimer wrote what this claim read: its transaction rolls back, and it tries again."""


@dataclass
class RatedResult:
    """The rows a rated claim took, and the earliest time (if any) a held candidate may start."""

    rows: list[dict[str, Any]]
    next_start_us: int | None = None


def claim_rated(
    strategy: LimitedClaimer, engine: Engine, table: Table, request: ClaimRequest, rates: Rates
) -> RatedResult:
    """Claim up to ``request.limit`` tasks of ``rates``' names (``request.names``) within their limits."""
    for _ in range(TRIES):
        try:
            with strategy.transaction(engine) as conn:
                return _claim(strategy, conn, table, request, rates)
        except LostRace:
            continue
        except DBAPIError as error:
            # The INSERT of a state row another claimer inserted first, or a
            # deadlock the server ended: rolled back whole, try again.
            if not lost_slot_race(engine, error):
                raise
    return RatedResult([])


def windows_of(row: Mapping[str, Any], rates: Rates) -> list[tuple[str, RateWindow]]:
    """A candidate's (state id, window) pairs."""
    limit = rates.rates[row["name"]]
    key = rates.key_of(row["name"], row["params"])
    return [(state_id(row["name"], window, key), window) for window in limit.windows]


def _claim(
    strategy: LimitedClaimer, conn: Connection, table: Table, request: ClaimRequest, rates: Rates
) -> RatedResult:
    query = strategy.limited_candidates(conn.dialect, due_select(table, request, *read_back(table)), request)
    return claim_on(conn, table, request, rates, query)


def claim_on(
    conn: Connection,
    table: Table,
    request: ClaimRequest,
    rates: Rates,
    query: Any,
    lock: Callable[[Connection, list[int]], Collection[int]] | None = None,
) -> RatedResult:
    """The rated claim in ``conn``'s transaction, its candidates read by ``query``.

    ``lock``, where given, is asked for the candidates' ids and returns those
    this claimer may take (a strategy's advisory locks); the others are left
    as they are.  Raises `LostRace` where another claimer got in between.
    """
    params = request.params()
    cursor = conn.execute(query, params)
    candidates = [dict(row) for row in cursor.mappings().fetchmany(candidate_window(request))]
    cursor.close()
    if lock is not None and candidates:
        mine = set(lock(conn, [row["id"] for row in candidates]))
        candidates = [row for row in candidates if row["id"] in mine]
    if not candidates:
        return RatedResult([])
    states_table = rate_limit_table_of(table)
    windows = {row["id"]: windows_of(row, rates) for row in candidates}
    ids = sorted({sid for pairs in windows.values() for sid, _ in pairs})
    seen: dict[str, tuple[WindowState, int]] = {
        sid: (decode(state), version)
        for sid, state, version in conn.execute(
            select(states_table.c.id, states_table.c.state, states_table.c.version).where(
                states_table.c.id.in_(ids)
            )
        )
    }
    now_us = micros(request.now)
    started_ids, changed, held = plan_starts(
        ((row["id"], windows[row["id"]]) for row in candidates),
        {sid: state for sid, (state, _) in seen.items()},
        now_us,
        request.limit,
    )
    by_id = {row["id"]: row for row in candidates}
    labels = {
        sid: (by_id[tid]["name"], window, tid) for tid, pairs in windows.items() for sid, window in pairs
    }
    for sid in sorted(changed):
        write_state(conn, states_table, sid, changed[sid], seen.get(sid), labels[sid], rates, by_id, request)
    started = [by_id[tid] for tid in started_ids]
    if started:
        take_started(conn, table, request, params, started)
    if held:
        hold_back(conn, table, {tid: (by_id[tid]["attempts"], when) for tid, when in held.items()})
    return RatedResult(
        [apply_claim(row, request) for row in started],
        min(held.values()) if held else None,
    )


def write_state(
    conn: Connection,
    states: Table,
    sid: str,
    state: WindowState,
    seen: tuple[WindowState, int] | None,
    label: tuple[str, RateWindow, int],
    rates: Rates,
    by_id: Mapping[int, Mapping[str, Any]],
    request: ClaimRequest,
) -> None:
    """Write a state row back if its version is still the one read (or insert it); `LostRace` if not."""
    if seen is not None:
        written = conn.execute(
            update(states)
            .where(states.c.id == sid, states.c.version == seen[1])
            .values(state=encode(state), version=seen[1] + 1, updated_at=request.now)
        ).rowcount
        if written != 1:
            raise LostRace(sid)
        return
    name, window, task_id = label
    conn.execute(
        insert(states).values(
            id=sid,
            name=name,
            rate_window=window.label,
            rate_key=rates.key_of(name, by_id[task_id]["params"]),
            state=encode(state),
            version=1,
            updated_at=request.now,
        )
    )


def take_statement(table: Table, request: ClaimRequest, count: int) -> Any:
    """UPDATE ``count`` candidates to RUNNING if queued, due, and at the attempt seen."""
    ids = [bindparam(f"rated_id_{i}", type_=table.c.id.type) for i in range(count)]
    attempts = [bindparam(f"rated_attempts_{i}", type_=table.c.attempts.type) for i in range(count)]
    return (
        update(table)
        .where(
            table.c.id.in_(ids),
            or_(*(and_(table.c.id == ids[i], table.c.attempts == attempts[i]) for i in range(count))),
            due_clause(table, request),
        )
        .values(**claimed_values(table, request))
    )


def take_started(
    conn: Connection,
    table: Table,
    request: ClaimRequest,
    params: Mapping[str, Any],
    started: Sequence[Mapping[str, Any]],
) -> None:
    """Start the chosen candidates; `LostRace` if one was taken meanwhile (its start counted, not made)."""
    values = dict(params)
    for i, row in enumerate(started):
        values[f"rated_id_{i}"] = row["id"]
        values[f"rated_attempts_{i}"] = row["attempts"]
    if conn.execute(take_statement(table, request, len(started)), values).rowcount != len(started):
        raise LostRace("candidate")


def hold_back(conn: Connection, table: Table, held: Mapping[int, tuple[int, int]]) -> None:
    """Move each held candidate's ``run_at`` to when its windows next allow a start (one UPDATE per time)."""
    by_time: dict[int, list[tuple[int, int]]] = {}
    for task_id, (attempts, when) in held.items():
        by_time.setdefault(when, []).append((task_id, attempts))
    for when, rows in sorted(by_time.items()):
        conn.execute(
            update(table)
            .where(
                table.c.id.in_([task_id for task_id, _ in rows]),
                or_(
                    *(and_(table.c.id == task_id, table.c.attempts == attempts) for task_id, attempts in rows)
                ),
                has_status(table, TaskStatus.QUEUED),
            )
            .values(run_at=from_micros(when))
        )


__all__ = ["LostRace", "RatedResult", "claim_on", "claim_rated", "take_statement"]
