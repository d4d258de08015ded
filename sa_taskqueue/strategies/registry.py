"""Which claim strategy a database gets: the one place that maps dialect and version to a strategy.

Keys are SQLAlchemy dialect names, with MariaDB told apart from MySQL as
``"mariadb"`` (SQLAlchemy names it ``"mysql"`` under a ``mysql://`` URL), and ``"*"`` for any other
dialect.  Several entries may share a key with different ``min_version``; the
newest one the connected server satisfies wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.engine import Dialect

from sa_taskqueue.dialects import is_mariadb
from sa_taskqueue.exceptions import StrategyError
from sa_taskqueue.strategies.advisory import AdvisoryLockStrategy
from sa_taskqueue.strategies.base import ClaimStrategy
from sa_taskqueue.strategies.conditional import ConditionalUpdateStrategy
from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy

StrategyFactory = Callable[[], ClaimStrategy]

ANY_DIALECT = "*"


@dataclass(frozen=True)
class _Entry:
    factory: StrategyFactory
    min_version: tuple[int, ...] | None


_defaults: dict[str, list[_Entry]] = {}

#: Strategies that can be asked for by name, ``TaskQueue(..., strategy="advisory_lock")``.
named: dict[str, type[ClaimStrategy]] = {
    strategy.name: strategy
    for strategy in (SkipLockedStrategy, ConditionalUpdateStrategy, AdvisoryLockStrategy)
}


def register(
    dialect_name: str, factory: StrategyFactory, *, min_version: tuple[int, ...] | None = None
) -> None:
    """Make ``factory`` the default for ``dialect_name`` on servers at ``min_version`` or newer.

    A later registration for the same dialect and ``min_version`` replaces the
    earlier one, so an application can override a default.
    """
    entries = [entry for entry in _defaults.get(dialect_name, []) if entry.min_version != min_version]
    entries.append(_Entry(factory, tuple(min_version) if min_version is not None else None))
    # Newest minimum first; the version-less fallback last.
    entries.sort(key=lambda entry: entry.min_version or (), reverse=True)
    _defaults[dialect_name] = entries


def registry_key(dialect: Dialect) -> str:
    """The registry's name for a dialect: ``"mariadb"`` for MariaDB, else ``dialect.name``."""
    if is_mariadb(dialect):
        return "mariadb"
    return dialect.name


def resolve(dialect: Dialect) -> ClaimStrategy:
    """A new instance of the default strategy for a connected dialect.

    Uses ``dialect.name``, ``is_mariadb`` and ``server_version_info``, so call
    it after the engine has connected once.
    """
    version = tuple(dialect.server_version_info or ())
    for key in (registry_key(dialect), ANY_DIALECT):
        for entry in _defaults.get(key, []):
            if entry.min_version is None or version >= entry.min_version:
                return entry.factory()
    raise StrategyError(f"no claim strategy is registered for the {dialect.name!r} dialect")


def by_name(name: str) -> type[ClaimStrategy]:
    """The strategy class registered under ``name``."""
    try:
        return named[name]
    except KeyError:
        known = ", ".join(sorted(named))
        raise StrategyError(f"unknown strategy {name!r}; known strategies: {known}") from None


register("postgresql", SkipLockedStrategy)
register("oracle", SkipLockedStrategy)
register("mysql", SkipLockedStrategy, min_version=(8, 0, 1))
register("mysql", ConditionalUpdateStrategy)
register("mariadb", SkipLockedStrategy, min_version=(10, 6))
register("mariadb", ConditionalUpdateStrategy)
register("sqlite", ConditionalUpdateStrategy)
register(ANY_DIALECT, ConditionalUpdateStrategy)

__all__ = ["ANY_DIALECT", "StrategyFactory", "by_name", "named", "register", "registry_key", "resolve"]
