"""``python -m sa_taskqueue``: the command line."""

from sa_taskqueue.cli.main import main

main()
