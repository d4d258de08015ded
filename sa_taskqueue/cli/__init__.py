"""The command line: ``sa-taskqueue`` (or ``python -m sa_taskqueue``)."""

# Commands kept in modules of their own add themselves to `cli` when imported.
from sa_taskqueue.cli import batches as _batches  # noqa: F401
from sa_taskqueue.cli import dashboard as _dashboard  # noqa: F401
from sa_taskqueue.cli import workers as _workers  # noqa: F401
from sa_taskqueue.cli.main import cli, configure_logging, main, parse_queues, worker_options

__all__ = ["cli", "configure_logging", "main", "parse_queues", "worker_options"]
