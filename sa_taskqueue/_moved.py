"""The import paths of modules that moved into the layered packages keep working.

Code written against an earlier layout imports ``sa_taskqueue.limits`` or
``sa_taskqueue.footing``; those modules now live in ``sa_taskqueue.core``,
``sa_taskqueue.health`` and the other layers.  A finder on ``sys.meta_path``
answers for each old name with the module at its new place: the same module
object under both names, so a class, a constant or a monkeypatched attribute
is one thing whichever path reached it.  No module of the package imports an
old path; they are for code outside it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

from sa_taskqueue.backends.table_health import FORMER_PATHS

#: Old path (under ``sa_taskqueue.``) -> the module's path now.  (``queue`` and ``worker`` became
#: packages of the same name, ``cli`` too: their old names import as they did.)
MOVED = {
    "admin": "sa_taskqueue.features.admin",
    "bulk_insert": "sa_taskqueue.core.bulk_insert",
    "claimed": "sa_taskqueue.core.claimed",
    "claimed_params": "sa_taskqueue.core.claimed_params",
    "cli_params": "sa_taskqueue.cli.params",
    "cli_preflight": "sa_taskqueue.cli.preflight",
    "cli_render": "sa_taskqueue.cli.render",
    "completions": "sa_taskqueue.worker.completions",
    "concurrency": "sa_taskqueue.core.concurrency",
    "control": "sa_taskqueue.core.control",
    "control_rows": "sa_taskqueue.core.control_rows",
    "demo": "sa_taskqueue.cli.demo",
    "error_text": "sa_taskqueue.core.error_text",
    "event_loop_bridge": "sa_taskqueue.core.event_loop_bridge",
    "exceptions": "sa_taskqueue.core.exceptions",
    "execution": "sa_taskqueue.worker.execution",
    "executor": "sa_taskqueue.strategies.executor",
    "explain": "sa_taskqueue.health.explain",
    "finished": "sa_taskqueue.core.finished",
    "footing": "sa_taskqueue.health.self_test",
    "kept_connection": "sa_taskqueue.strategies.kept_connection",
    "limits": "sa_taskqueue.core.limits",
    "log_fields": "sa_taskqueue.core.log_fields",
    "migrate": "sa_taskqueue.core.migrate",
    "model": "sa_taskqueue.core.model",
    "notify": "sa_taskqueue.core.notify",
    "pausing": "sa_taskqueue.features.pausing",
    "prepared": "sa_taskqueue.strategies.prepared",
    "redaction": "sa_taskqueue.core.redaction",
    "registered": "sa_taskqueue.core.registered",
    "results": "sa_taskqueue.features.results",
    "retention": "sa_taskqueue.features.retention",
    "schedules": "sa_taskqueue.features.schedules",
    "session_events": "sa_taskqueue.core.session_events",
    "slot_threads": "sa_taskqueue.worker.slot_threads",
    "storable_text": "sa_taskqueue.core.storable_text",
    "task_rows": "sa_taskqueue.core.task_rows",
    "transactional": "sa_taskqueue.features.transactional",
    "types": "sa_taskqueue.core.types",
    "unawaited": "sa_taskqueue.core.unawaited",
    "unique": "sa_taskqueue.features.unique",
    "validation": "sa_taskqueue.core.validation",
    "watchdog": "sa_taskqueue.worker.watchdog",
    "watchdog_process": "sa_taskqueue.worker.watchdog_process",
}


# The table-health probes moved under backends/, and their modules are named after databases.
MOVED.update(FORMER_PATHS)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``sa_taskqueue.<old>`` and loads it as the module now at its new path."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, old = fullname.partition(".")
        if package != "sa_taskqueue" or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name.partition(".")[2]])
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system gave the module the old name's spec; it keeps its own.
        module.__spec__ = self._own_specs.pop(module.__name__)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (the package's ``__init__`` calls this)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
