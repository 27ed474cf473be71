"""A whole fleet with an MCP tasks extension (2026-07-28) server beside the 2025-11-25 one: the real
FastMCP 4.1.4 + fastmcp-tasks 4.1.4 peer (``tasks_ext``, tests/conformance/peers/fastmcp_ext_tasks.py)
and longcall's MCP server (``reports``) in one configuration, longcall workers and beat, and the pipeline
worker. Real processes, real Postgres, Redis and broker (on :mod:`tests.support.fleet`, unchanged)."""

from __future__ import annotations

import contextlib
import json
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

from adapters import AdapterConfig, RemoteRef, RemoteStatus, default_registry
from tests import support
from tests.conformance.conftest import McpPeer, start_peer
from tests.conformance.test_mcp_ext_adapter import PEER
from tests.support.fleet import (
    Fleet,
    FleetParts,
    McpServer,
    fleet_config,
    free_port,
    running_fleet,
    start_mcp_server,
)

#: The extension server's name in the configuration.
EXT_SERVER = "tasks_ext"
EXT_VERSION = "2026-07-28"


def ext_config(url: str, **server: Any) -> str:
    values = {"poll_qps": 50, "control_qps": 50, "default_poll_interval_ms": 200, **server}
    lines = [
        f"[servers.{EXT_SERVER}]",
        'protocol = "mcp"',
        f'protocol_version = "{EXT_VERSION}"',
        f'url = "{url}"',
        *(f"{k} = {json.dumps(v)}" for k, v in values.items()),
    ]
    return "\n".join(lines) + "\n"


def start_ext_demo_server(log_dir: Path, *flags: str) -> McpServer:
    """longcall's own 2026-07-28 server (``python -m demo_server.mcp_ext``), its fault switches at
    ``control``."""
    port = free_port()
    argv = [sys.executable, "-m", "demo_server.mcp_ext", "--port", str(port), *flags]
    process = support.start_celery_like(argv, env={}, log_dir=log_dir, name=f"mcp-ext-{port}")
    control = f"http://127.0.0.1:{port}/_control"

    def up() -> bool:
        try:
            return httpx2.get(f"{control}/faults", timeout=1).status_code == 200
        except httpx2.HTTPError:
            return False

    support.wait_for("the extension demo server to listen", up)
    return McpServer(f"http://127.0.0.1:{port}/mcp", control, process)


@dataclass
class ExtFleet:
    """A running fleet with ``reports`` (MCP 2025-11-25, longcall's server) and ``tasks_ext`` (MCP
    2026-07-28 with the tasks extension, at ``ext_url``: the fastmcp-tasks ``peer``, or longcall's own
    ``demo`` with its fault switches)."""

    fleet: Fleet
    ext_url: str
    mcp: McpServer
    peer: McpPeer | None = None
    demo: McpServer | None = None

    def submit(self, call_node_id: str, tool: str, arguments: dict[str, Any], **extra: Any) -> uuid.UUID:
        """``longcall.submit`` on the extension server, with the approval gate as ``on_input``."""
        signature = dict(self.fleet.pipeline.signature("pipeline.record", queue="pipeline"))
        answer = self.fleet.send(
            "longcall.submit",
            call_node_id=call_node_id,
            server=EXT_SERVER,
            tool=tool,
            arguments=arguments,
            on_terminal=signature,
            on_input=signature,
            **extra,
        )
        return uuid.UUID(answer["op_id"])

    def server_status(self, remote_id: str) -> RemoteStatus:
        """The task as the extension server shows it now (read with the adapter, outside the fleet)."""
        config = AdapterConfig(
            name=EXT_SERVER, url=self.ext_url, protocol="mcp", protocol_version=EXT_VERSION
        )
        with httpx2.Client() as client:
            return default_registry().build(config, client).get(RemoteRef(remote_id, None, EXT_VERSION))


@contextmanager
def running_ext_fleet(
    parts: FleetParts,
    *,
    demo_flags: tuple[str, ...] | None = None,
    workers: int = 2,
    env: dict[str, str] | None = None,
) -> Iterator[ExtFleet]:
    """The extension server (the fastmcp-tasks peer; with ``demo_flags``, longcall's demo_server.mcp_ext)
    and an MCP 2025-11-25 server of this helper's own, a configuration naming both, then
    :func:`running_fleet` pointed at it (``LONGCALL_CONFIG``; as in aip_fleet, the MCP server
    ``running_fleet`` starts itself stays idle)."""
    with contextlib.ExitStack() as stack:
        peer: McpPeer | None = None
        demo: McpServer | None = None
        if demo_flags is None:
            peer = stack.enter_context(contextmanager(start_peer)(PEER, parts.log_dir))
            ext_url = peer.url
        else:
            demo = start_ext_demo_server(parts.log_dir, *demo_flags)
            stack.callback(demo.process.stop)
            ext_url = demo.url
        mcp = start_mcp_server(parts.log_dir)
        stack.callback(mcp.process.stop)
        config = parts.tmp_path / "longcall-ext.toml"
        config.write_text(fleet_config(mcp.url) + ext_config(ext_url))
        with running_fleet(
            parts, workers=workers, env={**(env or {}), "LONGCALL_CONFIG": str(config)}
        ) as fleet:
            yield ExtFleet(fleet, ext_url, mcp, peer=peer, demo=demo)
