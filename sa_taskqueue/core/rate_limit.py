"""`RateLimit`: at most N starts of a task in any window of W seconds, per rate key.

``rate_limit="100/s"`` (or several at once, ``("10/s", "500/h")``) limits
how often a task *starts*: every claim of a run counts, retries included.
``rate_key=`` splits the count by some params, as ``concurrency_key=`` does.

The scheme is a sliding window counted in buckets, exact as an upper bound:
each (task, window, key) keeps the number of starts in each of the last
``BUCKETS + 1`` buckets of ``W / BUCKETS`` seconds.  A start at ``t`` is
allowed only while the starts in every bucket that overlaps ``(t - W, t]``
number fewer than N.  Those buckets hold every start of the last W seconds
(and some a little older), so no window of length W -- open or closed, at
any offset -- ever holds more than N starts.  What it costs: a start older
than W still counts until its bucket has left the window, so after a burst
of N the next start may wait up to ``W + W / BUCKETS``; sustained, the rate
is between ``N / (W + W/BUCKETS)`` and ``N / W``.  Bursts of N at once are
allowed.

The state is a short string per row (`encode` / `decode`), changed by the
claim in its own transaction with a compare-and-set on a version number
(`sa_taskqueue.strategies.rated`).  Times are whole microseconds since the
epoch, on the claiming worker's clock.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sa_taskqueue.core.concurrency import ConcurrencyLimit, KeySpec

#: How many buckets a window is counted in: a start waits at most W/BUCKETS beyond its window.
BUCKETS = 10

_UNITS = {
    "s": 1,
    "sec": 1,
    "second": 1,
    "m": 60,
    "min": 60,
    "minute": 60,
    "h": 3600,
    "hour": 3600,
    "d": 86400,
    "day": 86400,
}
_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d*)\s*([a-z]+)\s*$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

#: The longest window: a day.  The largest N: a start count a bucket holds in a short string.
MAX_WINDOW_SECONDS = 86400
MAX_COUNT = 1_000_000


@dataclass(frozen=True)
class RateWindow:
    """At most ``count`` starts in any ``seconds``-long window."""

    count: int
    seconds: int

    @classmethod
    def parse(cls, spec: object) -> RateWindow:
        """``"100/s"``, ``"500/h"``, ``"5/10s"`` (units s, m, h, d); a `ValueError` saying why if not."""
        if not isinstance(spec, str):
            raise TypeError(f"rate_limit must be a string like '100/s' or a tuple of them, got {spec!r}")
        match = _SPEC.match(spec.lower())
        unit = match and _UNITS.get(match.group(3).rstrip("s") or "s")
        if match is None or unit is None:
            raise ValueError(
                f"rate_limit {spec!r} is not of the form '<count>/<unit>' or '<count>/<n><unit>' "
                "with a unit of s, m, h or d (e.g. '100/s', '500/h', '5/10s')"
            )
        count = int(match.group(1))
        seconds = unit * int(match.group(2) or 1)
        if not 1 <= count <= MAX_COUNT:
            raise ValueError(f"rate_limit {spec!r}: the count must be between 1 and {MAX_COUNT}")
        if not 1 <= seconds <= MAX_WINDOW_SECONDS:
            raise ValueError(f"rate_limit {spec!r}: the window must be between 1 second and a day")
        return cls(count, seconds)

    @property
    def label(self) -> str:
        """How the window is named in its state row: ``"100/1s"``."""
        return f"{self.count}/{self.seconds}s"

    @property
    def bucket_us(self) -> int:
        return self.seconds * 1_000_000 // BUCKETS


@dataclass(frozen=True)
class WindowState:
    """A window's starts per bucket: ``counts[i]`` in bucket ``first + i`` (time // bucket length)."""

    first: int
    counts: tuple[int, ...]

    def counted(self, window: RateWindow, now_us: int) -> int:
        """The starts in the buckets that overlap ``(now - W, now]``."""
        oldest = (now_us - window.seconds * 1_000_000) // window.bucket_us
        return sum(c for i, c in enumerate(self.counts) if self.first + i >= oldest)

    def allows(self, window: RateWindow, now_us: int) -> bool:
        return self.counted(window, now_us) < window.count

    def with_start(self, window: RateWindow, now_us: int) -> WindowState:
        """This state with one more start at ``now``, buckets that left every window dropped."""
        bucket = now_us // window.bucket_us
        oldest = bucket - BUCKETS
        kept = {self.first + i: c for i, c in enumerate(self.counts) if self.first + i >= oldest and c}
        kept[bucket] = kept.get(bucket, 0) + 1
        first = min(kept)
        return WindowState(first, tuple(kept.get(b, 0) for b in range(first, max(kept) + 1)))

    def next_allowed_us(self, window: RateWindow, now_us: int) -> int:
        """The earliest time at or after ``now`` when one more start fits (its oldest buckets gone)."""
        when = now_us
        total = self.counted(window, when)
        for i in range(len(self.counts)):
            if total < window.count:
                break
            bucket = self.first + i
            # Bucket b overlaps (t - W, t] until t - W reaches its end.
            leaves = (bucket + 1) * window.bucket_us + window.seconds * 1_000_000
            if leaves > when:
                when = leaves
                total = self.counted(window, when)
        return when


