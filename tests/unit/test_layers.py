"""The folders keep their layers (STYLE.md, "The house"): an import that runs the other way fails here.

- ``ledger/`` knows Postgres and nothing else: no adapters, no workers, no Celery (or kombu under it);
- ``adapters/`` know one protocol each: no ledger, no workers, no Celery, kombu or SQLAlchemy;
- ``workers/`` is the only place that knows Celery: nothing else imports ``celery`` or ``kombu``.

Every import counts, wherever it is written: at the top, inside a function, under ``if TYPE_CHECKING:``,
relative (``from .. import workers``) or by name (``importlib.import_module("celery")``).
``beat_schedule.py`` is plain data (the schedule as dicts, no ``celery.schedules``), so it needs no
exception; there is no allow-list.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKED = ("ledger", "adapters", "workers", "demo_server", "beat_schedule.py")
CELERY = ("celery", "kombu")


@dataclass(frozen=True)
class Rule:
    """Modules under ``folder`` (or, with ``folder`` None, every module not under ``exempt``) must not
    import any of ``forbidden`` (top-level package names)."""

    forbidden: tuple[str, ...]
    why: str
    folder: str | None = None
    exempt: str | None = None

    def applies_to(self, top: str) -> bool:
        return top == self.folder if self.folder is not None else top != self.exempt


RULES = (
    Rule(("adapters", "workers", *CELERY), "the ledger knows Postgres and nothing else", folder="ledger"),
    Rule(
        ("ledger", "workers", "sqlalchemy", *CELERY),
        "an adapter knows its protocol, not the ledger, the workers or Celery",
        folder="adapters",
    ),
    Rule(CELERY, "workers/ is the only place that knows Celery", exempt="workers"),
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
    }
    celery_in_workers = [
        name
        for path in files
        if path.relative_to(REPO).parts[0] == "workers"
        for _, name in imported_modules(path.read_text(encoding="utf-8"), "workers")
        if name.split(".")[0] == "celery"
    ]
    assert celery_in_workers


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
        ("adapters/mcp/wire.py", "import httpx\nfrom adapters.errors import Transient\n"),
        ("demo_server/mcp.py", "import json\nwords = 'celery and sqlalchemy'\n"),
    ],
)
def test_the_check_lets_the_layers_be(path: str, source: str) -> None:
    assert violations(source, path) == []


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
