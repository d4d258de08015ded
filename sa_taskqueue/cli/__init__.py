"""The command line: ``sa-taskqueue`` (or ``python -m sa_taskqueue``)."""

from sa_taskqueue.cli.main import cli, configure_logging, main, parse_queues, worker_options

__all__ = ["cli", "configure_logging", "main", "parse_queues", "worker_options"]
