"""Workflows: tasks that wait for others (dependencies) and batches whose callbacks run once."""
