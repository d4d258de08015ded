"""What the soak tells its workers, through their environment: the database, the lease, the log."""

URL_ENV = "SA_TASKQUEUE_SOAK_URL"
LEASE_ENV = "SA_TASKQUEUE_SOAK_LEASE"
LOG_ENV = "SA_TASKQUEUE_SOAK_LOG"
