"""`RegisteredTask`: a function the queue may run, with the defaults it is enqueued with."""

from __future__ import annotations

import functools
import inspect
import random
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, overload

from sa_taskqueue.core import param_types, validation
from sa_taskqueue.core.exceptions import ParamTypeError
from sa_taskqueue.core.limits import ColumnLimits
from sa_taskqueue.core.model import check_parents

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session
    from sqlalchemy.orm import Session, scoped_session

    from sa_taskqueue.core.concurrency import ConcurrencyLimit
    from sa_taskqueue.core.model import TaskMixin
    from sa_taskqueue.core.ports import Enqueuer
    from sa_taskqueue.core.rate_limit import RateLimit

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
    #: At most this many runs sharing a concurrency key at once (``concurrency_limit=``).
    concurrency: ConcurrencyLimit | None = None
    #: At most N starts in any window, per rate key (``rate_limit=``, ``rate_key=``).
    rate: RateLimit | None = None
    #: The params whose values make each enqueue's unique key (`sa_taskqueue.features.unique.derive_key`).
    unique_by: tuple[str, ...] | None = None
    #: The function takes a session first, and its writes through it commit with its completion
    #: (`sa_taskqueue.features.transactional`).
    transactional: bool = False


class RegisteredTask(Generic[P, R]):
    """A function registered with a `TaskQueue`.

    Calling it runs the function here and now, as if it were not decorated;
    ``.enqueue(session, **params)`` queues a run for a worker instead.  Only
    functions registered this way are ever run by a worker: a task row names
    a registration, never an importable path.
    """

    def __init__(self, queue: Enqueuer, func: Callable[P, R], name: str, options: TaskOptions) -> None:
        self.queue = queue
        self.func = func
        self.name = name
        self.options = options
        functools.update_wrapper(self, func)
        self._signature = signature_to_check(func, skip_session=options.transactional)
        self._fitting_keys: set[frozenset[str]] = set()
        self._async_of: object = None
        self._is_async = False
        # The params whose annotations ask for a type JSON does not hold (most ask for none):
        # read once here, and again only if the process registers a param type meanwhile.
        self._converters_version = param_types.registry_version()
        self._converters = param_types.converters_for(func)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.func(*args, **kwargs)

    @overload
    def enqueue(self, session: Session | scoped_session[Any], /, **params: Any) -> TaskMixin: ...

    @overload
    def enqueue(
        self, session: AsyncSession | async_scoped_session[Any], /, **params: Any
    ) -> Coroutine[Any, Any, TaskMixin]: ...

    def enqueue(
        self,
        session: Session | scoped_session[Any] | AsyncSession | async_scoped_session[Any],
        /,
        **params: Any,
    ) -> TaskMixin | Coroutine[Any, Any, TaskMixin]:
        """Add a run of this task with ``params`` to ``session`` (flushed, not committed).

        With an `AsyncSession`, a coroutine to await; bad params raise here,
        before it is returned.  ``depends_on=[...]``,
        ``on_parent_failure=...`` and ``batch=...`` among ``params`` are the
        enqueue's options (`TaskQueue.enqueue`), unless the function has a
        parameter of that name: then they are its params, and
        ``task.using(depends_on=[...])`` or ``batch.enqueue(task, ...)`` gives
        the option.
        """
        options = self.workflow_options(params)
        return self.queue.enqueue(session, self.name, params, **options)

    def call(self, **params: Any) -> TaskCall:
        """A run of this task with ``params``, not enqueued yet: a step of `TaskQueue.chain`."""
        return TaskCall(self, params)

    def workflow_options(self, params: dict[str, Any]) -> dict[str, Any]:
        """The enqueue options (`WORKFLOW_OPTIONS`) out of ``params``, unless the function takes them."""
        options: dict[str, Any] = {}
        for option in WORKFLOW_OPTIONS:
            if option in params and not self.names_param(option):
                options[option] = params.pop(option)
        return options

    def names_param(self, name: str) -> bool:
        """Whether the function has a parameter called ``name`` (not through ``**kwargs``)."""
        try:
            parameter = inspect.signature(self.func).parameters.get(name)
        except (TypeError, ValueError):
            return False
        return parameter is not None and parameter.kind is not inspect.Parameter.VAR_KEYWORD

    def using(
        self,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: timedelta | None = None,
        max_attempts: int | None = None,
        unique_key: str | None = None,
        depends_on: Iterable[Any] | None = None,
        on_parent_failure: str | None = None,
    ) -> TaskWithOptions:
        """This task with options for the enqueues made through what it returns.

        ``task.using(queue="mail", delay=timedelta(minutes=5)).enqueue(session, **params)``
        enqueues like ``enqueue``, with these options in place of the
        registration's; an option left None keeps the registration's.  ``delay``
        is counted from each enqueue (by the queue's clock); ``run_at`` and
        ``delay`` together are refused.  Every option is checked here, so a bad
        one fails where it is written, not at a later enqueue.  ``unique_key``
        replaces the key ``unique_by`` would derive (see `TaskQueue.enqueue`).
        ``depends_on`` and ``on_parent_failure`` make each enqueue wait for
        those tasks (see `TaskQueue.enqueue`).
        """
        return TaskWithOptions(
            self,
            queue,
            priority,
            run_at,
            delay,
            max_attempts,
            unique_key=unique_key,
            depends_on=depends_on,
            on_parent_failure=on_parent_failure,
        )

    @property
    def is_async(self) -> bool:
        """Whether the function is an ``async def``: the worker runs it on an event loop."""
        # Asked for every task a worker runs: looked up once per function.
        func = self.func
        if self._async_of is not func:
            self._is_async = inspect.iscoroutinefunction(func)
            self._async_of = func
        return self._is_async

    def call_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The stored ``params`` as the function is called with them: each converted to its annotated type.

        A param annotated ``datetime``, ``Decimal``, ``list[UUID]``,
        ``Color | None``, a registered class, ... is decoded from its JSON
        (`sa_taskqueue.core.param_types`); the others are passed as they are,
        and ``params`` itself is returned when no annotation asks for a
        conversion.  A value that cannot become its type raises
        `ParamTypeError`, naming this task and the param.
        """
        if self._converters_version != param_types.registry_version():
            self._converters_version = param_types.registry_version()
            self._converters = param_types.converters_for(self.func)
        converters = self._converters
        if not converters:
            return params
        try:
            return param_types.convert_params(converters, params)
        except param_types.ParamMismatch as mismatch:
            raise ParamTypeError(self.name, "".join(reversed(mismatch.path)), mismatch.problem) from None

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


class TaskWithOptions:
    """A registered task with per-call options: what ``RegisteredTask.using(...)`` returns.

    Its ``enqueue`` and ``enqueue_many`` pass straight through to the queue's
    with these options, so they check params against the function's
    signature and return what the queue's return.
    """

    def __init__(
        self,
        task: RegisteredTask[Any, Any],
        queue: str | None,
        priority: int | None,
        run_at: datetime | None,
        delay: timedelta | None,
        max_attempts: int | None,
        *,
        unique_key: str | None = None,
        depends_on: Iterable[Any] | None = None,
        on_parent_failure: str | None = None,
    ) -> None:
        limits = ColumnLimits.of(task.queue.table)
        if depends_on is not None:
            depends_on = check_parents(depends_on)
        if on_parent_failure not in (None, "cancel", "run"):
            raise ValueError(f"on_parent_failure must be 'cancel' or 'run', got {on_parent_failure!r}")
        if unique_key is not None:
            validation.check_text("unique_key", unique_key, limits.unique_key_length)
        if queue is not None:
            validation.check_queue_name(queue, limits)
        if priority is not None:
            validation.check_priority(priority, limits)
        if max_attempts is not None:
            validation.check_max_attempts(max_attempts, limits)
        if run_at is not None and delay is not None:
            raise ValueError("pass run_at or delay, not both: each says when the task is due")
        if run_at is not None:
            validation.check_run_at(run_at)
        if delay is not None:
            validation.check_delay(delay)
            validation.run_at_after(task.queue.clock(), delay)  # a delay past what a database stores
        self.task = task
        #: The queue's name (``task.queue`` is the `TaskQueue`).
        self.queue_name = queue
        self.priority = priority
        self.run_at = run_at
        self.delay = delay
        self.max_attempts = max_attempts
        self.unique_key = unique_key
        self.depends_on = depends_on
        self.on_parent_failure = on_parent_failure

    def using(
        self,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: timedelta | None = None,
        max_attempts: int | None = None,
        unique_key: str | None = None,
        depends_on: Iterable[Any] | None = None,
        on_parent_failure: str | None = None,
    ) -> TaskWithOptions:
        """These options with some replaced; a new ``run_at`` replaces a ``delay`` and the reverse."""
        when_given = run_at is not None or delay is not None
        return TaskWithOptions(
            self.task,
            self.queue_name if queue is None else queue,
            self.priority if priority is None else priority,
            run_at if when_given else self.run_at,
            delay if when_given else self.delay,
            self.max_attempts if max_attempts is None else max_attempts,
            unique_key=self.unique_key if unique_key is None else unique_key,
            depends_on=self.depends_on if depends_on is None else depends_on,
            on_parent_failure=self.on_parent_failure if on_parent_failure is None else on_parent_failure,
        )

    @overload
    def enqueue(self, session: Session | scoped_session[Any], /, **params: Any) -> TaskMixin: ...

    @overload
    def enqueue(
        self, session: AsyncSession | async_scoped_session[Any], /, **params: Any
    ) -> Coroutine[Any, Any, TaskMixin]: ...

    def enqueue(
        self,
        session: Session | scoped_session[Any] | AsyncSession | async_scoped_session[Any],
        /,
        **params: Any,
    ) -> TaskMixin | Coroutine[Any, Any, TaskMixin]:
        """Add a run of the task with ``params`` and these options to ``session`` (flushed, not committed).

        With an `AsyncSession`, a coroutine to await, as `TaskQueue.enqueue`.
        ``depends_on``, ``on_parent_failure`` and ``batch`` among ``params``
        are taken as `RegisteredTask.enqueue` takes them, over these options.
        """
        options: dict[str, Any] = {"depends_on": self.depends_on, "on_parent_failure": self.on_parent_failure}
        options.update(self.task.workflow_options(params))
        return self.task.queue.enqueue(
            session,
            self.task.name,
            params,
            queue=self.queue_name,
            priority=self.priority,
            run_at=self._run_at(),
            max_attempts=self.max_attempts,
            unique_key=self.unique_key,
            **options,
        )

    @overload
    def enqueue_many(
        self,
        session: Session | scoped_session[Any],
        params_list: Iterable[dict[str, Any] | None],
        /,
        *,
        chunk_size: int = 1000,
        batch: Any = None,
    ) -> list[int] | None: ...

    @overload
    def enqueue_many(
        self,
        session: AsyncSession | async_scoped_session[Any],
        params_list: Iterable[dict[str, Any] | None],
        /,
        *,
        chunk_size: int = 1000,
        batch: Any = None,
    ) -> Coroutine[Any, Any, list[int] | None]: ...

    def enqueue_many(
        self,
        session: Session | scoped_session[Any] | AsyncSession | async_scoped_session[Any],
        params_list: Iterable[dict[str, Any] | None],
        /,
        *,
        chunk_size: int = 1000,
        batch: Any = None,
    ) -> list[int] | Coroutine[Any, Any, list[int] | None] | None:
        """One run per params dict, with these options, one INSERT per ``chunk_size``, as ``enqueue_many``.

        With an `AsyncSession`, a coroutine to await.  ``batch``: the batch
        (a `Batch` or its id) every row joins.
        """
        # (One call for every kind of session: the queue's overloads pick the return type.)
        return self.task.queue.enqueue_many(
            session,
            self.task.name,
            params_list,
            queue=self.queue_name,
            priority=self.priority,
            run_at=self._run_at(),
            max_attempts=self.max_attempts,
            chunk_size=chunk_size,
            batch=batch,
            unique_key=self.unique_key,
            depends_on=self.depends_on,
            on_parent_failure=self.on_parent_failure,
        )

    def call(self, **params: Any) -> TaskCall:
        """A run of the task with ``params`` and these options, not enqueued yet (`TaskQueue.chain`)."""
        return TaskCall(self, params)

    def options(self) -> dict[str, Any]:
        """These options as `TaskQueue.enqueue` takes them (a ``delay`` counted from now)."""
        return {
            "queue": self.queue_name,
            "priority": self.priority,
            "run_at": self._run_at(),
            "max_attempts": self.max_attempts,
            "unique_key": self.unique_key,
            "depends_on": self.depends_on,
            "on_parent_failure": self.on_parent_failure,
        }

    def _run_at(self) -> datetime | None:
        if self.delay is None:
            return self.run_at
        return validation.run_at_after(self.task.queue.clock(), self.delay)

    def __repr__(self) -> str:
        options = {
            "queue": self.queue_name,
            "priority": self.priority,
            "run_at": self.run_at,
            "delay": self.delay,
            "max_attempts": self.max_attempts,
            "unique_key": self.unique_key,
        }
        shown = ", ".join(f"{key}={value!r}" for key, value in options.items() if value is not None)
        return f"<TaskWithOptions {self.task.name!r} {shown}>"


@dataclass(frozen=True)
class TaskCall:
    """One run of a registered task, with its params and options, to be enqueued later (`TaskQueue.chain`).

    Made by ``task.call(**params)`` or ``task.using(...).call(**params)``:
    ``task`` is then that task, or that task with its options.
    """

    task: RegisteredTask[Any, Any] | TaskWithOptions
    params: dict[str, Any]

    @property
    def registered(self) -> RegisteredTask[Any, Any]:
        """The registered task this call runs."""
        return self.task.task if isinstance(self.task, TaskWithOptions) else self.task

    def options(self) -> dict[str, Any]:
        """The enqueue options it was made with (none for ``task.call``)."""
        return self.task.options() if isinstance(self.task, TaskWithOptions) else {}


#: The enqueue options ``task.enqueue(session, **params)`` takes out of its params (`RegisteredTask.enqueue`).
WORKFLOW_OPTIONS = ("depends_on", "on_parent_failure", "batch")

#: How many sets of params keys known to fit a task's function are remembered.
_REMEMBERED_KEY_SETS = 64


def signature_to_check(func: Callable[..., Any], *, skip_session: bool = False) -> inspect.Signature | None:
    """The signature params are bound to, or None where any keywords fit or it cannot be read.

    ``skip_session`` leaves out the first parameter: a transactional task's
    session, which the worker passes and params never hold.
    """
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # some builtins and C callables have none
        return None
    if skip_session:
        signature = without_session(signature)
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


def without_session(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` without its first parameter: what a transactional task's enqueued params are bound to."""
    return signature.replace(parameters=list(signature.parameters.values())[1:])
