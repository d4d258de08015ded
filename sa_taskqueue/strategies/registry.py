"""Which claim strategy a database gets: its backend's default, unless the application registered another.

The default is the backend's (`Backend.default_strategy`, which knows from
which server version SKIP LOCKED works), named as a strategy is named.  An
application may replace it with `register`, keyed by the backends' server
names (`Backend.name`): SQLAlchemy dialect names, with MariaDB told apart
from MySQL as ``"mariadb"`` whatever the URL said, and ``"*"`` for any
dialect no backend of its own serves.  Several registrations may share a key
with different ``min_version``; the newest one the connected server
satisfies wins, and a server older than every one gets the backend's default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.engine import Dialect

from sa_taskqueue.backends import ANY_DIALECT, backend_for, known_dialect
from sa_taskqueue.core.exceptions import StrategyError
from sa_taskqueue.strategies.advisory import AdvisoryLockStrategy
from sa_taskqueue.strategies.base import ClaimStrategy
from sa_taskqueue.strategies.conditional import ConditionalUpdateStrategy
from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy

StrategyFactory = Callable[[], ClaimStrategy]


@dataclass(frozen=True)
class _Entry:
    factory: StrategyFactory
    min_version: tuple[int, ...] | None


#: What applications registered, by server name: newest minimum version first.
_registered: dict[str, list[_Entry]] = {}

#: Strategies that can be asked for by name, ``TaskQueue(..., strategy="advisory_lock")``.
named: dict[str, type[ClaimStrategy]] = {
    strategy.name: strategy
    for strategy in (SkipLockedStrategy, ConditionalUpdateStrategy, AdvisoryLockStrategy)
}


def register(
    dialect_name: str, factory: StrategyFactory, *, min_version: tuple[int, ...] | None = None
) -> None:
    """Make ``factory`` the default for ``dialect_name`` on servers at ``min_version`` or newer.

    It takes the place of the backend's own default there.  A later
    registration for the same dialect and ``min_version`` replaces the
    earlier one.
    """
    entries = [entry for entry in _registered.get(dialect_name, []) if entry.min_version != min_version]
    entries.append(_Entry(factory, tuple(min_version) if min_version is not None else None))
    # Newest minimum first; the version-less fallback last.
    entries.sort(key=lambda entry: entry.min_version or (), reverse=True)
    _registered[dialect_name] = entries


def registry_key(dialect: Dialect) -> str:
    """The registry's name for a dialect: its backend's server name (``"mariadb"`` for MariaDB)."""
    return backend_for(dialect).name


def resolve(dialect: Dialect) -> ClaimStrategy:
    """A new instance of the default strategy for a connected dialect.

    Uses the server's name and version, so call it after the engine has
    connected once.
    """
    backend = backend_for(dialect)
    version = backend.server_version
    # "*" stands for the dialects no backend of its own serves, as their backend does.
    keys = [backend.name] if known_dialect(dialect) else [backend.name, ANY_DIALECT]
    for key in keys:
        for entry in _registered.get(key, []):
            if entry.min_version is None or version >= entry.min_version:
                return entry.factory()
    return by_name(backend.default_strategy)()


def check_requested(requested: object, dialect: Dialect) -> None:
    """Refuse, before any connect, a strategy that ``dialect`` cannot run or that is not a strategy at all."""
    if isinstance(requested, str):
        cls = by_name(requested)
    elif isinstance(requested, ClaimStrategy):
        cls = type(requested)
    else:
        raise TypeError(f"strategy must be None, a strategy name or a ClaimStrategy, got {requested!r}")
    reason = cls.unsupported_reason(dialect)
    if reason is not None:
        raise StrategyError(reason)


def choose(requested: str | ClaimStrategy | None, dialect: Dialect) -> ClaimStrategy:
    """The strategy for a connected ``dialect``: the one asked for, else the default; version-checked."""
    if requested is None:
        strategy = resolve(dialect)
    elif isinstance(requested, str):
        strategy = by_name(requested)()
    else:
        strategy = requested
    strategy.check_server(dialect)
    return strategy


def by_name(name: str) -> type[ClaimStrategy]:
    """The strategy class registered under ``name``."""
    try:
        return named[name]
    except KeyError:
        known = ", ".join(sorted(named))
        raise StrategyError(f"unknown strategy {name!r}; known strategies: {known}") from None


__all__ = [
    "ANY_DIALECT",
    "StrategyFactory",
    "by_name",
    "check_requested",
    "choose",
    "named",
    "register",
    "registry_key",
    "resolve",
]
