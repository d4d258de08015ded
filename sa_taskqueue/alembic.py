"""``sa_taskqueue.alembic``: the Alembic integration, at home in `sa_taskqueue.integrations.alembic`."""

from sa_taskqueue.integrations.alembic import (
    LIBRARY_TABLES,
    OUR_TYPES,
    include_object,
    physical_type_source,
    render_item,
)

__all__ = [
    "LIBRARY_TABLES",
    "OUR_TYPES",
    "include_object",
    "physical_type_source",
    "render_item",
]
