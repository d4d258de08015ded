"""`TaskRows`: the rows of one bulk enqueue, kept as columns rather than a dict per row.

The tasks of one ``enqueue_many`` share their name, queue, priority, times
and options; only their params, and the keys made from them, differ.  A dict
per row would be thousands of objects alive until the INSERT is sent, and
enough new long-lived objects set off the interpreter's full garbage
collection: a pass over every object of the application, tens of
milliseconds with a web framework and SQLAlchemy loaded, in a call that
otherwise takes about as long.  Kept as columns, the shared values are held
once and each row's own in one list per column.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, overload


class TaskRows(Sequence[Mapping[str, Any]]):
    """Rows with ``shared`` values in common and one value each in every list of ``varying``.

    A sequence of mappings, as a list of row dicts would be (a row is built
    when asked for), with `column` for reading a whole column without one.
    """

    def __init__(self, shared: Mapping[str, Any], varying: Mapping[str, Sequence[Any]]) -> None:
        lengths = {len(values) for values in varying.values()}
        if len(lengths) != 1:
            raise ValueError(f"every varying column needs one value per row, got lengths {sorted(lengths)}")
        if shared.keys() & varying.keys():
            raise ValueError(f"columns both shared and varying: {sorted(shared.keys() & varying.keys())}")
        self.shared = dict(shared)
        self.varying = dict(varying)
        self._length = lengths.pop()

    def column(self, name: str) -> Sequence[Any]:
        """Every row's value of ``name``, in row order."""
        if name in self.shared:
            return [self.shared[name]] * self._length
        return self.varying[name]

    def distinct(self, name: str) -> set[Any]:
        """The values of ``name`` among the rows, each once."""
        if name in self.shared:
            return {self.shared[name]}
        return set(self.varying[name])

    def is_shared(self, name: str) -> bool:
        """Whether every row has the same value of ``name`` (held once)."""
        return name in self.shared

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> Mapping[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> TaskRows: ...

    def __getitem__(self, index: int | slice) -> Mapping[str, Any] | TaskRows:
        if isinstance(index, slice):
            return TaskRows(self.shared, {name: values[index] for name, values in self.varying.items()})
        if not -self._length <= index < self._length:
            raise IndexError(f"row {index} of {self._length}")
        return {**self.shared, **{name: values[index] for name, values in self.varying.items()}}


__all__ = ["TaskRows"]
