"""The three tools every conformance peer exposes, with the same names, schemas and behaviour."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

TaskSupport = Literal["forbidden", "optional", "required"]

APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"approved": {"type": "boolean"}},
    "required": ["approved"],
}


class ToolError(Exception):
    """The tool ran and failed: the answer is a CallToolResult with isError true."""


class ToolContext(Protocol):
    async def elicit(self, message: str, requested_schema: dict[str, Any]) -> dict[str, Any]:
        """Ask the client (elicitation/create) and return its answer ({"action": ..., "content": ...})."""
        ...

    def take_forced_input(self) -> bool:
        """True when the fault `force_input_required` wants this run to ask for input first."""
        ...


ToolRun = Callable[[ToolContext, dict[str, Any]], Awaitable[dict[str, Any]]]


def text_result(text: str, *, is_error: bool = False) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": is_error}


def approved(answer: dict[str, Any]) -> bool:
    content = answer.get("content")
    return answer.get("action") == "accept" and isinstance(content, dict) and content.get("approved") is True


def _seconds(arguments: dict[str, Any]) -> float:
    seconds = arguments.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise ToolError("seconds must be a non-negative number")
    return float(seconds)


def _fail(arguments: dict[str, Any]) -> bool:
    fail = arguments.get("fail", False)
    if not isinstance(fail, bool):
        raise ToolError("fail must be a boolean")
    return fail


def report_result(arguments: dict[str, Any]) -> dict[str, Any]:
    seconds = _seconds(arguments)
    return text_result(f"report ready after {seconds:g}s", is_error=_fail(arguments))


async def slow_report(context: ToolContext, arguments: dict[str, Any]) -> dict[str, Any]:
    seconds = _seconds(arguments)
    _fail(arguments)
    if context.take_forced_input():
        answer = await context.elicit(f"Continue the {seconds:g}s report?", APPROVAL_SCHEMA)
        if not approved(answer):
            raise ToolError("report declined")
    await asyncio.sleep(seconds)
    return report_result(arguments)


def _string(arguments: dict[str, Any], name: str) -> str:
    value = arguments.get(name)
    if not isinstance(value, str):
        raise ToolError(f"{name} must be a string")
    return value


async def quick_lookup(context: ToolContext, arguments: dict[str, Any]) -> dict[str, Any]:
    return text_result(f"value:{_string(arguments, 'key')}")


async def ask_approval(context: ToolContext, arguments: dict[str, Any]) -> dict[str, Any]:
    answer = await context.elicit(_string(arguments, "question"), APPROVAL_SCHEMA)
    return text_result("approved" if approved(answer) else "declined")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    input_schema: dict[str, Any]
    task_support: TaskSupport | None
    run: ToolRun

    def descriptor(self) -> dict[str, Any]:
        descriptor: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
        }
        if self.task_support is not None:
            descriptor["execution"] = {"taskSupport": self.task_support}
        return descriptor

    @property
    def accepts_task(self) -> bool:
        return self.task_support in ("optional", "required")

    def instant_result(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """What the tool answers when made to finish this instant (fault `complete_on_cancel`)."""
        try:
            return report_result(arguments) if self.run is slow_report else text_result("done")
        except ToolError as error:
            return text_result(str(error), is_error=True)


TOOLS: dict[str, Tool] = {
    tool.name: tool
    for tool in (
        Tool(
            name="slow_report",
            description="Builds a report slowly: sleeps `seconds`, then answers (isError when `fail`).",
            input_schema={
                "type": "object",
                "properties": {
                    "seconds": {"type": "number", "minimum": 0},
                    "fail": {"type": "boolean", "default": False},
                },
                "required": ["seconds"],
            },
            task_support="optional",
            run=slow_report,
        ),
        Tool(
            name="quick_lookup",
            description="Looks a key up at once (no task support).",
            input_schema={"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
            task_support=None,
            run=quick_lookup,
        ),
        Tool(
            name="ask_approval",
            description="Asks the client to approve `question` (elicitation) and answers approved/declined.",
            input_schema={
                "type": "object",
                "properties": {"question": {"type": "string"}},
                "required": ["question"],
            },
            task_support="required",
            run=ask_approval,
        ),
    )
}
