"""`HealthThresholds`: where a table health figure stops being fine and becomes a finding."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

MIB = 1024 * 1024


@dataclass(frozen=True)
class HealthThresholds:
    """The limits `TableHealth` figures are judged against; each default can be replaced per call.

    A figure *over* its limit gives a finding: a value equal to it does not.
    """

    #: PostgreSQL: dead row versions are flagged once there are more than this many...
    dead_rows: int = 10_000
    #: ...and more than this fraction of the live rows (0.2: a fifth), so a big
    #: table's ordinary churn is not flagged, nor a small table's few dead rows.
    dead_row_ratio: float = 0.2
    #: PostgreSQL, MySQL, MariaDB: a transaction open longer than this.
    transaction_age: timedelta = timedelta(seconds=60)
    #: MySQL, MariaDB: undo records InnoDB has not purged yet.
    history_list_length: int = 100_000
    #: SQLite: the size of the write-ahead log file, in bytes.
    wal_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        for name in ("dead_rows", "history_list_length", "wal_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"threshold {name} must be a whole number, got {value!r}")
            if value < 0:
                raise ValueError(f"threshold {name} must be 0 or more, got {value!r}")
        ratio = self.dead_row_ratio
        if not isinstance(ratio, int | float) or isinstance(ratio, bool):
            raise TypeError(f"threshold dead_row_ratio must be a number, got {ratio!r}")
        if not math.isfinite(ratio) or ratio < 0:
            raise ValueError(f"threshold dead_row_ratio must be a finite number, 0 or more, got {ratio!r}")
        if not isinstance(self.transaction_age, timedelta):
            raise TypeError(f"threshold transaction_age must be a timedelta, got {self.transaction_age!r}")
        if self.transaction_age < timedelta(0):
            raise ValueError(f"threshold transaction_age must not be negative, got {self.transaction_age!r}")

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: the transaction age in seconds."""
        values = asdict(self)
        values["transaction_age"] = self.transaction_age.total_seconds()
        return values


__all__ = ["MIB", "HealthThresholds"]
