"""The claim side of concurrency limits: which claimable names have a limit, and their claim, taken first.

A limited task's rows carry a concurrency key (`sa_taskqueue.core.concurrency`),
and the limited claim gives each row it starts a free slot of its key
(`sa_taskqueue.strategies.limited`).  This feature decides when that claim
runs: before the plain claim of the other names, and, after one found
nothing it could take, not again for ``recheck_after`` seconds unless a
worker says tasks arrived or a slot was freed (`recheck`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from sa_taskqueue.core.claimed_params import decode_params, json_loads
from sa_taskqueue.core.concurrency import fitted
from sa_taskqueue.core.rate_limit import RateLimit, Rates, micros
from sa_taskqueue.core.registered import RegisteredTask
from sa_taskqueue.features.ports import QueueContext
from sa_taskqueue.strategies.base import ClaimStrategy
from sa_taskqueue.strategies.claiming import ClaimRequest
from sa_taskqueue.strategies.limited import Limits

#: Callers claiming ever new sets of names: the limits worked out are forgotten past this many sets.
MAX_NAME_SETS = 64


class ConcurrencyClaims:
    """The limits of the registered tasks, worked out once per set of names claimed, and the limited claim."""

    def __init__(self, context: QueueContext, tasks: Mapping[str, RegisteredTask[Any, Any]]) -> None:
        self._context = context
        self._tasks = tasks
        self._limits_of_names: dict[tuple[str, ...] | None, Limits | None] = {}
        #: Until when (monotonic) claims leave the limited claim out, after one found nothing.
        self._idle_until = 0.0
        #: The same for the rated claim: until its held tasks may start, or a moment after it found none.
        self._rated_idle_until = 0.0

    def registered_changed(self) -> None:
        """A task was registered: the limits are worked out again."""
        self._limits_of_names.clear()

    def recheck(self) -> None:
        """Let the next claim look for limited tasks again."""
        self._idle_until = 0.0
        self._rated_idle_until = 0.0

    def limits_for(self, names: tuple[str, ...] | None) -> Limits | None:
        """The limits of the claimable names that have one; None when none has (the plain claim alone)."""
        try:
            return self._limits_of_names[names]
        except KeyError:
            pass
        if len(self._limits_of_names) >= MAX_NAME_SETS:
            self._limits_of_names.clear()
        found = self._limits_of_names[names] = self._find(names)
        return found

    def claim(
        self,
        strategy: ClaimStrategy,
        request: ClaimRequest,
        limits: Limits,
        recheck_after: float,
        plain_claim: Callable[[ClaimRequest], list[dict[str, Any]]],
    ) -> list[dict[str, Any]]:
        """Limited names first, each into a slot of its key; the rest of the limit to ``plain_claim``.

        With no names given, the plain claim takes the registered names only:
        a row of a name unknown here could be a limited task of another release.
        """
        context = self._context
        rated = limits.rates.rates if limits.rates is not None else {}
        plain = tuple(
            name
            for name in (request.names or sorted(self._tasks))
            if name not in limits.limits and name not in rated
        )
        rows: list[dict[str, Any]] = []
        if limits.rates is not None and time.monotonic() >= self._rated_idle_until:
            rows = self._claim_rated(strategy, request, limits.rates, recheck_after)
        if limits.limits and len(rows) < request.limit and time.monotonic() >= self._idle_until:
            limited = replace(request, limit=request.limit - len(rows), names=limits.names)
            with context.database_errors():
                limited_rows = context.call(
                    lambda: strategy.claim_limited(context.engine, context.table, limited, limits)
                )
            rows += limited_rows
            if not limited_rows and recheck_after > 0:
                # Nothing limited was due, or every due key was full: leave the
                # limited claim out for a moment rather than pay its
                # transaction on every claim of plain tasks meanwhile.
                self._idle_until = time.monotonic() + recheck_after
        if plain and len(rows) < request.limit:
            rows += plain_claim(replace(request, limit=request.limit - len(rows), names=plain))
        return rows

    def _claim_rated(
        self, strategy: ClaimStrategy, request: ClaimRequest, rates: Rates, recheck_after: float
    ) -> list[dict[str, Any]]:
        """The rated claim (`sa_taskqueue.strategies.rated`), left out until its held tasks may start."""
        context = self._context
        rated = replace(request, names=rates.names)
        with context.database_errors():
            result = context.call(lambda: strategy.claim_rated(context.engine, context.table, rated, rates))
        if not result.rows and recheck_after > 0:
            # Nothing rated was due, or every due one was held back: leave the
            # rated claim out until the first held one may start, at most
            # ``recheck_after``, rather than pay its transaction meanwhile.
            wait = recheck_after
            if result.next_start_us is not None:
                wait = min(wait, max(0.0, (result.next_start_us - micros(request.now)) / 1e6))
            self._rated_idle_until = time.monotonic() + wait
        return result.rows

    def _find(self, names: tuple[str, ...] | None) -> Limits | None:
        candidates = self._tasks if names is None else names
        limits: dict[str, int] = {}
        rate_limits: dict[str, RateLimit] = {}
        for task_name in candidates:
            registered = self._tasks.get(task_name)
            if registered is not None and registered.options.concurrency is not None:
                limits[task_name] = registered.options.concurrency.limit
            if registered is not None and registered.options.rate is not None:
                rate_limits[task_name] = registered.options.rate
        if not limits and not rate_limits:
            return None
        loads = json_loads(self._context.engine.dialect)
        tasks = self._tasks

        def rate_key_of(task_name: str, params_text: Any) -> str:
            limit = tasks[task_name].options.rate
            assert limit is not None
            try:
                params, malformed = decode_params(params_text, loads)
                return limit.key_of(params if malformed is None else {})
            except Exception:  # noqa: BLE001 - a key function failing on these params: the task's own key
                return fitted(task_name, task_name)

        rates = Rates(rate_limits, rate_key_of) if rate_limits else None

        def key_of(task_name: str, params_text: Any) -> str:
            # A row enqueued before its task had a limit: its key as an enqueue now would make it.
            limit = tasks[task_name].options.concurrency
            assert limit is not None
            try:
                params, malformed = decode_params(params_text, loads)
                return limit.key_of(params if malformed is None else {})
            except Exception:  # noqa: BLE001 - a key function failing on these params: the task's own key
                return fitted(task_name, task_name)

        return Limits(limits, key_of, rates)


__all__ = ["MAX_NAME_SETS", "ConcurrencyClaims"]
