"""Conformance peer: FastMCP 3.4 with its SEP-1686 (2025-11-25) background tasks on an in-memory Docket.

Run with the fastmcp-3.4 venv from scripts/install-peers:  python fastmcp_tasks.py --port N

FastMCP 3.x speaks the 2025-11-25 generation (tasks/get|result|list|cancel); FastMCP 4 speaks only the
2026-07-28 extension (shared/reference/mcp-tasks-extension.md §2.5). Known deviation: tasks/cancel on a
completed task answers `cancelled` instead of -32602. A task's elicitation is relayed to the client as
an ordinary elicitation/create on the session's GET stream, not on the tasks/result stream.
"""

from __future__ import annotations

import argparse
import asyncio
import os

# In-process Docket: no Redis needed. Set before fastmcp reads its settings.
os.environ.setdefault("FASTMCP_DOCKET__URL", "memory://")

import uvicorn
from fastmcp import Context, FastMCP
from fastmcp.tools.base import ToolResult
from fastmcp.utilities.tasks import TaskConfig
from mcp.types import TextContent
from pydantic import BaseModel


class Approval(BaseModel):
    approved: bool


def text_result(text: str, *, is_error: bool = False) -> ToolResult:
    """Plain text content, no structured output (FastMCP would wrap a returned CallToolResult as JSON)."""
    return ToolResult(content=[TextContent(type="text", text=text)], is_error=is_error)


server = FastMCP("longcall-peer-fastmcp-3.4")


@server.tool(
    description="Builds a report slowly: sleeps `seconds`, then answers (isError when `fail`).",
    task=TaskConfig(mode="optional"),
)
async def slow_report(seconds: float, fail: bool = False) -> ToolResult:
    await asyncio.sleep(seconds)
    return text_result(f"report ready after {seconds:g}s", is_error=fail)


@server.tool(description="Looks a key up at once (no task support).")
async def quick_lookup(key: str) -> ToolResult:
    return text_result(f"value:{key}")


@server.tool(
    description="Asks the client to approve `question` (elicitation) and answers approved/declined.",
    task=TaskConfig(mode="required"),
)
async def ask_approval(question: str, ctx: Context) -> ToolResult:
    answer = await ctx.elicit(question, Approval)
    approved = (
        answer.action == "accept" and getattr(answer, "data", None) is not None and answer.data.approved
    )
    return text_result("approved" if approved else "declined")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = server.http_app(path="/mcp")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main()
