"""Alembic autogenerate on an application's own `Base`: the one hook, and the filter for our own table.

An application maps ``class Job(TaskMixin, Base): __tablename__ = "jobs"``
and runs ``alembic revision --autogenerate``.  Alembic renders a column type
it does not know as ``<module>.<repr>``, here ``sa_taskqueue.core.types.UTCDateTime()``,
and imports nothing for it (``alembic.autogenerate.render._repr_type``): the
revision then fails with ``NameError: name 'sa_taskqueue' is not defined``.
Only a ``render_item`` hook can change that, so one is needed.  The
alternatives do not hold: ``user_module_prefix`` changes the prefix but still
imports nothing, and declaring the mixin's columns with plain SQLAlchemy types
would lose what our types do to values (UTC in and out, JSON as text on
Oracle).  An ``env.py`` passes exactly one argument for the hook::

    import sa_taskqueue.integrations.alembic

    context.configure(..., render_item=sa_taskqueue.integrations.alembic.render_item)

`render_item` writes each of our types as the plain SQLAlchemy type every
database gets, with a ``with_variant`` where a database gets another
(``sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), 'mariadb', 'mysql')``),
rather than as ``UTCDateTime()`` with an import.  Why the physical types:

* a revision records the schema as it was the day it was written.  Our
  types choose their physical type when they are used, so a revision holding
  ``LongText()`` would create TEXT under one release and MEDIUMTEXT under the
  next; the physical types keep the revision's DDL fixed;
* the revision runs without sa_taskqueue importable (a service that drops
  the queue later still replays its history), and survives any renaming of
  our types;
* DDL is all a revision does with a column type.  What our types add (UTC
  on the way in and out, JSON serialised on Oracle) acts on values, which
  the application's model, not its migrations, reads and writes.

No second hook is needed for the comparison: Alembic compares a column's
type by the DDL it compiles to, and each of our types compiles to its
physical type, so a second autogenerate after ``upgrade head`` finds nothing
to do.

An application that also runs the library's own migrations
(``sa-taskqueue migrate``) has ``sa_taskqueue_task`` and the version table
``sa_taskqueue_alembic_version`` in its database, which its own metadata does
not declare; `include_object` keeps its autogenerate from proposing to drop
them.  The two histories never clash: the application's is in
``alembic_version``, ours in ``sa_taskqueue_alembic_version``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from alembic.autogenerate.api import AutogenContext
from sqlalchemy import URL
from sqlalchemy.engine import Dialect
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.types import TypeDecorator, TypeEngine

from sa_taskqueue.backends import ANY_DIALECT, BACKENDS, backend_for
from sa_taskqueue.core.migrate import VERSION_TABLE
from sa_taskqueue.core.model import IndexableComputed, metadata
from sa_taskqueue.core.types import JSONDocument, LongText, UTCDateTime

#: The column types `render_item` writes out as their physical types.
OUR_TYPES: tuple[type[TypeDecorator[Any]], ...] = (UTCDateTime, LongText, JSONDocument)

#: Tables in an application's database that the library's own migrations manage.
LIBRARY_TABLES = frozenset({*(table.name for table in metadata.tables.values()), VERSION_TABLE})

_SQLALCHEMY_DIALECTS = "sqlalchemy.dialects."


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | bool:
    """Alembic's ``render_item`` hook: our column types as plain SQLAlchemy types, False for anything else.

    The imports the rendered text needs (``from sqlalchemy.dialects import
    mysql``, ...) are added to ``autogen_context.imports``, which the revision
    template writes at its top.  ``sa`` is Alembic's own prefix for
    SQLAlchemy (``sqlalchemy_module_prefix``), which the template imports.
    """
    if type_ == "server_default" and isinstance(obj, IndexableComputed):
        return generated_column_source(obj, autogen_context)
    if type_ != "type" or not isinstance(obj, OUR_TYPES):
        return False
    return physical_type_source(obj, autogen_context)


def generated_column_source(computed: IndexableComputed, autogen_context: AutogenContext) -> str | bool:
    """``sa.Computed(..., persisted=True)`` on PostgreSQL, which indexes only stored generated columns.

    Left to Alembic elsewhere: a plain ``sa.Computed(...)`` is virtual there,
    which those databases index, and which ``ADD COLUMN`` adds in place.
    (On PostgreSQL 18 a plain one would be virtual, and its index refused.)
    """
    dialect = autogen_context.dialect
    if dialect is None or not backend_for(dialect).indexes_only_stored_generated_columns:
        return False
    expression = computed.sqltext.compile(
        dialect=dialect, compile_kwargs={"literal_binds": True, "include_table": False}
    )
    prefix = autogen_context.opts.get("sqlalchemy_module_prefix") or "sa."
    return f"{prefix}Computed({str(expression)!r}, persisted=True)"


def physical_type_source(type_: TypeDecorator[Any], autogen_context: AutogenContext) -> str:
    """Python source for the physical type of `type_` on every database, as a revision holds it.

    The default (any database without a backend of its own) is the base; each
    database whose backend chooses another type adds a ``with_variant`` for
    it, one per distinct type, naming every database that gets it.
    """
    base = _type_source(type_.load_dialect_impl(DefaultDialect()), autogen_context)
    variants: dict[str, list[str]] = {}
    for name, dialect in _known_dialects():
        source = _type_source(type_.load_dialect_impl(dialect), autogen_context)
        if source != base:
            variants.setdefault(source, []).append(name)
    for source, names in sorted(variants.items(), key=lambda item: item[1]):
        base += f".with_variant({source}, {', '.join(repr(name) for name in sorted(names))})"
    return base


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """Alembic's ``include_object`` hook: leave the library's own tables to the library's migrations.

    For an application that runs ``sa-taskqueue migrate`` beside its own
    migrations.  Its database then holds ``sa_taskqueue_task`` and
    ``sa_taskqueue_alembic_version``; its metadata declares neither, so
    autogenerate would propose dropping both.  They are skipped only when
    found in the database and not declared by the application: a table the
    application maps itself stays its own.  (Their indexes and columns are
    only compared for tables that are, so skipping the table skips them.)
    """
    if type_ == "table" and reflected and compare_to is None:
        return name not in LIBRARY_TABLES
    return True


def _known_dialects() -> Iterator[tuple[str, Dialect]]:
    """A dialect object for every database name that has a backend of its own, for asking types."""
    for name in sorted(BACKENDS):
        if name != ANY_DIALECT:
            # The dialect class of the default driver; made, never connected.
            yield name, URL.create(name).get_dialect()()


def _type_source(type_: TypeEngine[Any], autogen_context: AutogenContext) -> str:
    """``sa.DateTime(timezone=True)``, ``mysql.DATETIME(fsp=6)``: a type as Alembic writes one.

    The arguments are those of the type's constructor whose values differ
    from their defaults, as SQLAlchemy's own ``repr`` chooses them; a type
    given as an argument (PostgreSQL JSONB's ``astext_type``) is written the
    same way.
    """
    module = type(type_).__module__
    if module.startswith(_SQLALCHEMY_DIALECTS):
        # sqlalchemy.dialects.mysql.types -> "mysql", imported by the revision.
        dialect_module = module[len(_SQLALCHEMY_DIALECTS) :].split(".")[0]
        if autogen_context.imports is not None:
            autogen_context.imports.add(f"from sqlalchemy.dialects import {dialect_module}")
        prefix = f"{dialect_module}."
    elif module.startswith("sqlalchemy."):
        prefix = autogen_context.opts.get("sqlalchemy_module_prefix") or ""
    else:
        raise TypeError(
            f"cannot write {type(type_).__qualname__} from {module} into a revision: "
            "a backend's physical type must be one of SQLAlchemy's"
        )
    arguments = ", ".join(
        f"{name}={_argument_source(value, autogen_context)}" for name, value in _constructor_arguments(type_)
    )
    return f"{prefix}{type(type_).__name__}({arguments})"


def _argument_source(value: Any, autogen_context: AutogenContext) -> str:
    if isinstance(value, TypeEngine):
        return _type_source(value, autogen_context)
    return repr(value)


def _constructor_arguments(type_: TypeEngine[Any]) -> list[tuple[str, Any]]:
    """The keyword arguments that rebuild `type_`: those its constructors name, where not the default.

    The constructors of the type's classes are read from the most derived up
    (a ``MEDIUMTEXT(**kwargs)`` passes its arguments on to its bases), as
    SQLAlchemy's ``repr`` of a type does.
    """
    found: dict[str, Any] = {}
    for cls in type(type_).__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        for parameter in inspect.signature(init).parameters.values():
            if parameter.name == "self" or parameter.default is inspect.Parameter.empty:
                continue
            if parameter.name in found or not hasattr(type_, parameter.name):
                continue
            value = getattr(type_, parameter.name)
            if value is not parameter.default and value != parameter.default:
                found[parameter.name] = value
    return list(found.items())


__all__ = ["LIBRARY_TABLES", "OUR_TYPES", "include_object", "physical_type_source", "render_item"]
