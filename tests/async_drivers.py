"""The suite's database URLs in the asyncio driver form an AsyncEngine needs."""

from __future__ import annotations

import sqlalchemy as sa

#: The asyncio driver for each database the suite's URLs name.
ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",  # psycopg 3 is sync and async in one driver
    "mysql": "mysql+aiomysql",
    "mariadb": "mariadb+aiomysql",
    "oracle": "oracle+oracledb",  # python-oracledb too
}


def async_url(url: str) -> str:
    """``url`` with its database's asyncio driver, the password kept."""
    parsed = sa.make_url(url)
    driver = ASYNC_DRIVERS[parsed.get_backend_name()]
    return parsed.set(drivername=driver).render_as_string(hide_password=False)
