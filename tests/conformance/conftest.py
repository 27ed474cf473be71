"""Real MCP peers for the conformance suite: one fixture, `mcp_peer`, parametrized over every peer.

Each peer runs as a subprocess on a free loopback port, one at a time (session scope: pytest groups the
tests by peer and stops a peer before it starts the next). The third-party peers run from the runtimes
`scripts/install-peers` puts in ``$LONGCALL_PEERS_DIR`` (default ``~/.cache/longcall-peers``); when one
is missing the fixture fails and says so. longcall's own server (`demo_server.mcp`) runs with this
interpreter and exposes fault switches at ``McpPeer.control_url``; `reset_faults` clears them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx2
import pytest

from demo_server.command import command as demo_server_command

if TYPE_CHECKING:
    from tests.conformance.oauth_peer import OAuthPeer

REPO = Path(__file__).resolve().parents[2]
PEER_PROGRAMS = Path(__file__).resolve().parent / "peers"
START_TIMEOUT_S = 30.0
START_ATTEMPTS = 3
STOP_TIMEOUT_S = 10.0


def peers_dir() -> Path:
    return Path(os.environ.get("LONGCALL_PEERS_DIR", Path.home() / ".cache" / "longcall-peers"))


@dataclass(frozen=True)
class McpPeer:
    """A running MCP server and what the suite may expect of it.

    tasks: declares 2025-11-25 task support. stateless: no sessions. json_response: answers are
    application/json rather than SSE. elicitation: `input_required` can be driven (server-to-client
    requests reach the client). listing: `tasks/list` returns the caller's tasks. quirks: documented
    deviations from the spec, see `QUIRKS`. control_url: fault switches and logs (longcall's server only).
    """

    name: str
    url: str
    tasks: bool
    stateless: bool
    json_response: bool
    elicitation: bool
    listing: bool
    quirks: frozenset[str]
    control_url: str | None


# Every quirk name a peer may carry, with what it means on the wire.
QUIRKS: dict[str, str] = {
    "ttl_omitted_when_null": "a task created without ttl has no `ttl` key (the schema requires null)",
    "is_error_is_completed": "a tool result with isError:true ends the task `completed`, not `failed`",
    "raised_result_is_empty": "tasks/result of a task whose tool raised is an empty result, not the error",
    "result_of_cancelled_is_empty": "tasks/result of a cancelled task is an empty result with the _meta",
    "result_of_cancelled_is_-32603": "tasks/result of a cancelled task is JSON-RPC error -32603",
    "result_does_not_block": "tasks/result on a non-terminal task answers -32602 'Task not completed yet'",
    "result_meta_missing_on_error": "tasks/result of an isError result lacks the related-task _meta",
    "cancel_completed_succeeds": "tasks/cancel of a completed task answers cancelled (get: still completed)",
    "wrong_task_mode_is_tool_error": "a wrong task mode (forbidden + task, required without) is isError",
    "forbidden_with_task_is_-32602": "a task-augmented call of a forbidden tool is -32602, not -32601",
    "list_always_empty": "tasks/list is declared but always answers an empty list",
    "elicitation_hangs_in_json": "input_required never reaches a JSON-response client: tasks/result hangs",
    "elicitation_not_on_result_stream": "a task's elicitation goes to the GET stream, not to tasks/result",
    "input_required_not_in_status": "tasks/get never shows input_required (only status notifications do)",
    "elicitation_lacks_related_task": "the task's elicitation/create carries no related-task _meta",
    "tasks_not_bound_to_session": "stateful, yet any session can read any task (spec binds to auth only)",
    "task_param_ignored": "no tasks capability: a task-augmented tools/call runs synchronously",
    "error_messages_prefixed": "JSON-RPC error messages start with 'MCP error <code>: '",
}


@dataclass(frozen=True)
class PeerSpec:
    name: str
    runtime: str | None  # folder under peers_dir(); None for longcall's own server
    argv: Callable[[int], list[str]]
    tasks: bool = True
    stateless: bool = False
    json_response: bool = False
    elicitation: bool = True
    listing: bool = True
    quirks: frozenset[str] = frozenset()
    control: bool = False


def _venv_python(runtime: str) -> str:
    return str(peers_dir() / runtime / "venv" / "bin" / "python")


def _python_peer(runtime: str, program: str, *flags: str) -> Callable[[int], list[str]]:
    return lambda port: [_venv_python(runtime), str(PEER_PROGRAMS / program), "--port", str(port), *flags]


def _ts_peer(port: int) -> list[str]:
    return [
        "node",
        str(PEER_PROGRAMS / "sdk_ts.mjs"),
        "--port",
        str(port),
        "--sdk-dir",
        str(peers_dir() / "sdk-ts-1.32"),
    ]


def _longcall(*flags: str) -> Callable[[int], list[str]]:
    return lambda port: demo_server_command(port, *flags)


SDK_130_QUIRKS = frozenset(
    {
        "ttl_omitted_when_null",
        "is_error_is_completed",
        "raised_result_is_empty",
        "result_of_cancelled_is_empty",
    }
)

PEERS: tuple[PeerSpec, ...] = (
    PeerSpec(
        "sdk-py-1.30-sse", "sdk-py-1.30", _python_peer("sdk-py-1.30", "sdk_py_v1.py"), quirks=SDK_130_QUIRKS
    ),
    PeerSpec(
        "sdk-py-1.30-json",
        "sdk-py-1.30",
        _python_peer("sdk-py-1.30", "sdk_py_v1.py", "--json-response"),
        json_response=True,
        elicitation=False,
        quirks=SDK_130_QUIRKS | {"elicitation_hangs_in_json"},
    ),
    PeerSpec(
        "sdk-py-1.30-stateless",
        "sdk-py-1.30",
        _python_peer("sdk-py-1.30", "sdk_py_v1.py", "--stateless"),
        stateless=True,
        elicitation=False,
        listing=False,
        quirks=SDK_130_QUIRKS | {"list_always_empty"},
    ),
    PeerSpec(
        "sdk-py-2.3-notasks",
        "sdk-py-2.3",
        _python_peer("sdk-py-2.3", "sdk_py_v2.py"),
        tasks=False,
        elicitation=False,
        listing=False,
        quirks=frozenset({"task_param_ignored"}),
    ),
    PeerSpec(
        "sdk-ts-1.32",
        "sdk-ts-1.32",
        _ts_peer,
        quirks=frozenset(
            {
                "result_of_cancelled_is_-32603",
                "error_messages_prefixed",
                "wrong_task_mode_is_tool_error",
                "forbidden_with_task_is_-32602",
            }
        ),
    ),
    PeerSpec(
        "fastmcp-3.4",
        "fastmcp-3.4",
        _python_peer("fastmcp-3.4", "fastmcp_tasks.py"),
        elicitation=False,
        listing=False,
        quirks=frozenset(
            {
                "cancel_completed_succeeds",
                "result_does_not_block",
                "result_meta_missing_on_error",
                "is_error_is_completed",
                "wrong_task_mode_is_tool_error",
                "list_always_empty",
                "elicitation_not_on_result_stream",
                "input_required_not_in_status",
                "elicitation_lacks_related_task",
                "tasks_not_bound_to_session",
            }
        ),
    ),
    PeerSpec("longcall-stateful", None, _longcall(), control=True),
    PeerSpec(
        "longcall-stateless",
        None,
        _longcall("--stateless"),
        stateless=True,
        listing=False,
        control=True,
    ),
    PeerSpec(
        "longcall-json",
        None,
        _longcall("--json-response"),
        json_response=True,
        control=True,
    ),
)
PEERS_BY_NAME = {spec.name: spec for spec in PEERS}
if undocumented := {quirk for spec in PEERS for quirk in spec.quirks} - QUIRKS.keys():
    raise RuntimeError(f"quirks without a description in QUIRKS: {sorted(undocumented)}")


def _check_runtime(spec: PeerSpec, argv: list[str]) -> None:
    """Fail (never skip) when a peer cannot run here, naming the script that installs it."""
    missing = None
    if spec.runtime is not None and not (peers_dir() / spec.runtime / ".installed").is_file():
        missing = f"runtime {peers_dir() / spec.runtime} is not installed"
    elif shutil.which(argv[0]) is None:
        missing = f"{argv[0]} is not available"
    if missing is not None:
        pytest.fail(
            f"peer {spec.name}: {missing}; run scripts/install-peers "
            "(and set LONGCALL_PEERS_DIR if the peers live elsewhere)",
            pytrace=False,
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_until_listening(process: subprocess.Popen[bytes], port: int) -> str:
    """'listening', 'exited' or 'timeout' (bounded by START_TIMEOUT_S)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return "exited"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return "listening" if process.poll() is None else "exited"
        time.sleep(0.05)  # a bounded retry interval, not a wait for a result
    return "timeout"


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_TIMEOUT_S)


