"""`ConcurrencyLimit`: at most N runs at once of the tasks that share a concurrency key.

A limited task's rows carry a ``concurrency_key``, computed here at enqueue
from the task's name and, when asked, some of its params.  The claim gives
each row it starts a slot in ``[0, N)`` of its key, and the table's unique
index on (key, slot) of running rows is what makes the limit hold whatever
workers race (`sa_taskqueue.strategies.limited`).

Keys are namespaced by the task's name, so two tasks never share a key.
A key longer than the column (`CONCURRENCY_KEY_LENGTH`) is replaced by a
SHA-256 digest of itself behind the start of the task's name: equal keys
still map to one digest, and different ones to different digests.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from sa_taskqueue.core import param_types
from sa_taskqueue.core.model import CONCURRENCY_KEY_LENGTH

#: What ``concurrency_key=`` accepts: None (the whole task), a param's name,
#: a tuple of params' names, or a function of the params returning a string.
KeySpec = str | tuple[str, ...] | Callable[[Mapping[str, Any]], str] | None

#: How long a worker's claims leave the limited claim out after one found
#: nothing to take (`TaskQueue.claim`'s ``limited_recheck``): the longest a
#: limited task that became claimable meanwhile waits while the worker is busy
#: with plain tasks and hears of no enqueue.
LIMITED_RECHECK_SECONDS = 0.1


@dataclass(frozen=True)
class ConcurrencyLimit:
    """How many runs of one task may share a key at once, and how the key is made from the params."""

    task_name: str
    limit: int
    key: KeySpec
    signature: inspect.Signature | None = None

    @classmethod
    def of(cls, task_name: str, func: Callable[..., Any], limit: object, key: object) -> ConcurrencyLimit:
        """A checked limit for ``func`` registered as ``task_name``: a `TypeError`/`ValueError` if unfit."""
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"concurrency_limit must be a positive int, got {limit!r}")
        if limit < 1:
            raise ValueError(f"concurrency_limit must be at least 1, got {limit}")
        try:
            signature: inspect.Signature | None = inspect.signature(func)
        except (TypeError, ValueError):
            signature = None
        if key is None or callable(key):
            return cls(task_name, limit, cast("KeySpec", key), signature)
        names = (key,) if isinstance(key, str) else key
        if not isinstance(names, tuple) or not names or not all(isinstance(n, str) for n in names):
            raise TypeError(
                "concurrency_key must be None, a param name, a non-empty tuple of param names "
                f"or a function of the params, got {key!r}"
            )
        if signature is not None:
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
            unknown = [n for n in names if n not in signature.parameters and not takes_any]
            if unknown:
                raise ValueError(
                    f"concurrency_key names params that task {task_name!r} does not take: {unknown}"
                )
        return cls(task_name, limit, names[0] if isinstance(key, str) else names, signature)

    def key_of(self, params: Mapping[str, Any]) -> str:
        """The concurrency key of a run with ``params`` (already checked to fit the function)."""
        if self.key is None:
            return fitted(self.task_name, self.task_name)
        if callable(self.key):
            derived = self.key(params)
            if not isinstance(derived, str):
                raise TypeError(
                    f"concurrency_key of task {self.task_name!r} must return a string, got {derived!r}"
                )
            return fitted(self.task_name, f"{self.task_name}:{derived}")
        names = (self.key,) if isinstance(self.key, str) else self.key
        values = [self._value(params, name) for name in names]
        shown = values[0] if isinstance(self.key, str) else values
        text = json.dumps(shown, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_as_json)
        return fitted(self.task_name, f"{self.task_name}:{text}")

    def _value(self, params: Mapping[str, Any], name: str) -> Any:
        # A param left out takes the function's default, which is what the run sees.
        if name in params:
            return params[name]
        if self.signature is not None:
            parameter = self.signature.parameters.get(name)
            if parameter is not None and parameter.default is not inspect.Parameter.empty:
                return parameter.default
        return None


def _as_json(value: Any) -> Any:
    """A function's default of a typed param (a ``date``, an Enum) as params store it, so keys agree."""
    try:
        known, encoded = param_types.encode(value)
    except (TypeError, ValueError):
        known, encoded = False, None
    return encoded if known else repr(value)


def fitted(task_name: str, key: str) -> str:
    """``key``, or where it is longer than the column, the task's name (cut) and the key's SHA-256."""
    if len(key) <= CONCURRENCY_KEY_LENGTH:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()
    room = CONCURRENCY_KEY_LENGTH - len(digest) - len(":sha256:")
    return f"{task_name[:room]}:sha256:{digest}"


__all__ = ["LIMITED_RECHECK_SECONDS", "ConcurrencyLimit", "KeySpec", "fitted"]
