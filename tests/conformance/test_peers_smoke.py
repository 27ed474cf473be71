"""Every peer starts, completes the handshake and lists the three shared tools (raw httpx2 JSON-RPC)."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest

from tests.conformance.conftest import McpPeer

pytestmark = pytest.mark.conformance

PROTOCOL = "2025-11-25"
EXPECTED_TASK_SUPPORT = {"slow_report": "optional", "quick_lookup": None, "ask_approval": "required"}


def _messages(response: httpx2.Response) -> list[dict[str, Any]]:
    """The JSON-RPC messages of an answer, whether application/json or an SSE stream."""
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("application/json"):
        body = response.json()
        return body if isinstance(body, list) else [body]
    assert content_type.startswith("text/event-stream"), content_type
    messages = []
    for event in response.text.replace("\r\n", "\n").split("\n\n"):
        data = [line.removeprefix("data:").lstrip() for line in event.split("\n") if line.startswith("data:")]
        if data:
            messages.append(json.loads("\n".join(data)))
    return messages


def _rpc(
    client: httpx2.Client, url: str, headers: dict[str, str], request: dict[str, Any]
) -> httpx2.Response:
    response = client.post(url, headers=headers, json=request)
    assert response.status_code == 200, response.text
    return response


def _result(response: httpx2.Response, request_id: int) -> dict[str, Any]:
    answers = [message for message in _messages(response) if message.get("id") == request_id]
    assert len(answers) == 1, _messages(response)
    assert "error" not in answers[0], answers[0]
    result: dict[str, Any] = answers[0]["result"]
    return result


def test_handshake_and_tool_list(mcp_peer: McpPeer) -> None:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": PROTOCOL,
            "capabilities": {"elicitation": {"form": {}}, "tasks": {"list": {}, "cancel": {}}},
            "clientInfo": {"name": "longcall-smoke", "version": "0"},
        },
    }
    with httpx2.Client(timeout=10.0) as client:
        response = _rpc(client, mcp_peer.url, headers, initialize)
        init = _result(response, 1)
        assert init["protocolVersion"] == PROTOCOL
        session_id = response.headers.get("mcp-session-id")
        assert (session_id is None) == mcp_peer.stateless
        if session_id is not None:
            headers["Mcp-Session-Id"] = session_id
        headers["MCP-Protocol-Version"] = PROTOCOL

        tasks_capability = init["capabilities"].get("tasks")
        if mcp_peer.tasks:
            assert tasks_capability["requests"]["tools"]["call"] == {}
        else:
            assert tasks_capability is None

        initialized = client.post(
            mcp_peer.url, headers=headers, json={"jsonrpc": "2.0", "method": "notifications/initialized"}
        )
        assert initialized.status_code == 202

        listed = _result(
            _rpc(client, mcp_peer.url, headers, {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}), 2
        )

    tools = {tool["name"]: tool for tool in listed["tools"]}
    assert set(EXPECTED_TASK_SUPPORT) <= set(tools)
    for name, expected in EXPECTED_TASK_SUPPORT.items():
        declared = tools[name].get("execution", {}).get("taskSupport")
        if not mcp_peer.tasks:
            assert declared is None, (name, tools[name])
        elif expected is None:
            assert declared in (None, "forbidden"), (name, tools[name])
        else:
            assert declared == expected, (name, tools[name])
