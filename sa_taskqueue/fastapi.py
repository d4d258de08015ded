"""FastAPI: a transaction per request that ends before the response.

FastAPI ends a ``yield`` dependency after the response has been sent unless
it is declared with ``scope="function"``.  A session that committed there
would tell the client "created" before the commit, and a commit that failed
would never reach it.  `session_dependency` commits when the endpoint
returns, before the response, and rolls back when it raises::

    engine = create_async_engine(url)
    Session = async_sessionmaker(engine)
    DbSession = Annotated[AsyncSession, session_dependency(Session)]

    @app.post("/orders", status_code=201)
    async def create_order(session: DbSession) -> dict[str, int]:
        order = Order(...)
        session.add(order)
        await session.flush()
        return {"id": order.id}          # committed before this is sent

Needs the ``fastapi`` extra (``pip install 'sa_taskqueue[fastapi]'``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Depends, params
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker


def session_dependency(sessionmaker: async_sessionmaker[AsyncSession]) -> params.Depends:
    """A dependency giving each request a session in a transaction that ends before the response.

    The transaction commits when the endpoint returns and rolls back when it
    raises (an `HTTPException` included), so what the endpoint enqueued
    exists exactly when the client is told it succeeded.  Use it as
    ``Annotated[AsyncSession, session_dependency(Session)]``.
    """
    if not isinstance(sessionmaker, async_sessionmaker):
        raise TypeError(
            f"session_dependency takes an sqlalchemy.ext.asyncio.async_sessionmaker, got {sessionmaker!r}"
        )

    async def session_in_transaction() -> AsyncIterator[AsyncSession]:
        async with sessionmaker() as session, session.begin():
            yield session

    # scope="function": end it (commit) when the endpoint returns, not after the response is sent.
    return Depends(session_in_transaction, scope="function")  # type: ignore[no-any-return]


__all__ = ["session_dependency"]
