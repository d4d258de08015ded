"""The FastAPI helpers on the backend under test: a transaction per request that ends before the response.

A small app of the test's own, driven through Starlette's TestClient, with
a table whose key is unique: a commit that fails must reach the client as an
error, never follow a success it was already sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from sa_taskqueue.integrations.fastapi import session_dependency
from tests.async_drivers import async_url
from tests.backends import Backend


class NoteBase(DeclarativeBase):
    pass


class Note(NoteBase):
    __tablename__ = "fastapi_helper_note"

    key: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)


def note_app(url: str) -> FastAPI:
    """An app whose ``POST /notes/KEY`` adds a note without flushing, so a duplicate fails at commit."""
    engine = create_async_engine(url)
    # As a default rather than in Annotated: this module's annotations are strings that FastAPI
    # resolves in the module's globals, where a local alias is not.
    in_transaction = session_dependency(async_sessionmaker(engine))
    app = FastAPI()

    @app.post("/notes/{key}", status_code=201)
    async def add(key: int, session: AsyncSession = in_transaction) -> dict[str, int]:
        session.add(Note(key=key))
        return {"key": key}

    @app.post("/notes/{key}/refused")
    async def refuse(key: int, session: AsyncSession = in_transaction) -> dict[str, int]:
        session.add(Note(key=key))
        await session.flush()
        raise HTTPException(409, "refused after the write")

    return app


@pytest.fixture
def database(backend: Backend, tmp_path: Path) -> Iterator[str]:
    """The backend's sync URL, with the note table empty."""
    url = f"sqlite:///{tmp_path / 'notes.db'}" if backend.is_sqlite else backend.url
    engine = sa.create_engine(url)
    NoteBase.metadata.drop_all(engine)
    NoteBase.metadata.create_all(engine)
    yield url
    NoteBase.metadata.drop_all(engine)
    engine.dispose()


def keys(url: str) -> list[int]:
    engine = sa.create_engine(url)
    try:
        with sessionmaker(engine)() as session:
            return list(session.scalars(sa.select(Note.key).order_by(Note.key)))
    finally:
        engine.dispose()


def test_the_request_s_transaction_commits_when_the_endpoint_returns(database: str) -> None:
    with TestClient(note_app(async_url(database))) as client:
        assert client.post("/notes/1").status_code == 201
        assert keys(database) == [1]


def test_an_endpoint_that_raises_rolls_its_transaction_back(database: str) -> None:
    with TestClient(note_app(async_url(database))) as client:
        response = client.post("/notes/2/refused")
        assert response.status_code == 409
        assert keys(database) == []


def test_a_commit_that_fails_is_the_response_not_after_it(database: str) -> None:
    with TestClient(note_app(async_url(database)), raise_server_exceptions=False) as client:
        assert client.post("/notes/3").status_code == 201
        duplicate = client.post("/notes/3")
        # The commit ran before the response was made, so its failure is the response.
        assert duplicate.status_code == 500
        assert keys(database) == [3]


def test_session_dependency_takes_an_async_sessionmaker_only() -> None:
    sync_sessions = sessionmaker(sa.create_engine("sqlite://"))
    with pytest.raises(TypeError, match="async_sessionmaker"):
        session_dependency(sync_sessions)  # type: ignore[arg-type]
