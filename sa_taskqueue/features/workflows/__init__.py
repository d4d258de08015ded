"""Workflows: tasks that wait for others (dependencies, chains) and batches of tasks with callbacks.

Every final write of a task that belongs to a batch or has dependents goes
through one seam, `bookkeeping.after_final`, in the transaction of that
fenced write: it releases or cancels the dependents and counts the batch's
members, so a worker killed at any instant leaves both exact.
"""