def _launch(spec: PeerSpec, log_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Start the peer on a free port; a start that exits at once (the port taken meanwhile) is retried."""
    for attempt in range(1, START_ATTEMPTS + 1):
        port = _free_port()
        argv = spec.argv(port)
        _check_runtime(spec, argv)
        stderr_path = log_dir / f"{spec.name}-{attempt}.stderr"
        with stderr_path.open("wb") as stderr:
            process = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr)
        state = _wait_until_listening(process, port)
        if state == "listening":
            return process, port
        _stop(process)
        if state == "timeout" or attempt == START_ATTEMPTS:
            what = "not listening" if state == "timeout" else f"exited with {process.returncode}"
            pytest.fail(
                f"peer {spec.name} {what} after start (attempt {attempt}, limit {START_TIMEOUT_S:.0f} s); "
                f"stderr:\n{stderr_path.read_text(errors='replace')[-4000:]}",
                pytrace=False,
            )
    raise AssertionError("unreachable")


def start_peer(spec: PeerSpec, log_dir: Path) -> Iterator[McpPeer]:
    """Run one peer until the generator is closed."""
    process, port = _launch(spec, log_dir)
    try:
        yield McpPeer(
            name=spec.name,
            url=f"http://127.0.0.1:{port}/mcp",
            tasks=spec.tasks,
            stateless=spec.stateless,
            json_response=spec.json_response,
            elicitation=spec.elicitation,
            listing=spec.listing,
            quirks=spec.quirks,
            control_url=f"http://127.0.0.1:{port}/_control" if spec.control else None,
        )
    finally:
        _stop(process)


@pytest.fixture(scope="session", params=[spec.name for spec in PEERS], ids=[spec.name for spec in PEERS])
def mcp_peer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpPeer]:
    """A running peer; test ids are the peer names (`sdk-py-1.30-sse`, ..., `longcall-json`)."""
    spec = PEERS_BY_NAME[request.param]
    yield from start_peer(spec, tmp_path_factory.mktemp(f"peer-{spec.name}"))


def reset_faults(peer: McpPeer) -> None:
    """Switch every fault off and clear the request log on longcall's server (a no-op for other peers)."""
    if peer.control_url is None:
        return
    with httpx2.Client(timeout=5.0) as client:
        client.delete(f"{peer.control_url}/faults").raise_for_status()
        client.delete(f"{peer.control_url}/log").raise_for_status()


@pytest.fixture
def clean_peer(mcp_peer: McpPeer) -> McpPeer:
    """`mcp_peer` with its faults switched off and its request log cleared for this test."""
    reset_faults(mcp_peer)
    return mcp_peer


# ----------------------------------------------------------------------------- the OAuth peers (issue 23)
@pytest.fixture(scope="module")
def oauth_peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OAuthPeer]:
    """The authorization server and the MCP resource server that trusts only it, running for the module
    (tests/conformance/oauth_peer.py, imported here when asked for: it imports this module's helpers)."""
    from tests.conformance.oauth_peer import start_oauth_peer  # noqa: PLC0415

    yield from start_oauth_peer(tmp_path_factory.mktemp("oauth-peer"))


@pytest.fixture
def oauth_peer(oauth_peers: OAuthPeer) -> OAuthPeer:
    """`oauth_peers` with every switch off and both logs cleared for this test."""
    oauth_peers.reset()
    return oauth_peers
