"""A whole fleet with an MCP tasks extension (2026-07-28) server beside the 2025-11-25 one: the real
FastMCP 4.1.4 + fastmcp-tasks 4.1.4 peer (``tasks_ext``, tests/conformance/peers/fastmcp_ext_tasks.py)
and longcall's MCP server (``reports``) in one configuration, longcall workers and beat, and the pipeline
worker. Real processes, real Postgres, Redis and broker (on :mod:`tests.integration.fleet`, unchanged)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from adapters import AdapterConfig, RemoteRef, RemoteStatus, default_registry
from tests.conformance.conftest import McpPeer, start_peer
from tests.conformance.test_mcp_ext_adapter import PEER
from tests.integration.fleet import (
    Fleet,
    FleetParts,
    McpServer,
    fleet_config,
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


@dataclass
class ExtFleet:
    """A running fleet with ``reports`` (MCP 2025-11-25, longcall's server) and ``tasks_ext`` (MCP
    2026-07-28 with the tasks extension, the fastmcp-tasks peer)."""

    fleet: Fleet
    peer: McpPeer
    mcp: McpServer

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
        """The task as the peer shows it now (read with the adapter, outside the fleet)."""
        config = AdapterConfig(
            name=EXT_SERVER, url=self.peer.url, protocol="mcp", protocol_version=EXT_VERSION
        )
        with httpx.Client() as client:
            return default_registry().build(config, client).get(RemoteRef(remote_id, None, EXT_VERSION))


@contextmanager
def running_ext_fleet(
    parts: FleetParts, *, workers: int = 2, env: dict[str, str] | None = None
) -> Iterator[ExtFleet]:
    """The fastmcp-tasks peer and an MCP server of this helper's own, a configuration naming both, then
    :func:`running_fleet` pointed at it (``LONGCALL_CONFIG``; as in aip_fleet, the MCP server
    ``running_fleet`` starts itself stays idle)."""
    with contextmanager(start_peer)(PEER, parts.log_dir) as peer:
        mcp = start_mcp_server(parts.log_dir)
        try:
            config = parts.tmp_path / "longcall-ext.toml"
            config.write_text(fleet_config(mcp.url) + ext_config(peer.url))
            with running_fleet(
                parts, workers=workers, env={**(env or {}), "LONGCALL_CONFIG": str(config)}
            ) as fleet:
                yield ExtFleet(fleet, peer, mcp)
        finally:
            mcp.process.stop()
