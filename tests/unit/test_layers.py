"""The folders keep their layers (STYLE.md, "The house"): an import that runs the other way fails here.

- ``ledger/`` knows Postgres and nothing else: no adapters, no workers, no Celery (or kombu under it);
- ``adapters/`` know one protocol each: no ledger, no workers, no Celery, kombu or SQLAlchemy;
- ``workers/`` and ``console/`` are the only places that know Celery: nothing else imports ``celery`` or
  ``kombu``. ``workers/`` runs the tasks; ``console/``, the operator's ``longcall`` command, is a Celery
  client (it sends ``longcall.submit``, ``longcall.cancel`` and ``longcall.provide_input`` by name and waits
  for a worker's answer), so it needs the Celery app too;
- the operator's wing (``console/``) is no part of a worker process: nothing in ``ledger/``, ``adapters/``,
  ``workers/``, ``demo_server/`` or ``beat_schedule.py`` imports it, and importing what a worker process
  loads (``workers.app`` with the tasks it registers, ``beat_schedule``) puts no ``console`` module in
  ``sys.modules`` (checked in a fresh interpreter, below). ``console/`` may import everything.

Every import counts, wherever it is written: at the top, inside a function, under ``if TYPE_CHECKING:``,
relative (``from .. import workers``) or by name (``importlib.import_module("celery")``).
``beat_schedule.py`` is plain data (the schedule as dicts, no ``celery.schedules``), so it needs no
exception; there is no allow-list.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.imports import loaded_by

REPO = Path(__file__).resolve().parents[2]
CHECKED = ("ledger", "adapters", "workers", "demo_server", "beat_schedule.py", "console")
CELERY = ("celery", "kombu")


@dataclass(frozen=True)
class Rule:
    """Modules under ``folder`` (or, with ``folder`` None, every module not under one of ``exempt``) must
    not import any of ``forbidden`` (top-level package names)."""

    forbidden: tuple[str, ...]
    why: str
    folder: str | None = None
    exempt: tuple[str, ...] = ()

    def applies_to(self, top: str) -> bool:
        return top == self.folder if self.folder is not None else top not in self.exempt


RULES = (
    Rule(("adapters", "workers", *CELERY), "the ledger knows Postgres and nothing else", folder="ledger"),
    Rule(
        ("ledger", "workers", "sqlalchemy", *CELERY),
        "an adapter knows its protocol, not the ledger, the workers or Celery",
        folder="adapters",
    ),
    Rule(
        CELERY,
        "workers/ (the tasks) and console/ (the operator's Celery client) alone know Celery",
        exempt=("workers", "console"),
    ),
    Rule(("console",), "a worker process never loads the operator's wing (console/)", exempt=("console",)),
)


def imported_modules(source: str, package: str) -> Iterator[tuple[int, str]]:
    """Each module ``source`` imports, as (line, absolute dotted name); ``package`` is the package the
    source lives in ("" at the top level), for the relative imports."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = ".".join(p for p in (base, node.module or "") if p)
            else:
                base = node.module or ""
            if base:
                yield node.lineno, base
            if node.module is None:  # "from . import x": the names are the modules
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}" if base else alias.name
        elif isinstance(node, ast.Call) and _names_a_module(node):
            first = node.args[0]
            assert isinstance(first, ast.Constant)
            yield node.lineno, str(first.value)


