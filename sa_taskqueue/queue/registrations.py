"""`Registrations`: the functions a queue may run, each checked once, when its module is imported.

A task's name defaults to ``module.qualname`` of its function; a second
function under a taken name is refused, since rows would run the wrong
code.  Periodic tasks are ordinary registrations with a schedule beside
them (`sa_taskqueue.features.schedules`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sa_taskqueue.core import validation
from sa_taskqueue.core.concurrency import ConcurrencyLimit, KeySpec
from sa_taskqueue.core.ports import Enqueuer
from sa_taskqueue.core.rate_limit import RateLimit
from sa_taskqueue.core.registered import RegisteredTask, TaskOptions, signature_to_check
from sa_taskqueue.features import unique
from sa_taskqueue.features.concurrency import ConcurrencyClaims
from sa_taskqueue.features.schedules import PeriodicTask, Schedule, Schedules
from sa_taskqueue.features.transactional import check_transactional
from sa_taskqueue.queue.parts import QueueParts

P = ParamSpec("P")
R = TypeVar("R")


class Registrations:
    """The registered tasks of one queue (``tasks``, shared with the parts that read them)."""

    def __init__(
        self,
        queue: Enqueuer,
        parts: QueueParts,
        tasks: dict[str, RegisteredTask[Any, Any]],
        concurrency: ConcurrencyClaims,
        schedules: Schedules,
    ) -> None:
        self._queue = queue
        self._parts = parts
        self.tasks = tasks
        self._concurrency = concurrency
        self._schedules = schedules

    def decorator(
        self,
        name: str | None,
        *,
        queue: str,
        priority: int,
        max_attempts: int,
        retry_delay: timedelta,
        timeout: timedelta | float | None,
        concurrency_limit: int | None,
        concurrency_key: KeySpec,
        unique_by: Sequence[str] | None,
        transactional: bool,
        rate_limit: str | Sequence[str] | None = None,
        rate_key: KeySpec = None,
    ) -> Callable[[Callable[P, R]], RegisteredTask[P, R]]:
        """`TaskQueue.task`'s options checked; the decorator that registers a function with them."""
        if not isinstance(transactional, bool):
            raise TypeError(f"transactional must be True or False, got {transactional!r}")
        limits = self._parts.limits
        validation.check_queue_name(queue, limits)
        validation.check_priority(priority, limits)
        validation.check_max_attempts(max_attempts, limits)
        validation.check_retry_delay(retry_delay)
        options = TaskOptions(queue, priority, max_attempts, retry_delay, validation.timeout_seconds(timeout))

        if concurrency_limit is None and concurrency_key is not None:
            raise ValueError("concurrency_key needs a concurrency_limit")
        if rate_limit is None and rate_key is not None:
            raise ValueError("rate_key needs a rate_limit")
        if rate_limit is not None and concurrency_limit is not None:
            raise ValueError(
                "a task takes either rate_limit or concurrency_limit, not both (not yet supported)"
            )

        def register(func: Callable[P, R]) -> RegisteredTask[P, R]:
            if name is None:
                check_importable_module(func)
            task_name = name if name is not None else f"{func.__module__}.{func.__qualname__}"
            if not isinstance(task_name, str) or not task_name:
                raise ValueError(f"task name must be a non-empty string, got {task_name!r}")
            validation.check_task_name(task_name, limits)
            if transactional:
                check_transactional(func, task_name, queue_is_async=self._parts.is_async)
            task_options = replace(
                options,
                unique_by=unique.check_unique_by(unique_by, func, task_name),
                transactional=transactional,
            )
            if concurrency_limit is not None:
                limit = ConcurrencyLimit.of(task_name, func, concurrency_limit, concurrency_key)
                task_options = replace(task_options, concurrency=limit)
            if rate_limit is not None:
                task_options = replace(task_options, rate=RateLimit.of(task_name, func, rate_limit, rate_key))
            existing = self.tasks.get(task_name)
            if existing is not None and existing.func is not func:
                raise ValueError(f"a task is already registered under {task_name!r}: {existing.func!r}")
            registered = RegisteredTask(self._queue, func, task_name, task_options)
            self.tasks[task_name] = registered
            self._concurrency.registered_changed()
            return registered

        return register

    def periodic_decorator(
        self,
        schedule: Schedule,
        params: dict[str, Any] | None,
        register: Callable[[Callable[P, R]], RegisteredTask[P, R]],
    ) -> Callable[[Callable[P, R]], RegisteredTask[P, R]]:
        """``register`` (`decorator`'s), with ``params`` checked now and against each function it gets."""
        run_params = dict(validation.storable_params({} if params is None else params))

        def register_periodic(func: Callable[P, R]) -> RegisteredTask[P, R]:
            signature = signature_to_check(func)
            if signature is not None:
                try:
                    signature.bind(**run_params)
                except TypeError as error:  # before registering: nothing half-done
                    raise TypeError(f"params do not fit periodic task {func!r}: {error}") from None
            registered = register(func)
            self._schedules.add(PeriodicTask(registered, schedule, run_params))
            return registered

        return register_periodic


def check_importable_module(func: Callable[..., Any]) -> None:
    """Refuse to name a task after a module run as a script: no worker would find that name.

    A script run directly (``python app.py``, ``python -m app``) is the
    module ``__main__``, so its function ``hello`` would be stored as
    ``__main__.hello``, while a worker imports the module by its real name
    and registers ``app.hello``: the tasks would wait for ever, unclaimed.
    """
    if func.__module__ != "__main__":
        return
    qualname = func.__qualname__
    real = _script_module_name()
    as_imported = f" (as {real}.{qualname})" if real else ""
    raise ValueError(
        f"cannot name task {qualname!r} after its module: it is defined in a script run directly, "
        f"the module __main__, so it would be stored as '__main__.{qualname}', a name no worker finds: "
        f"a worker imports the module by its real name{as_imported} and registers that. Give the task "
        f'a name of its own (@queue.task(name="{qualname}")), or register it in a module the script '
        "imports"
    )


def _script_module_name() -> str | None:
    """The name the script run as ``__main__`` has when imported (``app`` for ``python app.py``)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return str(spec.name).removesuffix(".__main__")
    path = getattr(main, "__file__", None)
    return Path(path).stem if isinstance(path, str) else None


__all__ = ["Registrations", "check_importable_module"]
