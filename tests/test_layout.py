"""The package's structure, as rules a change can break.

Each test states one rule a contributor can rely on, and names every place
that breaks it.  None needs a database: what they read (the source files,
the import graph, import-linter's verdict) is computed once per session.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sa_taskqueue"
#: The one place that may name a database or a driver in code.
BACKENDS = PACKAGE / "backends"

MAX_ROOT_MODULES = 15
MAX_CLASS_LINES = 600

#: Database and driver names, matched case-insensitively anywhere in a name or a string.
DATABASE_NAMES = re.compile(
    r"postgres|psql|mysql|mariadb|sqlite|oracle|psycopg|pymysql|asyncpg|aiomysql|asyncmy"
    r"|aiosqlite|oracledb|cx_oracle|mysqldb|pysqlite",
    re.IGNORECASE,
)


@cache
def package_files() -> tuple[Path, ...]:
    return tuple(sorted(PACKAGE.rglob("*.py")))


@cache
def source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# Size ----------------------------------------------------------------------------------


def test_the_package_root_holds_few_modules() -> None:
    """The package root holds at most 15 modules: new code goes into the layer it belongs to.

    ``sa_taskqueue/*.py`` is the public face (``__init__``, ``__main__``, the
    short integration paths and the old-path shims); everything else lives in
    ``backends/``, ``core/``, ``strategies/``, ``features/``, ``health/``,
    ``worker/``, ``queue``, ``cli/`` or ``integrations/``.
    """
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_ROOT_MODULES, (
        f"{len(modules)} modules in sa_taskqueue/ (at most {MAX_ROOT_MODULES}): {', '.join(modules)}"
    )


@cache
def class_sizes() -> tuple[tuple[str, int], ...]:
    """Every class of the package, as ``path:line Name`` and its length in lines (decorators included)."""
    sizes = []
    for path in package_files():
        for node in ast.walk(ast.parse(source(path), filename=str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
                sizes.append((f"{shown(path)}:{node.lineno} {node.name}", node.end_lineno - first + 1))
    return tuple(sizes)


def test_no_class_is_over_600_lines() -> None:
    """No class in the package is longer than 600 lines: a class that grows past it is split into parts.

    A coordinator (`TaskQueue`, `Worker`) wires parts together; each part
    owns its state and is small enough to read in one sitting.
    """
    assert class_sizes(), "no classes found: the test reads the wrong files"
    too_long = sorted(
        ((where, size) for where, size in class_sizes() if size > MAX_CLASS_LINES), key=lambda item: -item[1]
    )
    assert not too_long, f"classes over {MAX_CLASS_LINES} lines: " + "; ".join(
        f"{where} ({size} lines)" for where, size in too_long
    )


# Imports ---------------------------------------------------------------------------------


@cache
def import_graph() -> grimp.ImportGraph:
    # Every import counts: module level, inside functions, and under ``if TYPE_CHECKING:``.
    return grimp.build_graph("sa_taskqueue", cache_dir=None)


@cache
def import_circles() -> tuple[tuple[str, ...], ...]:
    return circles_of(import_graph())


def circles_of(graph: grimp.ImportGraph) -> tuple[tuple[str, ...], ...]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[tuple[str, ...]] = []

    def imported_by(module: str) -> Iterator[str]:
        return iter(sorted(graph.find_modules_directly_imported_by(module)))

    for start in sorted(graph.modules):
        if start in index:
            continue
        index[start] = lowest[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, imported_by(start))]
        while work:
            module, pending = work[-1]
            for imported in pending:
                if imported not in index:
                    index[imported] = lowest[imported] = len(index)
                    stack.append(imported)
                    on_stack.add(imported)
                    work.append((imported, imported_by(imported)))
                    break
                if imported in on_stack:
                    lowest[module] = min(lowest[module], index[imported])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    lowest[parent] = min(lowest[parent], lowest[module])
                if lowest[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        circles.append(tuple(sorted(component)))
    return tuple(sorted(circles))


def test_no_import_circles() -> None:
    """No module of the package imports, directly or through others, a module that imports it.

    Imports inside functions and under ``if TYPE_CHECKING:`` count: they
    hide a circle from the interpreter, not from the reader, and the fix is
    the same, a module for what both sides need, in the lower layer.

    A package's ``__init__`` that re-exports its submodules is no circle
    with them: grimp records only the imports a module's code makes, and a
    submodule's code does not import its package (Python runs the package's
    ``__init__`` first, but that is not an import the submodule wrote).  It
    becomes one when a submodule imports a name back from its own package
    (``from sa_taskqueue.backends import backend_for`` inside
    ``backends/mysql.py``), and then it is a real circle, one that fails
    with "partially initialized module" depending on which is imported
    first: import from the defining submodule instead.
    """
    assert len(import_graph().modules) > 50, "the graph does not hold the package's modules"
    assert not import_circles(), "import circles: " + "; ".join(
        " <-> ".join(circle) for circle in import_circles()
    )


def test_the_circle_finder_finds_a_circle() -> None:
    """The check above can fail: in a small graph it finds the circle, through three modules, and only it."""
    graph = grimp.ImportGraph()
    for importer, imported in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e")]:
        graph.add_import(importer=importer, imported=imported)
    assert circles_of(graph) == (("a", "b", "c"),)


def test_the_layers_contract_holds() -> None:
    """import-linter's contracts in pyproject.toml hold: nothing imports a layer above its own.

    Layers, low to high: backends, core, strategies, features, health,
    worker, queue, cli, integrations.  A module lives in the lowest layer
    whose imports it needs.
    """
    command = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(command) if command.exists() else "lint-imports", "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# Database names ---------------------------------------------------------------------------


def _docstring_spans(tree: ast.Module) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where each module, class and function docstring starts and ends, as (line, column) pairs."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
                and first.end_lineno is not None
                and first.end_col_offset is not None
            ):
                spans.append(((first.lineno, first.col_offset), (first.end_lineno, first.end_col_offset)))
    return spans


#: The tokens that are code: names, and strings (f-strings come as parts from Python 3.12 on).
_CODE_TOKENS = {tokenize.NAME, tokenize.STRING} | {
    getattr(tokenize, name)
    for name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
    if hasattr(tokenize, name)
}


def database_names_in(text: str) -> list[tuple[int, str]]:
    """Each name or string in ``text`` (Python source) that names a database or driver, with its line.

    Comments and docstrings are not code and may name databases.
    """
    docstrings = _docstring_spans(ast.parse(text))
    found = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in _CODE_TOKENS or not DATABASE_NAMES.search(token.string):
            continue
        if any(start <= token.start and token.end <= end for start, end in docstrings):
            continue
        found.append((token.start[0], token.string))
    return found


@cache
def database_names_outside_backends() -> tuple[str, ...]:
    found = []
    for path in package_files():
        if path.is_relative_to(BACKENDS):
            continue
        for line, token in database_names_in(source(path)):
            found.append(f"{shown(path)}:{line}: {token if len(token) <= 70 else token[:67] + '...'}")
    return tuple(found)


def test_only_backends_name_databases_and_drivers_in_code() -> None:
    """Database and driver names appear in code only in ``sa_taskqueue/backends/``.

    Everywhere else code asks a backend (``backend_for(dialect)``) for a
    capability, a type or a statement, and a message takes the database's
    name from ``backend.label``.  Comments and docstrings may name
    databases: that is where a difference is explained.
    """
    names = database_names_outside_backends()
    assert not names, "database or driver names in code outside backends/:\n" + "\n".join(names)


def test_the_name_check_sees_names_and_not_docstrings() -> None:
    """The check above can fail: it flags names, strings and imports, not docstrings and comments."""
    code = (
        '"""Only PostgreSQL has this."""\n'
        "from sqlalchemy.dialects import postgresql  # a comment on MySQL\n"
        "def f(x):\n"
        '    """Explained: SQLite differs."""\n'
        '    return x.name == "mariadb" or f"{x} on Oracle"\n'
    )
    assert [line for line, _ in database_names_in(code)] == [2, 5, 5]


# Old import paths and integrations -----------------------------------------------------------


def _moved() -> ModuleType:
    return importlib.import_module("sa_taskqueue._moved")


def test_every_old_import_path_imports_the_same_module() -> None:
    """Every old path in ``sa_taskqueue._moved.MOVED`` imports the very module object of its new path.

    Code written against the earlier flat layout keeps working, and a class,
    a constant or a monkeypatched attribute is one thing whichever path
    reached it.
    """
    moved: dict[str, str] = _moved().MOVED
    assert moved
    different = []
    for old, new in sorted(moved.items()):
        through_old = importlib.import_module(f"sa_taskqueue.{old}")
        if through_old is not importlib.import_module(new):
            different.append(f"sa_taskqueue.{old} is not {new}")
    assert not different, "; ".join(different)


def test_short_integration_paths_re_export_their_integration() -> None:
    """``sa_taskqueue.flask``, ``.fastapi`` and ``.alembic`` re-export their integration's ``__all__``.

    Each name is the same object as in ``sa_taskqueue.integrations.<name>``.
    """
    missing = []
    for name in ("flask", "fastapi", "alembic"):
        short = importlib.import_module(f"sa_taskqueue.{name}")
        integration = importlib.import_module(f"sa_taskqueue.integrations.{name}")
        exported: list[str] = integration.__all__
        assert exported, f"sa_taskqueue.integrations.{name} exports nothing"
        for attribute in exported:
            if getattr(short, attribute, None) is not getattr(integration, attribute):
                missing.append(f"sa_taskqueue.{name}.{attribute}")
    assert not missing, "not re-exported as the same object: " + ", ".join(missing)
