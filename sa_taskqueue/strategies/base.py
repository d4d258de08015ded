"""`ClaimStrategy`: the contract between the queue and one way of handing a due task to exactly one worker.

The queue is a strategy's only caller; it passes the engine, the task table
and a `ClaimRequest`, and gets plain rows back.  Everything a strategy runs is
Core SQL on the table, so one strategy serves `Task` and any application
table mapped with `TaskMixin` alike.  What differs between databases is asked
of the engine's backend (`sa_taskqueue.backends`), never of a dialect name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, ClassVar

from sqlalchemy import Engine, Select, Table
from sqlalchemy.engine import Dialect

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.rate_limit import Rates
from sa_taskqueue.strategies.claiming import ClaimRequest, due_select, limit_param
from sa_taskqueue.strategies.executor import StatementExecutor
from sa_taskqueue.strategies.lease import LeaseWrites
from sa_taskqueue.strategies.limited import Limits, candidate_window, claim_limited
from sa_taskqueue.strategies.rated import RatedResult, claim_rated


class ClaimStrategy(LeaseWrites, ABC):
    """How workers take tasks without two of them ever holding the same one.

    A strategy implements `claim`; it inherits the fenced writes out of
    RUNNING (`finish`, `complete_many`, `fail_many`, `extend`) and lease recovery
    (`recover`) from `LeaseWrites`, and overrides them where its locks, not
    leases, say who holds a task.  Each method runs its own short transaction
    on connections from the given engine and never touches an application's
    session.  A subclass that defines ``__init__`` calls ``super().__init__()``.
    """

    #: The registered name (``"skip_locked"``, ``"conditional_update"``, ``"advisory_lock"``).
    name: ClassVar[str]
    #: Its claims are locking reads (`Backend.begin_locking_reads`): its kept
    #: connections run at the backend's `Backend.locking_reads_isolation`.
    locking_reads: ClassVar[bool] = False

    def __init__(self) -> None:
        #: The compiled statements and kept connections this strategy runs its SQL with.
        self.executor = StatementExecutor(locking_reads=self.locking_reads)

    @classmethod
    def unsupported_reason(cls, dialect: Dialect) -> str | None:
        """Why this strategy cannot run on ``dialect``, or None when it can.

        Called before the first connect, so the server version is not known;
        version checks belong in `check_server`.
        """
        return None

    def check_server(self, dialect: Dialect) -> None:
        """Raise `StrategyError` if the connected server's version cannot run this strategy."""

    def recovery_interval(self, lease: timedelta) -> timedelta:
        """How often the queue looks for tasks of workers that are gone.

        A lease-based strategy can only act once a lease has run out, so a
        quarter of the lease (at most ten seconds) keeps recovery prompt
        without a query on every claim.
        """
        return min(lease / 4, timedelta(seconds=10))

    def prepare(self, engine: Engine) -> None:
        """Set up ``engine`` once before the first claim, for what this strategy alone relies on.

        What a database needs whatever the strategy (busy timeouts, WAL) is
        its backend's, applied by the queue.
        """

    @abstractmethod
    def claim(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        """Mark up to ``request.limit`` due queued tasks RUNNING for ``request.worker_id`` and commit.

        Returns the claimed rows as they are after the claim (status running,
        attempts incremented, started_at, locked_by and locked_until set), in
        any order, each with at least the `READ_BACK` columns and those.  No
        row is returned to two concurrent callers.  Params come as the
        column's JSON text (`read_back`, `whole_row`), for `ClaimedTask.from_row`
        to decode row by row: one malformed row must not fail the whole claim.
        """

    def completes_and_claims_at_once(self, dialect: Dialect) -> bool:
        """Whether `complete_and_claim` commits both at once on ``dialect`` (else one after the other).

        At once is one transaction, so one commit (and, on a database that
        syncs its log at each commit, one sync of it) for the two: on
        PostgreSQL one statement, on MySQL, MariaDB and SQLite the two
        statements in one transaction.  A worker that knows its next claim
        will follow each completion sends the two together where this is true.
        """
        return False

    def _completes_or_claims_its_own_way(self, claims: type[ClaimStrategy]) -> bool:
        """Whether a subclass overrides the completion, or ``claims``' claim.

        Such a subclass completes and claims its own way, one after the
        other, rather than have a statement of ``claims`` stand in for its own.
        """
        kind = type(self)
        return (
            kind.complete_many is not LeaseWrites.complete_many
            or kind.complete_many_on is not LeaseWrites.complete_many_on
            or kind.claim is not claims.claim
        )

    def complete_and_claim(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        results: Sequence[Any],
        now: datetime,
        request: ClaimRequest,
    ) -> tuple[set[int], list[dict[str, Any]]]:
        """`complete_many` for ``tasks``, then `claim` for ``request``: the ids written, and the rows claimed.

        Here each committed on its own; a strategy that can commit both at
        once (`completes_and_claims_at_once`) does, and then either both
        commit or neither does.  Here too a completion that raises claims
        nothing.
        """
        written = self.complete_many(engine, table, tasks, results, now) if tasks else set()
        return written, self.claim(engine, table, request)

    def claim_limited(
        self, engine: Engine, table: Table, request: ClaimRequest, limits: Limits
    ) -> list[dict[str, Any]]:
        """As `claim`, for tasks with a concurrency limit: each claimed row also takes a free slot of its key.

        ``request.names`` are the limited names, all of them in ``limits``.
        The rows come back as `claim`'s do, with ``concurrency_key`` and
        ``concurrency_slot``.  The claim is `sa_taskqueue.strategies.limited`'s,
        run in this strategy's transaction with its candidates locked as
        `limited_candidates` says.
        """
        return claim_limited(self, engine, table, request, limits)

    def claim_rated(self, engine: Engine, table: Table, request: ClaimRequest, rates: Rates) -> RatedResult:
        """As `claim`, for rate-limited tasks: only those whose every window has room start.

        ``request.names`` are the rate-limited names, all of them in ``rates``.
        The claim is `sa_taskqueue.strategies.rated`'s, in this strategy's
        transaction with its candidates locked as `limited_candidates` says.
        """
        return claim_rated(self, engine, table, request, rates)

    def limited_candidates(self, dialect: Dialect, query: Select[Any], request: ClaimRequest) -> Any:
        """The limited claim's candidates: ``query`` (due rows in claim order), bounded, locked.

        Without row locks here: the limited claim's UPDATE is fenced on the
        attempt seen, so a row another claimer took meanwhile is not taken twice.
        """
        return query.limit(candidate_window(request))

    def finding_statement(self, dialect: Dialect, table: Table, request: ClaimRequest) -> Any:
        """The statement whose plan decides how fast a claim finds its rows (what EXPLAIN should see).

        Its parameters are `ClaimRequest.params`.
        """
        return due_select(table, request, table.c.id).limit(limit_param())

    def close(self) -> None:
        """Release whatever the strategy holds: its kept connections (and, in some, locks)."""
        self.executor.close()


__all__ = ["ClaimRequest", "ClaimStrategy"]
