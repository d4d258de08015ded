"""One session per backend (the same test files, the backend a fixture parameter), plus lint.

``nox -s tests-postgres tests-mysql tests-sqlite`` runs the conformance suite
on each, on the newest SQLAlchemy 2.0.x and 2.1.x.  A session's database URL
comes from SA_TASKQUEUE_TEST_<BACKEND>_URL, else the local server, else a
testcontainer where Docker runs (see tests/backends.py).
"""

from __future__ import annotations

import nox

nox.options.reuse_existing_virtualenvs = True
# uv builds the session environments in seconds; plain virtualenv + pip where it is missing.
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.error_on_missing_interpreters = True

SQLALCHEMY_SERIES = ["2.0", "2.1"]
BACKENDS = ["sqlite", "postgres", "mysql", "mariadb", "oracle"]


#: The series that runs the whole suite; the others run all but the tests that
#: start worker processes (marked slow), which exercise our runtime rather
#: than SQLAlchemy and would double the matrix's time.
FULL_SUITE_SERIES = SQLALCHEMY_SERIES[-1]


def _tests(session: nox.Session, backend: str, sqlalchemy: str) -> None:
    session.install("-e", ".[test]", f"SQLAlchemy~={sqlalchemy}.0")
    session.run("python", "-c", "import sqlalchemy; print('SQLAlchemy', sqlalchemy.__version__)")
    selection = [] if sqlalchemy == FULL_SUITE_SERIES else ["-m", "not slow"]
    session.run("pytest", "--backend", backend, *selection, *session.posargs)


def _make_session(backend: str) -> None:
    @nox.session(name=f"tests-{backend}")
    @nox.parametrize("sqlalchemy", SQLALCHEMY_SERIES)
    def tests(session: nox.Session, sqlalchemy: str) -> None:
        _tests(session, backend, sqlalchemy)

    tests.__doc__ = f"The conformance suite against {backend}."


for _backend in BACKENDS:
    _make_session(_backend)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff on everything, mypy --strict on the package."""
    session.install("-e", ".[lint]")
    session.run("ruff", "check", "sa_taskqueue", "tests", "alembic", "noxfile.py")
    session.run("mypy", "--strict", "sa_taskqueue")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmarks (python -m benchmarks) against the local servers; arguments pass through."""
    session.install("-e", ".[bench]")
    session.run("python", "-m", "benchmarks", *session.posargs)
