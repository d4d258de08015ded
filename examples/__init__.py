"""Runnable applications that use sa_taskqueue; the tests run each against every database."""