EMPTY = WindowState(0, ())


def encode(state: WindowState) -> str:
    """``"<first bucket>:<count>,<count>,..."``: at most ``BUCKETS + 1`` counts."""
    return f"{state.first}:{','.join(str(c) for c in state.counts)}"


def decode(text: str | None) -> WindowState:
    if not text:
        return EMPTY
    first, _, counts = text.partition(":")
    return WindowState(int(first), tuple(int(c) for c in counts.split(",") if c))


def micros(moment: datetime) -> int:
    """``moment`` (aware) as whole microseconds since the epoch."""
    delta = moment - _EPOCH
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_micros(value: int) -> datetime:
    """Microseconds since the epoch as an aware UTC datetime."""
    return _EPOCH + timedelta(microseconds=value)


def state_id(task_name: str, window: RateWindow, key: str) -> str:
    """The state row's key: a SHA-256 of task, window and key (any length, one fixed-size column)."""
    return hashlib.sha256(f"{task_name}\x00{window.label}\x00{key}".encode()).hexdigest()


@dataclass(frozen=True)
class RateLimit:
    """The windows of one task, and how its rate key is made from the params."""

    task_name: str
    windows: tuple[RateWindow, ...]
    keyed: ConcurrencyLimit

    @classmethod
    def of(cls, task_name: str, func: Callable[..., Any], limit: object, key: object) -> RateLimit:
        """A checked rate limit for ``func``: a `TypeError`/`ValueError` naming what is unfit."""
        specs: Sequence[object] = (limit,) if isinstance(limit, str) else limit  # type: ignore[assignment]
        if not isinstance(specs, (tuple, list)) or not specs:
            raise TypeError(f"rate_limit must be a string like '100/s' or a tuple of them, got {limit!r}")
        windows = tuple(RateWindow.parse(spec) for spec in specs)
        if len({w.seconds for w in windows}) != len(windows):
            raise ValueError(f"rate_limit {limit!r} gives two limits for one window length")
        try:
            keyed = ConcurrencyLimit.of(task_name, func, 1, key)
        except (TypeError, ValueError) as error:
            raise type(error)(str(error).replace("concurrency_key", "rate_key")) from None
        return cls(task_name, windows, keyed)

    @property
    def key(self) -> KeySpec:
        return self.keyed.key

    def key_of(self, params: Mapping[str, Any]) -> str:
        """The rate key of a run with ``params`` (the task's name alone without ``rate_key``)."""
        try:
            return self.keyed.key_of(params)
        except TypeError as error:
            raise TypeError(str(error).replace("concurrency_key", "rate_key")) from None


@dataclass(frozen=True)
class Rates:
    """The rate-limited task names a claim asks for, their limits, and the rate key of a stored row.

    ``key_of(name, params_text)`` gives a row's rate key from its params as stored.
    """

    rates: Mapping[str, RateLimit]
    key_of: Callable[[str, Any], str]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.rates))


def plan_starts(
    candidates: Iterable[tuple[Any, Sequence[tuple[str, RateWindow]]]],
    states: Mapping[str, WindowState],
    now_us: int,
    wanted: int,
) -> tuple[list[Any], dict[str, WindowState], dict[Any, int]]:
    """Which candidates start now, in claim order: those whose every window has room.

    ``candidates`` are (candidate, its windows as (state id, window)).
    Returns the candidates to start (at most ``wanted``), the new state of
    each window they changed, and for each candidate held back by its
    windows the time (microseconds) at which they next allow a start.
    """
    current = dict(states)
    changed: dict[str, WindowState] = {}
    started: list[Any] = []
    held: dict[Any, int] = {}
    for candidate, windows in candidates:
        if len(started) >= wanted:
            break
        if all(current.get(sid, EMPTY).allows(window, now_us) for sid, window in windows):
            for sid, window in windows:
                current[sid] = changed[sid] = current.get(sid, EMPTY).with_start(window, now_us)
            started.append(candidate)
        else:
            held[candidate] = max(
                current.get(sid, EMPTY).next_allowed_us(window, now_us) for sid, window in windows
            )
    return started, changed, held


__all__ = [
    "BUCKETS",
    "RateLimit",
    "RateWindow",
    "Rates",
    "WindowState",
    "decode",
    "encode",
    "from_micros",
    "micros",
    "plan_starts",
    "state_id",
]
