"""The coroutine an async enqueue returns, which says so in the log when it is dropped without ``await``.

``task.enqueue(async_session, ...)`` without ``await`` adds nothing: the
coroutine is created, never run, and the caller's commit writes no task.
Python's own sign of that is a RuntimeWarning naming a private function,
easy to miss and silenced in many deployments.  This wrapper is the same
coroutine to ``await``, ``asyncio.create_task`` or ``gather``, and, if it is
garbage-collected never started, logs an ERROR that names the task and says
the enqueue did not happen.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Generator
from types import TracebackType
from typing import Any, TypeVar

logger = logging.getLogger("sa_taskqueue")

T = TypeVar("T")


class EnqueueCoroutine(Coroutine[Any, Any, T]):
    """``coroutine`` as it is, plus an ERROR in the log if it is dropped before it ever ran."""

    __slots__ = ("_coroutine", "_started", "_what")

    def __init__(self, coroutine: Coroutine[Any, Any, T], what: str) -> None:
        self._coroutine = coroutine
        self._what = what
        self._started = False

    def __await__(self) -> Generator[Any, None, T]:
        self._started = True
        return self._coroutine.__await__()

    def send(self, value: Any, /) -> Any:
        self._started = True
        return self._coroutine.send(value)

    def throw(
        self,
        typ: type[BaseException] | BaseException,
        val: BaseException | object = None,
        tb: TracebackType | None = None,
        /,
    ) -> Any:
        self._started = True
        if val is None and tb is None:
            return self._coroutine.throw(typ)
        return self._coroutine.throw(typ, val, tb)  # type: ignore[arg-type]

    def close(self) -> None:
        self._started = True
        self._coroutine.close()

    def __del__(self) -> None:
        if self._started:
            return
        self._coroutine.close()  # closed unstarted: no RuntimeWarning on top of the error below
        logger.error(
            "%s did not happen: the coroutine it returned was not awaited, so no task was added "
            "(write `await task.enqueue(async_session, ...)`)",
            self._what,
        )


__all__ = ["EnqueueCoroutine"]