def _names_a_module(call: ast.Call) -> bool:
    """``importlib.import_module("x")``, ``import_module("x")`` or ``__import__("x")``."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return (
        name in {"import_module", "__import__"}
        and bool(call.args)
        and isinstance(call.args[0], ast.Constant)
        and isinstance(call.args[0].value, str)
    )


def violations(source: str, path: str) -> list[str]:
    """``path:line imports name (why)`` for each import in ``source`` that a rule forbids; ``path`` is
    relative to the repository (e.g. ``ledger/records.py``) and decides the package and the rules."""
    parts = Path(path).with_suffix("").parts
    package = ".".join(parts if parts[-1] == "__init__" else parts[:-1]).removesuffix(".__init__")
    rules = [rule for rule in RULES if rule.applies_to(parts[0])]
    found = []
    for line, name in imported_modules(source, package):
        broken = next((rule for rule in rules if name.split(".")[0] in rule.forbidden), None)
        if broken is not None:  # one line per import, even when two rules forbid it
            found.append(f"{path}:{line} imports {name} ({broken.why})")
    return found


def checked_files() -> list[Path]:
    files: list[Path] = []
    for entry in CHECKED:
        path = REPO / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def test_the_tree_keeps_its_layers() -> None:
    found = [
        v
        for path in checked_files()
        for v in violations(path.read_text(encoding="utf-8"), path.relative_to(REPO).as_posix())
    ]
    assert found == [], "\n".join(found)


def test_the_check_reads_the_real_tree() -> None:
    """The scan sees every folder, and sees the imports the rules are about where they are allowed."""
    files = checked_files()
    assert {p.relative_to(REPO).parts[0] for p in files} == {
        "ledger",
        "adapters",
        "workers",
        "demo_server",
        "beat_schedule.py",
        "console",
    }
    celery_in_workers = [
        name
        for path in files
        if path.relative_to(REPO).parts[0] == "workers"
        for _, name in imported_modules(path.read_text(encoding="utf-8"), "workers")
        if name.split(".")[0] == "celery"
    ]
    assert celery_in_workers
    workers_in_console = [
        name
        for path in files
        if path.relative_to(REPO).parts[0] == "console"
        for _, name in imported_modules(path.read_text(encoding="utf-8"), "console")
        if name.split(".")[0] == "workers"
    ]
    assert workers_in_console


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        ("ledger/records.py", "import celery\n", "ledger/records.py:1 imports celery"),
        (
            "ledger/records.py",
            "def later():\n    from kombu import Queue\n",
            "ledger/records.py:2 imports kombu",
        ),
        (
            "ledger/statements.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workers.runtime import Runtime\n",
            "ledger/statements.py:3 imports workers.runtime",
        ),
        ("ledger/engine.py", "from .. import adapters\n", "ledger/engine.py:1 imports adapters"),
        ("ledger/__init__.py", "from ..workers import steps\n", "ledger/__init__.py:1 imports workers"),
        ("adapters/errors.py", "from sqlalchemy import text\n", "adapters/errors.py:1 imports sqlalchemy"),
        (
            "adapters/mcp/client.py",
            "import ledger.repository as repo\n",
            "adapters/mcp/client.py:1 imports ledger.repository",
        ),
        (
            "adapters/base.py",
            "import importlib\nmod = importlib.import_module('workers.tasks')\n",
            "adapters/base.py:2 imports workers.tasks",
        ),
        ("demo_server/mcp.py", "from celery import Celery\n", "demo_server/mcp.py:1 imports celery"),
        (
            "beat_schedule.py",
            "from celery.schedules import crontab\n",
            "beat_schedule.py:1 imports celery.schedules",
        ),
        ("beat_schedule.py", "kombu = __import__('kombu')\n", "beat_schedule.py:1 imports kombu"),
        (
            "workers/tasks.py",
            "from console.common import console\n",
            "workers/tasks.py:1 imports console.common",
        ),
        (
            "workers/steps/poll.py",
            "def later():\n    from ...console import fleet\n",
            "workers/steps/poll.py:2 imports console",
        ),
        ("ledger/records.py", "import console.output\n", "ledger/records.py:1 imports console.output"),
        (
            "adapters/base.py",
            "import importlib\nmod = importlib.import_module('console.metrics')\n",
            "adapters/base.py:2 imports console.metrics",
        ),
        ("demo_server/mcp.py", "from console import output\n", "demo_server/mcp.py:1 imports console"),
        (
            "beat_schedule.py",
            "from console.launch_gate import evaluate_gate\n",
            "beat_schedule.py:1 imports console.launch_gate",
        ),
    ],
)
def test_the_check_catches_an_import_against_the_layers(path: str, source: str, expected: str) -> None:
    found = violations(source, path)
    assert len(found) == 1, found
    assert found[0].startswith(expected + " ("), found


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("workers/app.py", "from celery import Celery\nimport kombu\nfrom ledger.states import OpState\n"),
        ("ledger/repository.py", "from sqlalchemy import text\nfrom ledger.states import OpState\n"),
        ("ledger/repository.py", "from .records import Operation\nfrom . import states\n"),
        ("adapters/mcp/wire.py", "import httpx2\nfrom adapters.errors import Transient\n"),
        ("demo_server/mcp.py", "import json\nwords = 'celery and sqlalchemy'\n"),
        (
            "console/common.py",
            "from celery import Celery\nimport kombu.exceptions\nfrom workers.app import create_app\n",
        ),
        ("console/simulation/runner.py", "from ledger.repository import Ledger\nfrom adapters import base\n"),
        ("console/main.py", "from .common import EXIT_CODES\nfrom console.fleet import rollout\n"),
    ],
)
def test_the_check_lets_the_layers_be(path: str, source: str) -> None:
    assert violations(source, path) == []


#: What a worker process loads: ``celery -A workers.app worker`` (the app registers its tasks from
#: ``workers.tasks``) and ``beat`` (the schedule in ``beat_schedule``).
WORKER_LOADS = ("workers.app", "workers.tasks", "beat_schedule")


def of_the_wing(names: Iterable[str]) -> list[str]:
    return sorted(name for name in names if name.split(".")[0] == "console")


def test_a_worker_process_loads_nothing_of_the_operators_wing() -> None:
    loaded = loaded_by(WORKER_LOADS)
    assert {"workers.app", "workers.tasks", "workers.executor", "beat_schedule"} <= loaded
    assert of_the_wing(loaded) == []


def test_the_probe_sees_the_wing_where_it_is_loaded() -> None:
    """The same probe on the ``longcall`` command finds the wing's modules (each command's module is loaded
    when the command runs: the probe loads two of them, as running them would)."""
    wing = of_the_wing(loaded_by(["console.main", "console.operations", "console.dev.command"]))
    assert {"console.main", "console.common", "console.operations", "console.dev.command"} <= set(wing)


# ---------------------------------------------------------------------------- the adapters' face

#: The folders that see the adapters through their face (``adapters/__init__.py``) only: the worker's
#: spine and the operator's wing (``console/``, which may not exist yet: the rule then has no files there).
#: A protocol question is asked of a version's spec (``adapters.SHIPPED``, a pool's registry), never by
#: reaching into ``adapters.<version>``: adding or retiring a version then touches ``adapters/`` only.
FACE_FOLDERS = ("workers", "console")
FACE_WHY = "workers/ and console/ import only the adapters package's face"


def _an_adapters_module(name: str) -> bool:
    package = REPO / "adapters"
    return (package / name).is_dir() or (package / f"{name}.py").is_file()


def below_the_face(source: str, path: str) -> list[str]:
    """``path:line imports name (why)`` for each import in ``source`` below the adapters' face, in a module
    of :data:`FACE_FOLDERS`: ``adapters.<anything>`` by any way of importing it, or a module of the package
    taken by name from the face (``from adapters import mcp_2026_07_28``)."""
    parts = Path(path).with_suffix("").parts
    if parts[0] not in FACE_FOLDERS:
        return []
    package = ".".join(parts if parts[-1] == "__init__" else parts[:-1]).removesuffix(".__init__")
    found = [(line, name) for line, name in imported_modules(source, package) if name.startswith("adapters.")]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "adapters":
            found += [(node.lineno, f"adapters.{a.name}") for a in node.names if _an_adapters_module(a.name)]
    return [f"{path}:{line} imports {name} ({FACE_WHY})" for line, name in sorted(found)]


def _face_exports() -> set[str]:
    """``adapters.__all__``, read from the source as the rest of this module reads it."""
    tree = ast.parse((REPO / "adapters" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError("adapters/__init__.py has no __all__")


def face_checked_files() -> list[Path]:
    return [
        p
        for folder in FACE_FOLDERS
        if (REPO / folder).is_dir()
        for p in sorted((REPO / folder).rglob("*.py"))
    ]


def test_workers_and_console_import_only_the_adapters_face() -> None:
    found = [
        v
        for path in face_checked_files()
        for v in below_the_face(path.read_text(encoding="utf-8"), path.relative_to(REPO).as_posix())
    ]
    assert found == [], "\n".join(found)


def test_the_face_check_reads_the_real_tree() -> None:
    """The scan sees workers/, which does import the adapters (through the face), and every name taken
    from the face is one the face exports."""
    files = face_checked_files()
    assert "workers" in {p.relative_to(REPO).parts[0] for p in files}
    taken = [
        (path.relative_to(REPO).as_posix(), alias.name)
        for path in files
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "adapters"
        for alias in node.names
    ]
    assert taken
    exported = _face_exports()
    assert [(path, name) for path, name in taken if name not in exported] == []


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        (
            "workers/steps/input_rounds.py",
            "from adapters.mcp_2026_07_28.wire import REPLY_METHOD\n",
            "workers/steps/input_rounds.py:1 imports adapters.mcp_2026_07_28.wire",
        ),
        (
            "workers/remote.py",
            "from adapters import Timeouts\nfrom adapters.streamable_http import Session\n",
            "workers/remote.py:2 imports adapters.streamable_http",
        ),
        (
            "workers/steps/result.py",
            "from adapters.errors import ResultContradictsStatus\n",
            "workers/steps/result.py:1 imports adapters.errors",
        ),
        (
            "workers/cli.py",
            "from adapters import mcp_2026_07_28\n",
            "workers/cli.py:1 imports adapters.mcp_2026_07_28",
        ),
        ("console/cli.py", "import adapters.base as base\n", "console/cli.py:1 imports adapters.base"),
        (
            "console/commands/fleet.py",
            "import importlib\n\ndef later():\n    return importlib.import_module('adapters.aip151.spec')\n",
            "console/commands/fleet.py:4 imports adapters.aip151.spec",
        ),
        (
            "workers/settings.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from adapters.spec import X\n",
            "workers/settings.py:3 imports adapters.spec",
        ),
    ],
)
def test_the_face_check_catches_an_import_below_it(path: str, source: str, expected: str) -> None:
    found = below_the_face(source, path)
    assert len(found) == 1, found
    assert found[0] == f"{expected} ({FACE_WHY})", found


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("workers/remote.py", "import adapters\nfrom adapters import SHIPPED, AdapterRegistry, ToolRoute\n"),
        ("console/cli.py", "from adapters import detect_generation, redact_url\n"),
        ("adapters/registry.py", "from adapters import aip151\nfrom adapters.spec import AdapterSpec\n"),
        ("ledger/repository.py", "from adapters.base import RemoteRef\n"),  # the ledger's own rule says no
        ("workers/steps/poll.py", "from workers.steps.context import StepContext\nimport httpx2\n"),
    ],
)
def test_the_face_check_lets_the_face_be(path: str, source: str) -> None:
    assert below_the_face(source, path) == []


# --- The engine knows no Celery, however far it looks (issue 20, item 3) ---------------------------------
#
# A worker's engine (the executor, the steps, the runtime and what it holds, the boundary checks, the log
# context) runs the protocol without Celery: the tasks (``workers/tasks.py``) and the Celery wiring beside
# them (``delivery``, ``task_faults``, ``celery_logs``, ``app``, ``broker``, ``fencing``) decode a message,
# call it, and map its outcome. The rule above reads one file at a time; this one follows every import of
# the repository's own modules from each engine module, so an engine module that imports a helper that
# imports kombu is caught, with the chain that leads there.

ENGINE = (
    "workers.executor",
    "workers.runtime",
    "workers.budget",
    "workers.hot",
    "workers.lease",
    "workers.submission",
    "workers.replies",
    "workers.settings",
    "workers.logs",
)


def module_name(path: Path) -> str:
    """``workers/steps/context.py`` -> ``workers.steps.context``; a package is named by its folder."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(source: str, package: str, modules: set[str] | frozenset[str]) -> set[str]:
    """What importing a module with ``source`` imports: each name :func:`imported_modules` reads, the
    repository's submodules named by ``from package import module``, and the packages above each of the
    repository's own modules (importing ``a.b.c`` runs ``a`` and ``a.b`` first)."""
    names = {name for _, name in imported_modules(source, package)}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            base = next(name for line, name in imported_modules(ast.unparse(node), package))
            names |= {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
    found = set()
    for name in names:
        parts = name.split(".")
        own = [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules]
        found |= set(own) if own else {name}
    return found


def import_graph() -> dict[str, set[str]]:
    """The repository's own modules (what :func:`checked_files` reads), each with what it imports: another
    of them, or an outside module's dotted name (a leaf)."""
    files = checked_files()
    modules = frozenset(module_name(path) for path in files)
    graph = {}
    for path in files:
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = module_imports(path.read_text(encoding="utf-8"), package, modules)
    return graph


def chain_to(graph: dict[str, set[str]], start: str, forbidden: tuple[str, ...]) -> list[str] | None:
    """The shortest chain of imports from ``start`` to a module under one of ``forbidden`` (top-level
    names), or None when there is none. Only the repository's own modules (the graph's keys) are followed."""
    came_from: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        here = queue.pop(0)
        for there in sorted(graph.get(here, ())):
            if there in came_from:
                continue
            came_from[there] = here
            if there.split(".")[0] in forbidden:
                chain = [there]
                while (step := came_from[chain[-1]]) is not None:
                    chain.append(step)
                return chain[::-1]
            if there in graph:
                queue.append(there)
    return None


def engine_modules(graph: dict[str, set[str]]) -> list[str]:
    return [*ENGINE, *sorted(m for m in graph if m.startswith("workers.steps"))]


def test_the_engine_reaches_neither_celery_nor_kombu() -> None:
    graph = import_graph()
    found = [
        " -> ".join(chain)
        for start in engine_modules(graph)
        if (chain := chain_to(graph, start, CELERY)) is not None
    ]
    assert found == [], "the engine knows no Celery (issue 20, item 3):\n" + "\n".join(found)


def test_the_transitive_check_reads_the_real_tree() -> None:
    """Every engine module is in the graph, the steps among them, and the graph sees the Celery wiring's
    own imports (the tasks reach kombu, through the executor's neighbours or their own)."""
    graph = import_graph()
    assert set(engine_modules(graph)) <= graph.keys()
    assert {"workers.steps.context", "workers.steps.result"} <= set(engine_modules(graph))
    assert "workers.steps.context" in graph["workers.executor"]  # from workers.steps.context import ...
    assert "workers.logs" in graph["workers.executor"]  # from workers import logs
    assert "workers.steps" in graph["workers.executor"]  # the package above a module runs first
    assert chain_to(graph, "workers.tasks", CELERY) is not None
    assert chain_to(graph, "workers.app", CELERY) == ["workers.app", "celery"]


def test_the_transitive_check_reports_a_chain_two_hops_away() -> None:
    fake = {
        "workers.executor": {"workers.steps.result", "logging"},
        "workers.steps.result": {"workers.helper", "workers.steps.context"},
        "workers.steps.context": {"redis"},
        "workers.helper": {"kombu.utils.json", "json"},
    }
    assert chain_to(fake, "workers.executor", CELERY) == [
        "workers.executor",
        "workers.steps.result",
        "workers.helper",
        "kombu.utils.json",
    ]
    assert chain_to(fake, "workers.steps.context", CELERY) is None
    assert chain_to({"a": {"b"}, "b": {"a"}}, "a", CELERY) is None  # a circle ends


def test_the_graph_follows_a_module_imported_from_its_package() -> None:
    modules = frozenset({"workers", "workers.logs", "workers.steps", "workers.steps.poll"})
    source = "from workers import logs\nfrom workers.steps import poll as p\nimport kombu\n"
    assert module_imports(source, "workers.steps", modules) == {
        "workers",
        "workers.logs",
        "workers.steps",
        "workers.steps.poll",
        "kombu",
    }
