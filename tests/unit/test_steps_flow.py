"""The executor's steps flow one way: no step module imports (and so calls) one that imports it, and
none knows Celery or the executor that runs it."""

from __future__ import annotations

import ast
import typing
import uuid
from pathlib import Path

import pytest

from ledger.events import EventKind
from ledger.records import AcceptanceOutcome
from workers.steps.context import StepAction, StepOutcome

STEPS = Path(__file__).resolve().parents[2] / "workers" / "steps"
PACKAGE = "workers.steps"


def step_imports(source: str) -> set[str]:
    """The step modules (by short name) and other modules a step module's source imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:
                found.update(alias.name for alias in node.names)
            else:
                found.add(node.module.removeprefix(PACKAGE + "."))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in STEPS.glob("*.py") if p.stem != "__init__"}
    return {
        name: step_imports(path.read_text(encoding="utf-8")) & modules.keys()
        for name, path in modules.items()
    }


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the path that closes it, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(edges.get(node, ())):
            found = visit(target, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(edges):
        found = visit(start, [])
        if found:
            return found
    return None


def test_the_step_modules_import_each_other_one_way() -> None:
    edges = graph()
    assert {"context", "submit", "poll", "result", "cancel", "input_rounds", "reconciliation"} <= edges.keys()
    assert cycle(edges) is None, " -> ".join(cycle(edges) or [])
    assert edges["context"] == set(), "everything stands on the context; it imports no step"
    assert edges["result"] <= {"context"}, "the result phase is the end of every path"


def test_the_checker_finds_a_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", sorted(STEPS.glob("*.py")), ids=lambda p: p.name)
def test_a_step_knows_neither_celery_nor_the_executor(path: Path) -> None:
    imported = step_imports(path.read_text(encoding="utf-8"))
    assert not {m for m in imported if m.split(".")[0] in {"celery", "kombu", "jsonschema"}}
    assert "workers.executor" not in imported
    assert "workers.tasks" not in imported


def test_a_step_action_is_answered_as_the_plain_string() -> None:
    """``StepOutcome.action`` is an enum; the task's answer (and Celery's log line of it) holds its plain
    string, as before it was one. Every acceptance outcome the ledger gives is a step action."""
    op_id = uuid.uuid4()
    for action in (StepAction.CREATED, EventKind.NO_TOKEN):
        answer = StepOutcome(op_id, action).as_dict()["action"]
        assert type(answer) is str
        assert answer == action.value
        assert repr(answer) == repr(action.value)
    assert set(typing.get_args(AcceptanceOutcome)) <= {a.value for a in StepAction}
