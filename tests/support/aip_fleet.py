"""A whole fleet with an AIP-151 server beside the MCP one: longcall's demo AIP-151 server (``exports``,
tool ``run_report``) and its MCP server (``reports``) in one configuration, longcall workers and beat, and
the pipeline worker. Real processes, real Postgres, Redis and broker (on :mod:`tests.support.fleet`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests import support
from tests.support.aip_server import AipServer, start_aip_server
from tests.support.fleet import (
    Fleet,
    FleetParts,
    McpServer,
    fleet_config,
    running_fleet,
    start_mcp_server,
)

#: The AIP-151 server's name in the configuration, and its one tool.
AIP_SERVER = "exports"
AIP_TOOL = "run_report"
AIP_CREATE = "POST /v1/projects/{project}/reports:run"


def aip_config(url: str, **server: Any) -> str:
    """The ``exports`` server's TOML: the demo AIP-151 server, its tool ``run_report``."""
    values = {"poll_qps": 50, "control_qps": 50, "default_poll_interval_ms": 200, **server}
    lines = [
        f"[servers.{AIP_SERVER}]",
        'protocol = "aip151"',
        'protocol_version = "v1"',
        f'url = "{url}"',
        *(f"{k} = {json.dumps(v)}" for k, v in values.items()),
        f"[servers.{AIP_SERVER}.tools.{AIP_TOOL}]",
        f'create = "{AIP_CREATE}"',
        'request_id_field = "requestId"',
    ]
    return "\n".join(lines) + "\n"


@dataclass
class AipFleet:
    """A running fleet with the MCP server ``reports`` and the AIP-151 server ``exports`` configured side
    by side. ``mcp`` is the MCP server the configuration names (see :func:`running_aip_fleet`)."""

    fleet: Fleet
    aip: AipServer
    mcp: McpServer

    def submit(self, call_node_id: str, arguments: dict[str, Any], **extra: Any) -> uuid.UUID:
        """``longcall.submit`` of ``run_report`` on the AIP-151 server, as a pipeline sends it."""
        on_terminal = dict(self.fleet.pipeline.signature("pipeline.record", queue="pipeline"))
        answer = self.fleet.send(
            "longcall.submit",
            call_node_id=call_node_id,
            server=AIP_SERVER,
            tool=AIP_TOOL,
            arguments=arguments,
            on_terminal=on_terminal,
            **extra,
        )
        return uuid.UUID(answer["op_id"])

    def operations(self) -> list[dict[str, Any]]:
        """Every operation the AIP-151 server holds (expired and deleted ones are listed by name apart)."""
        ops: list[dict[str, Any]] = self.aip.operations()["operations"]
        return ops

    def requests(self, rpc: str | None = None) -> list[dict[str, Any]]:
        """The AIP-151 server's request log (of one RPC: RunReport, GetOperation, CancelOperation, ...)."""
        return [e for e in self.aip.log() if rpc is None or e["rpc"] == rpc]

    def server_operation(self, name: str) -> dict[str, Any]:
        return next(o for o in self.operations() if o["name"] == name)


def args(seconds: float = 0.3, outcome: str = "response", project: str = "demo") -> dict[str, Any]:
    """``run_report``'s arguments: ``project`` fills the create path, the rest is the body."""
    return {"project": project, "seconds": seconds, "outcome": outcome}


@contextmanager
def running_aip_fleet(
    parts: FleetParts,
    *,
    aip_flags: tuple[str, ...] = (),
    exports: dict[str, Any] | None = None,
    workers: int = 2,
    env: dict[str, str] | None = None,
) -> Iterator[AipFleet]:
    """The demo AIP-151 server and an MCP server of this helper's own, a configuration naming both
    (``reports``: the MCP server as in every fleet; ``exports``: the AIP-151 one, ``exports`` overriding
    its keys), then :func:`running_fleet` pointed at that configuration (``LONGCALL_CONFIG``). The MCP
    server ``running_fleet`` starts itself stays idle: its URL is known only once it runs, after the
    configuration must be written."""
    aip = start_aip_server(parts.log_dir, *aip_flags)
    mcp = start_mcp_server(parts.log_dir)
    try:
        config = parts.tmp_path / "longcall-aip.toml"
        config.write_text(fleet_config(mcp.url) + aip_config(aip.root, **(exports or {})))
        with running_fleet(
            parts, workers=workers, env={**(env or {}), "LONGCALL_CONFIG": str(config)}
        ) as fleet:
            yield AipFleet(fleet, aip, mcp)
    finally:
        support.stop_all([mcp.process, aip.process], timeout=10)
