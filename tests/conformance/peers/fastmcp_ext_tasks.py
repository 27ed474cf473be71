"""Conformance peer: FastMCP 4.1.4 with fastmcp-tasks 4.1.4, the MCP tasks extension of 2026-07-28
(``io.modelcontextprotocol/tasks``, SEP-2663) on an in-memory Docket.

Run with the fastmcp-ext-4.1 venv from scripts/install-peers:  python fastmcp_ext_tasks.py --port N
``--ttl-s S`` shrinks the advertised ``ttlMs`` (the extension has no TTL option: Docket's execution_ttl
default is patched). Known deviations (reference/mcp-tasks-extension.md §2.4): ``ttlMs`` counts from
completion, not creation; no ``subscriptions/listen``; ``lastUpdatedAt`` is always now; ``Mcp-Name`` on
``tasks/*`` is not required.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

# This folder holds fastmcp_tasks.py (the 3.4 peer), which would shadow the fastmcp_tasks package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]

import docket.docket  # noqa: E402
import mcp_types  # noqa: E402
import uvicorn  # noqa: E402
from fastmcp import Context, FastMCP  # noqa: E402
from fastmcp.exceptions import ToolError  # noqa: E402
from fastmcp.utilities.tasks import TaskConfig  # noqa: E402
from fastmcp_tasks import TasksExtension  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402

FAST_POLL = TaskConfig(mode="optional", poll_interval=timedelta(milliseconds=200))


def build(ttl_s: float | None) -> FastMCP:
    if ttl_s is not None:
        original = docket.docket.Docket.__init__

        def patched(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs["execution_ttl"] = timedelta(seconds=ttl_s)
            original(self, *args, **kwargs)

        docket.docket.Docket.__init__ = patched  # type: ignore[method-assign]

    server = FastMCP("longcall-peer-fastmcp-ext-4.1")
    server.add_extension(TasksExtension(url="memory://"))

    @server.tool(description="Works `steps` steps of `step_s` seconds, reporting each.", task=FAST_POLL)
    async def slow_job(steps: int, step_s: float, ctx: Context) -> str:
        for step in range(1, steps + 1):
            await asyncio.sleep(step_s)
            await ctx.report_progress(step, steps, f"step {step}/{steps}")
        return f"slow_job finished {steps} steps"

    @server.tool(
        description="Sleeps `seconds`, with a poll interval hint of 30 s (a late poll: races with a cancel).",
        task=TaskConfig(mode="optional", poll_interval=timedelta(seconds=30)),
    )
    async def rare_poll_job(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return f"rare_poll_job done after {seconds:g}s"

    @server.tool(description="Asks the client for a name, then greets it.", task=FAST_POLL)
    async def ask_name(greeting: str, ctx: Context) -> Any:
        answers = ctx.input_responses
        if not answers or "name" not in answers:
            return mcp_types.InputRequiredResult(
                input_requests={
                    "name": mcp_types.ElicitRequest(
                        params=mcp_types.ElicitRequestFormParams(
                            message="Please enter your name.",
                            requested_schema={
                                "type": "object",
                                "properties": {"name": {"type": "string"}},
                                "required": ["name"],
                            },
                        )
                    )
                }
            )
        answer = answers["name"]
        action = getattr(answer, "action", None)
        content = getattr(answer, "content", None) or {}
        if action == "accept":
            return f"{greeting}, {content.get('name')}!"
        return f"{greeting}, anonymous (action={action})"

    @server.tool(description="Fails with a tool error (a completed task with isError).", task=FAST_POLL)
    async def tool_error() -> str:
        raise ToolError("tool-level failure: invalid input")

    @server.tool(description="Fails with a JSON-RPC error (a failed task).", task=FAST_POLL)
    async def protocol_error() -> str:
        await asyncio.sleep(0.1)
        raise MCPError(-32603, "upstream API rate limit exceeded")

    @server.tool(
        description="Runs only as a task.",
        task=TaskConfig(mode="required", poll_interval=timedelta(milliseconds=200)),
    )
    async def must_be_task(x: int) -> str:
        return f"x={x}"

    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttl-s", type=float, default=None)
    args = parser.parse_args()
    app = build(args.ttl_s).http_app(path="/mcp")
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
