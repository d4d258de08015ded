"""`RegisteredTask`: a function the queue may run, with the defaults it is enqueued with."""

from __future__ import annotations

import functools
import inspect
import random
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, overload

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session
    from sqlalchemy.orm import Session

    from sa_taskqueue.model import TaskMixin
    from sa_taskqueue.queue import TaskQueue

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_RETRY_DELAY = timedelta(seconds=1)


@dataclass(frozen=True)
class TaskOptions:
    """The defaults ``@queue.task`` gives every enqueue of one function."""

    queue: str
    priority: int
    max_attempts: int
    retry_delay: timedelta
    #: Seconds a run may take: enforced by killing the child under process
    #: isolation, recorded as a failure after a late return under threads.
    timeout: float | None = None


class RegisteredTask(Generic[P, R]):
    """A function registered with a `TaskQueue`.

    Calling it runs the function here and now, as if it were not decorated;
    ``.enqueue(session, **params)`` queues a run for a worker instead.  Only
    functions registered this way are ever run by a worker: a task row names
    a registration, never an importable path.
    """

    def __init__(self, queue: TaskQueue, func: Callable[P, R], name: str, options: TaskOptions) -> None:
        self.queue = queue
        self.func = func
        self.name = name
        self.options = options
        functools.update_wrapper(self, func)
        self._signature = _signature_to_check(func)
        self._fitting_keys: set[frozenset[str]] = set()

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.func(*args, **kwargs)

    @overload
    def enqueue(self, session: Session, /, **params: Any) -> TaskMixin: ...

    @overload
    def enqueue(
        self, session: AsyncSession | async_scoped_session[Any], /, **params: Any
    ) -> Coroutine[Any, Any, TaskMixin]: ...

    def enqueue(
        self, session: Session | AsyncSession | async_scoped_session[Any], /, **params: Any
    ) -> TaskMixin | Coroutine[Any, Any, TaskMixin]:
        """Add a run of this task with ``params`` to ``session`` (flushed, not committed).

        With an `AsyncSession`, a coroutine to await; bad params raise here,
        before it is returned.
        """
        return self.queue.enqueue(session, self.name, params)

    @property
    def is_async(self) -> bool:
        """Whether the function is an ``async def``: the worker runs it on an event loop."""
        return inspect.iscoroutinefunction(self.func)

    def check_params(self, params: Mapping[str, Any]) -> None:
        """Params the function can be called with, as the worker will call it (``func(**params)``).

        A `TypeError` naming the task and what does not fit (a missing
        argument, an unexpected one) otherwise: found at enqueue, not on every
        attempt of a task that can never run.  Whether params fit depends only
        on their keys, so each set of keys that fits is remembered (a few
        dozen at most) and ``enqueue_many`` binds once per set, not per task.
        """
        signature = self._signature
        if signature is None:
            return
        keys = frozenset(params)
        if keys in self._fitting_keys:
            return
        try:
            signature.bind(**params)
        except TypeError as error:
            raise TypeError(f"params do not fit task {self.name!r}: {error}") from None
        if len(self._fitting_keys) < _REMEMBERED_KEY_SETS:
            self._fitting_keys.add(keys)

    def __repr__(self) -> str:
        return f"<RegisteredTask {self.name!r}>"


#: How many sets of params keys known to fit a task's function are remembered.
_REMEMBERED_KEY_SETS = 64


def _signature_to_check(func: Callable[..., Any]) -> inspect.Signature | None:
    """The signature params are bound to, or None where any keywords fit or it cannot be read."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # some builtins and C callables have none
        return None
    parameters = signature.parameters.values()
    takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    requires = any(
        p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        for p in parameters
    )
    return None if takes_any_keyword and not requires else signature


def retry_delay(base: timedelta, attempts: int, cap: timedelta) -> timedelta:
    """``base * 2**(attempts-1)``, plus up to 25% jitter, at most ``cap``.

    The jitter spreads the retries of tasks that failed together (an outage
    of the service they call), so they do not all come back at once.
    """
    exponent = min(max(attempts - 1, 0), 32)
    delay = base * (1 << exponent) * random.uniform(1.0, 1.25)
    return min(delay, cap)
