"""The caller's session, sync or async: how a queue's call runs its work in it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar, cast

from sqlalchemy.orm import Session

from sa_taskqueue.core.event_loop_bridge import asyncio_extension

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session

T = TypeVar("T")


def is_async_session(session: object) -> TypeGuard[AsyncSession | async_scoped_session[Any]]:
    """Whether ``session`` is an `AsyncSession` or an `async_scoped_session` (without importing asyncio's)."""
    ext = asyncio_extension()
    return ext is not None and isinstance(session, ext.AsyncSession | ext.async_scoped_session)


async def in_async_session(
    session: AsyncSession | async_scoped_session[Any], work: Callable[[Session], T]
) -> T:
    """``work(sync_session)`` in the async session's greenlet, on the caller's loop and connection.

    The same code as a sync enqueue, so a task added this way is checked,
    flushed and announced (NOTIFY) exactly as one added with a `Session`.
    """
    # An async_scoped_session proxies to the AsyncSession of the current scope.
    ext = asyncio_extension()
    assert ext is not None  # an async session exists, so its module was imported
    target = cast("AsyncSession", session() if isinstance(session, ext.async_scoped_session) else session)
    return await target.run_sync(work)


__all__ = ["in_async_session", "is_async_session"]
