"""The rows of a bulk enqueue, held as columns, read as the list of row dicts they stand for."""

from __future__ import annotations

import pytest

from sa_taskqueue.core.task_rows import TaskRows


def rows_and_dicts() -> tuple[TaskRows, list[dict[str, object]]]:
    shared = {"name": "send", "queue": "mail"}
    params = [{"n": n} for n in range(5)]
    keys = [f"k{n}" for n in range(5)]
    dicts: list[dict[str, object]] = [
        {**shared, "params": p, "unique_key": k} for p, k in zip(params, keys, strict=True)
    ]
    return TaskRows(shared, {"params": params, "unique_key": keys}), dicts


def test_rows_read_as_the_row_dicts_they_hold() -> None:
    rows, dicts = rows_and_dicts()
    assert len(rows) == len(dicts)
    assert list(rows) == dicts
    assert rows[-1] == dicts[-1] and rows[0] == dicts[0]
    assert list(rows[1:4]) == dicts[1:4]
    assert list(rows[::2]) == dicts[::2]
    assert isinstance(rows[1:4], TaskRows), "a slice stays columns"


def test_a_column_and_its_distinct_values_are_read_without_building_rows() -> None:
    rows, dicts = rows_and_dicts()
    assert rows.column("queue") == [row["queue"] for row in dicts]
    assert rows.column("unique_key") == [row["unique_key"] for row in dicts]
    assert rows.distinct("queue") == {"mail"}
    assert rows.is_shared("queue") and not rows.is_shared("params")


def test_a_row_past_the_end_is_an_index_error() -> None:
    rows, _ = rows_and_dicts()
    with pytest.raises(IndexError, match="row 5 of 5"):
        rows[5]
    with pytest.raises(IndexError):
        rows[-6]


def test_columns_of_different_lengths_or_both_shared_and_varying_are_refused() -> None:
    with pytest.raises(ValueError, match="one value per row"):
        TaskRows({}, {"params": [{}, {}], "unique_key": ["only one"]})
    with pytest.raises(ValueError, match="both shared and varying"):
        TaskRows({"queue": "mail"}, {"queue": ["a"], "params": [{}]})
