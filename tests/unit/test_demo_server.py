"""longcall's demo MCP server (demo_server.mcp): the spec points it is faithful on and every fault switch.

Real server processes on loopback, one per mode for the module (stateful SSE with tasks/list pages of 2,
JSON answers, stateless); faults and the request log are reset before each test of the stateful one.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx2
import pytest

from demo_server.command import command
from tests.conformance.conftest import McpPeer, PeerSpec, reset_faults, start_peer

PROTOCOL = "2025-11-25"
WAIT_S = 10.0


def _start(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str) -> Iterator[McpPeer]:
    spec = PeerSpec(
        name,
        None,
        lambda port: command(port, *flags),
        control=True,
    )
    yield from start_peer(spec, Path(tmp_path_factory.mktemp(name)))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpPeer]:
    yield from _start(tmp_path_factory, "demo-unit", "--page-size", "2")


@pytest.fixture
def peer(server: McpPeer) -> McpPeer:
    reset_faults(server)
    return server


class Client:
    """A raw JSON-RPC client over Streamable HTTP: one session, SSE or JSON answers."""

    def __init__(self, peer: McpPeer, capabilities: dict[str, Any] | None = None) -> None:
        self.url = peer.url
        self.headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        self.http = httpx2.Client(timeout=WAIT_S)
        self.next_id = 1
        init = self.post(
            "initialize",
            {
                "protocolVersion": PROTOCOL,
                "capabilities": capabilities if capabilities is not None else {"elicitation": {"form": {}}},
                "clientInfo": {"name": "unit", "version": "0"},
            },
        )
        assert "result" in init, init
        self.headers["MCP-Protocol-Version"] = PROTOCOL

    def close(self) -> None:
        self.http.close()

    def same_session(self) -> Client:
        """A second connection in this client's session (for concurrent requests)."""
        twin = Client.__new__(Client)
        twin.url, twin.headers, twin.next_id = self.url, dict(self.headers), self.next_id + 1000
        twin.http = httpx2.Client(timeout=WAIT_S)
        return twin

    def send(self, method: str, params: dict[str, Any]) -> httpx2.Response:
        self.next_id += 1
        body = {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}
        response = self.http.post(self.url, headers=self.headers, json=body)
        if method == "initialize" and "mcp-session-id" in response.headers:
            self.headers["Mcp-Session-Id"] = response.headers["mcp-session-id"]
        return response

    def post(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        return only_message(self.send(method, params))

    def create(self, tool: str, arguments: dict[str, Any], ttl: int | None = 60_000) -> str:
        answer = self.post("tools/call", {"name": tool, "arguments": arguments, "task": {"ttl": ttl}})
        task_id: str = answer["result"]["task"]["taskId"]
        return task_id

    def status(self, task_id: str) -> dict[str, Any]:
        answer = self.post("tasks/get", {"taskId": task_id})
        result: dict[str, Any] = answer["result"]
        return result

    def wait_for(self, task_id: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            status = self.status(task_id)
            if done(status):
                return status
            time.sleep(0.05)  # poll interval of this test client
        pytest.fail(f"task {task_id} did not get there within {WAIT_S} s: {status}")


def only_message(response: httpx2.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("application/json"):
        message: dict[str, Any] = response.json()
        return message
    events = [event for event in response.text.split("\r\n\r\n") if event]
    assert len(events) == 1, events
    assert events[0].startswith("event: message\r\ndata: ")
    decoded: dict[str, Any] = json.loads(events[0].split("data: ", 1)[1])
    return decoded


def terminal(status: dict[str, Any]) -> bool:
    return status["status"] in ("completed", "failed", "cancelled")


@pytest.fixture
def client(peer: McpPeer) -> Iterator[Client]:
    client = Client(peer)
    yield client
    client.close()


def control(peer: McpPeer, path: str, faults: dict[str, Any] | None = None) -> Any:
    assert peer.control_url is not None
    with httpx2.Client(timeout=WAIT_S) as http:
        if faults is None:
            response = http.get(f"{peer.control_url}/{path}")
        else:
            response = http.post(f"{peer.control_url}/{path}", json=faults)
    response.raise_for_status()
    return response.json()


# ---- the protocol -------------------------------------------------------------------------------


def test_task_lifecycle_and_result_meta(client: Client) -> None:
    task_id = client.create("slow_report", {"seconds": 0.1})
    created = client.status(task_id)
    assert created["status"] in ("working", "completed")
    assert created["ttl"] == 60_000
    done = client.wait_for(task_id, terminal)
    assert done["status"] == "completed"
    result = client.post("tasks/result", {"taskId": task_id})["result"]
    assert result["content"] == [{"type": "text", "text": "report ready after 0.1s"}]
    assert result["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": task_id}


def test_ttl_is_always_present(client: Client) -> None:
    answer = client.post("tools/call", {"name": "slow_report", "arguments": {"seconds": 0}, "task": {}})
    task = answer["result"]["task"]
    assert "ttl" in task
    assert task["ttl"] is None


def test_is_error_result_fails_the_task(client: Client) -> None:
    task_id = client.create("slow_report", {"seconds": 0, "fail": True})
    status = client.wait_for(task_id, terminal)
    assert status["status"] == "failed"
    assert status["statusMessage"] == "report ready after 0s"
    result = client.post("tasks/result", {"taskId": task_id})["result"]
    assert result["isError"] is True


def test_task_mode_errors_are_method_not_found(client: Client) -> None:
    forbidden = client.post("tools/call", {"name": "quick_lookup", "arguments": {"key": "k"}, "task": {}})
    assert forbidden["error"]["code"] == -32601
    required = client.post("tools/call", {"name": "ask_approval", "arguments": {"question": "q"}})
    assert required["error"]["code"] == -32601
    plain = client.post("tools/call", {"name": "quick_lookup", "arguments": {"key": "k"}})
    assert plain["result"]["content"][0]["text"] == "value:k"


def test_cancel_then_cancel_again(client: Client) -> None:
    task_id = client.create("slow_report", {"seconds": 30})
    cancelled = client.post("tasks/cancel", {"taskId": task_id})["result"]
    assert cancelled["status"] == "cancelled"
    again = client.post("tasks/cancel", {"taskId": task_id})["error"]
    assert again == {"code": -32602, "message": "Cannot cancel task: already in terminal status 'cancelled'"}
    assert client.post("tasks/result", {"taskId": task_id})["error"]["code"] == -32602


def test_tasks_are_bound_to_their_session(peer: McpPeer, client: Client) -> None:
    task_id = client.create("slow_report", {"seconds": 0})
    other = Client(peer)
    try:
        error = other.post("tasks/get", {"taskId": task_id})["error"]
        assert error == {"code": -32602, "message": "Failed to retrieve task: Task not found"}
        assert other.post("tasks/list", {})["result"] == {"tasks": []}
    finally:
        other.close()


def test_list_pages_with_an_opaque_cursor(client: Client) -> None:
    created = [client.create("slow_report", {"seconds": 0}) for _ in range(3)]
    first = client.post("tasks/list", {})["result"]
    assert [task["taskId"] for task in first["tasks"]] == created[:2]
    second = client.post("tasks/list", {"cursor": first["nextCursor"]})["result"]
    assert [task["taskId"] for task in second["tasks"]] == created[2:]
    assert "nextCursor" not in second
    assert client.post("tasks/list", {"cursor": "!!"})["error"]["code"] == -32602


def test_input_required_round_trip_on_the_result_stream(client: Client) -> None:
    task_id = client.create("ask_approval", {"question": "Ship?"})
    client.wait_for(task_id, lambda status: status["status"] == "input_required")
    client.next_id += 1
    body = {"jsonrpc": "2.0", "id": client.next_id, "method": "tasks/result", "params": {"taskId": task_id}}
    messages: list[dict[str, Any]] = []
    with client.http.stream("POST", client.url, headers=client.headers, json=body) as stream:
        buffer = ""
        for chunk in stream.iter_text():
            buffer += chunk
            while "\r\n\r\n" in buffer:
                event, buffer = buffer.split("\r\n\r\n", 1)
                message = json.loads(event.split("data: ", 1)[1])
                messages.append(message)
                if message.get("method") == "elicitation/create":
                    reply = {
                        "jsonrpc": "2.0",
                        "id": message["id"],
                        "result": {"action": "accept", "content": {"approved": True}},
                    }
                    assert client.http.post(client.url, headers=client.headers, json=reply).status_code == 202
    request, final = messages
    assert request["params"]["message"] == "Ship?"
    assert request["params"]["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": task_id}
    assert final["result"]["content"][0]["text"] == "approved"


def _first_event(client: Client, task_id: str) -> dict[str, Any]:
    """Open a tasks/result stream, read its first event, and hang up."""
    client.next_id += 1
    body = {"jsonrpc": "2.0", "id": client.next_id, "method": "tasks/result", "params": {"taskId": task_id}}
    buffer = ""
    with client.http.stream("POST", client.url, headers=client.headers, json=body) as stream:
        for chunk in stream.iter_text():
            buffer += chunk
            if "\r\n\r\n" in buffer:
                break
    event: dict[str, Any] = json.loads(buffer.split("\r\n\r\n")[0].split("data: ", 1)[1])
    return event


def test_an_unanswered_request_comes_again_on_the_next_result_stream(client: Client) -> None:
    task_id = client.create("ask_approval", {"question": "Ship?"})
    first = _first_event(client, task_id)
    assert first["method"] == "elicitation/create"
    assert _first_event(client, task_id) == first
    reply = {"jsonrpc": "2.0", "id": first["id"], "result": {"action": "decline"}}
    assert client.http.post(client.url, headers=client.headers, json=reply).status_code == 202
    assert client.post("tasks/result", {"taskId": task_id})["result"]["content"][0]["text"] == "declined"


def test_polls_are_answered_with_json_even_in_sse_mode(client: Client) -> None:
    task_id = client.create("slow_report", {"seconds": 0})
    response = client.send("tasks/get", {"taskId": task_id})
    assert response.headers["content-type"] == "application/json"
    assert client.send("ping", {}).headers["content-type"] == "text/event-stream"


def test_a_foreign_origin_is_forbidden(peer: McpPeer, client: Client) -> None:
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    foreign = client.http.post(
        peer.url, headers={**client.headers, "Origin": "https://evil.example"}, json=ping
    )
    assert foreign.status_code == 403
    local = client.http.post(
        peer.url, headers={**client.headers, "Origin": "http://localhost:3000"}, json=ping
    )
    assert local.status_code == 200


def test_elicitation_needs_the_client_capability(peer: McpPeer) -> None:
    client = Client(peer, capabilities={})
    try:
        task_id = client.create("ask_approval", {"question": "Ship?"})
        assert client.wait_for(task_id, terminal)["status"] == "failed"
        assert client.post("tasks/result", {"taskId": task_id})["error"]["code"] == -32600
    finally:
        client.close()


def test_http_rules(peer: McpPeer, client: Client) -> None:
    with httpx2.Client(timeout=WAIT_S) as http:
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        assert (
            http.post(
                peer.url, headers={**client.headers, "Accept": "application/json"}, json=ping
            ).status_code
            == 406
        )
        no_session = {key: value for key, value in client.headers.items() if key != "Mcp-Session-Id"}
        assert http.post(peer.url, headers=no_session, json=ping).status_code == 400
        bad_version = {**client.headers, "MCP-Protocol-Version": "1999-01-01"}
        assert http.post(peer.url, headers=bad_version, json=ping).status_code == 400
        notification = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        assert http.post(peer.url, headers=client.headers, json=notification).status_code == 202
        assert http.delete(peer.url, headers=client.headers).status_code == 200
        assert http.post(peer.url, headers=client.headers, json=ping).status_code == 404


# ---- fault switches -----------------------------------------------------------------------------


def test_lose_create_response_creates_the_task_but_answers_nothing(peer: McpPeer, client: Client) -> None:
    control(peer, "faults", {"lose_create_response": 1})
    with pytest.raises(httpx2.RemoteProtocolError):
        client.send("tools/call", {"name": "slow_report", "arguments": {"seconds": 0}, "task": {"ttl": 1000}})
    tasks = control(peer, "tasks")["tasks"]
    assert [task["tool"] for task in tasks if task["session"] == client.headers["Mcp-Session-Id"]] == [
        "slow_report"
    ]
    assert control(peer, "faults")["lose_create_response"] == 0
    client.create("slow_report", {"seconds": 0})  # the next one is answered


def test_dribble_call_answer_sends_the_answer_a_byte_at_a_time(peer: McpPeer, client: Client) -> None:
    """The call is done (a synchronous tool here), and its answer's head comes about ten bytes a second."""
    control(peer, "faults", {"dribble_call_answer": 1})
    url = httpx2.URL(peer.url)
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": 99,
            "method": "tools/call",
            "params": {"name": "quick_lookup", "arguments": {}},
        }
    ).encode()
    head = [f"POST {url.raw_path.decode()} HTTP/1.1", f"Host: {url.host}:{url.port}"]
    head += [f"{name}: {value}" for name, value in client.headers.items()]
    head += [f"Content-Length: {len(body)}"]
    received = b""
    with socket.create_connection((url.host, url.port or 80), timeout=WAIT_S) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        until = time.monotonic() + 1.0
        while (left := until - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                chunk = sock.recv(1000)
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
    assert received, "no byte of the answer came within 1 s"
    assert b"HTTP/1.1 200 OK".startswith(received), received
    assert len(received) <= 15, received  # a byte each 0.1 s: about ten in a second, not the answer
    assert control(peer, "faults")["dribble_call_answer"] == 0
    assert "result" in client.post("tools/call", {"name": "quick_lookup", "arguments": {}})  # answered


def test_status_429_then_normal(peer: McpPeer, client: Client) -> None:
    control(peer, "faults", {"status_429": {"tasks/get": {"count": 1, "retry_after_s": 3}}})
    refused = client.send("tasks/get", {"taskId": "x"})
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "3"
    assert client.post("tasks/get", {"taskId": "x"})["error"]["code"] == -32602
    methods = [entry["method"] for entry in control(peer, "log")["entries"]]
    assert methods[-2:] == ["tasks/get", "tasks/get"]


def test_delay_ms(peer: McpPeer, client: Client) -> None:
    control(peer, "faults", {"delay_ms": {"ping": 300}})
    started = time.monotonic()
    client.post("ping", {})
    assert time.monotonic() - started >= 0.3


def test_reorder_delivers_the_older_answer_last(peer: McpPeer, client: Client) -> None:
    # Long enough that the first read arrives while the task works, on a loaded machine too (at 0.3 s, a
    # read that took longer to arrive saw it completed).
    task_id = client.create("slow_report", {"seconds": 1.5})
    control(peer, "faults", {"reorder": 1})
    first: list[str] = []
    twin = client.same_session()
    thread = threading.Thread(target=lambda: first.append(twin.status(task_id)["status"]))
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not any(entry["method"] == "tasks/get" for entry in control(peer, "log")["entries"]):
            assert time.monotonic() < deadline, "the first tasks/get never reached the server"
            time.sleep(0.02)
        while control(peer, "tasks")["tasks"][-1]["status"] != "completed":
            assert time.monotonic() < deadline, "the task did not complete"
            time.sleep(0.02)
        assert first == [], "the first answer was not held"
        assert client.status(task_id)["status"] == "completed"
    finally:
        thread.join(timeout=WAIT_S)
        twin.close()
    assert first == ["working"]  # computed on arrival, delivered after the newer answer


def test_drop_and_truncate_result(peer: McpPeer, client: Client) -> None:
    task_id = client.create("slow_report", {"seconds": 0})
    client.wait_for(task_id, terminal)
    control(peer, "faults", {"drop_result": 1, "truncate_result": 1})
    with pytest.raises(httpx2.RemoteProtocolError):
        client.send("tasks/result", {"taskId": task_id})
    with pytest.raises(httpx2.RemoteProtocolError):
        client.send("tasks/result", {"taskId": task_id})
    assert client.post("tasks/result", {"taskId": task_id})["result"]["isError"] is False


def test_expire_early_purges_at_the_terminal_state(peer: McpPeer, client: Client) -> None:
    control(peer, "faults", {"expire_early": {"after_ms": 0}})
    task_id = client.create("slow_report", {"seconds": 0})
    deadline = time.monotonic() + WAIT_S
    while (answer := client.post("tasks/get", {"taskId": task_id})).get("result"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert answer["error"] == {"code": -32602, "message": "Failed to retrieve task: Task has expired"}


def test_complete_on_cancel(peer: McpPeer, client: Client) -> None:
    task_id = client.create("slow_report", {"seconds": 30})
    control(peer, "faults", {"complete_on_cancel": 1})
    error = client.post("tasks/cancel", {"taskId": task_id})["error"]
    assert error == {"code": -32602, "message": "Cannot cancel task: already in terminal status 'completed'"}
    assert (
        client.post("tasks/result", {"taskId": task_id})["result"]["content"][0]["text"]
        == "report ready after 30s"
    )


def test_finish_ends_working_tasks_now_with_their_result(peer: McpPeer, client: Client) -> None:
    working = client.create("slow_report", {"seconds": 30})
    done = client.create("slow_report", {"seconds": 0})
    client.wait_for(done, terminal)
    before = time.time()
    answer = control(peer, "finish", {"task_ids": [working, done, "no-such-task"]})
    assert list(answer["finished"]) == [working]  # the terminal and the unknown one are left alone
    status = client.status(working)
    assert status["status"] == "completed"
    assert status["lastUpdatedAt"] == answer["finished"][working]
    assert datetime.fromisoformat(status["lastUpdatedAt"]).timestamp() >= before - 0.01
    result = client.post("tasks/result", {"taskId": working})["result"]
    assert result["content"] == [{"type": "text", "text": "report ready after 30s"}]
    assert control(peer, "finish", {"task_ids": [working]}) == {"finished": {}}


def test_finish_needs_a_list_of_task_ids(peer: McpPeer) -> None:
    assert peer.control_url is not None
    for body in ({"task_ids": "x"}, {"task_ids": [1]}, ["x"]):
        response = httpx2.post(f"{peer.control_url}/finish", json=body, timeout=WAIT_S)
        assert response.status_code == 400
        assert "task_ids" in response.json()["error"]


def test_force_input_required(peer: McpPeer, client: Client) -> None:
    control(peer, "faults", {"force_input_required": 1})
    task_id = client.create("slow_report", {"seconds": 0})
    client.wait_for(task_id, lambda status: status["status"] == "input_required")
    (view,) = [task for task in control(peer, "tasks")["tasks"] if task["taskId"] == task_id]
    (request,) = view["pendingInputs"]
    assert request["method"] == "elicitation/create"
    client.post("tasks/cancel", {"taskId": task_id})


def test_bad_fault_settings_are_refused(peer: McpPeer) -> None:
    assert peer.control_url is not None
    with httpx2.Client(timeout=WAIT_S) as http:
        assert http.post(f"{peer.control_url}/faults", json={"no_such_switch": 1}).status_code == 400
        assert http.post(f"{peer.control_url}/faults", json=[1]).status_code == 400
        assert http.post(f"{peer.control_url}/faults", json={"reorder": -1}).status_code == 400


# ---- the other modes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def json_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpPeer]:
    yield from _start(tmp_path_factory, "demo-unit-json", "--json-response")


@pytest.fixture(scope="module")
def stateless_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpPeer]:
    yield from _start(tmp_path_factory, "demo-unit-stateless", "--stateless")


def test_json_mode_elicits_on_the_get_stream(json_server: McpPeer) -> None:
    client = Client(json_server)
    try:
        task_id = client.create("ask_approval", {"question": "Ship?"})
        client.wait_for(task_id, lambda status: status["status"] == "input_required")
        stream_headers = {**client.headers, "Accept": "text/event-stream"}
        with client.http.stream("GET", client.url, headers=stream_headers) as stream:
            buffer = ""
            for chunk in stream.iter_text():
                buffer += chunk
                if "\r\n\r\n" in buffer:
                    break
        request = json.loads(buffer.split("\r\n\r\n")[0].split("data: ", 1)[1])
        assert request["method"] == "elicitation/create"
        reply = {"jsonrpc": "2.0", "id": request["id"], "result": {"action": "decline"}}
        assert client.http.post(client.url, headers=client.headers, json=reply).status_code == 202
        result = client.post("tasks/result", {"taskId": task_id})["result"]
        assert result["content"][0]["text"] == "declined"
    finally:
        client.close()


def test_stateless_mode_has_no_sessions_and_no_listing(stateless_server: McpPeer) -> None:
    one, two = Client(stateless_server), Client(stateless_server)
    try:
        assert "Mcp-Session-Id" not in one.headers
        task_id = one.create("slow_report", {"seconds": 0})
        assert two.wait_for(task_id, terminal)["status"] == "completed"
        assert two.post("tasks/list", {})["error"]["code"] == -32601
        assert one.http.get(one.url, headers={"Accept": "text/event-stream"}).status_code == 405
    finally:
        one.close()
        two.close()
