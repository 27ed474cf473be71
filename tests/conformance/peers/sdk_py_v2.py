"""Conformance peer: the Python MCP SDK 2.3 (MCPServer), which has no 2025-11-25 tasks runtime.

Run with the sdk-py-2.3 venv from scripts/install-peers:  python sdk_py_v2.py --port N

It declares no `tasks` capability and no `execution.taskSupport`, runs a task-augmented tools/call
synchronously (the `task` parameter is ignored) and answers tasks/* with -32601: the peer for
"server without task support". ask_approval elicits inside the plain call (on the tools/call stream).
"""

from __future__ import annotations

import argparse
import asyncio

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, TextContent
from pydantic import BaseModel


class Approval(BaseModel):
    approved: bool


def text_result(text: str, *, is_error: bool = False) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=is_error)


server = MCPServer("longcall-peer-sdk-py-2.3")


@server.tool(description="Builds a report slowly: sleeps `seconds`, then answers (isError when `fail`).")
async def slow_report(seconds: float, fail: bool = False) -> CallToolResult:
    await asyncio.sleep(seconds)
    return text_result(f"report ready after {seconds:g}s", is_error=fail)


@server.tool(description="Looks a key up at once (no task support).")
async def quick_lookup(key: str) -> CallToolResult:
    return text_result(f"value:{key}")


@server.tool(description="Asks the client to approve `question` (elicitation) and answers approved/declined.")
async def ask_approval(question: str, ctx: Context) -> CallToolResult:
    answer = await ctx.elicit(question, Approval)
    approved = answer.action == "accept" and answer.data is not None and answer.data.approved
    return text_result("approved" if approved else "declined")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = server.streamable_http_app(host=args.host)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main()
