"""A whole fleet beside an MCP server that accepts only OAuth client-credentials tokens (issue 23): the real
peers of tests/conformance/oauth_peer.py (an Authlib authorization server, the official MCP Python SDK as
the resource server), a configuration naming the resource server as ``secured`` with ``[auth] kind =
"oauth_client_credentials"`` (the client's id and secret in the workers' environment, by name), longcall
workers and beat, and the pipeline worker (on :mod:`tests.support.fleet`, unchanged)."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests.conformance.oauth_peer import SCOPE, OAuthPeer, start_oauth_peer
from tests.support.fleet import Fleet, FleetParts, fleet_config, running_fleet

#: The protected server's name in the configuration.
SECURED = "secured"
CLIENT_ID_ENV = "SECURED_CLIENT_ID"
CLIENT_SECRET_ENV = "SECURED_CLIENT_SECRET"


def secured_config(url: str, **server: Any) -> str:
    values = {"poll_qps": 50, "control_qps": 50, "default_poll_interval_ms": 200, **server}
    lines = [
        f"[servers.{SECURED}]",
        'protocol = "mcp"',
        'protocol_version = "2025-11-25"',
        f'url = "{url}"',
        *(f"{k} = {json.dumps(v)}" for k, v in values.items()),
        f"[servers.{SECURED}.auth]",
        'kind = "oauth_client_credentials"',
        f'client_id_env = "{CLIENT_ID_ENV}"',
        f'client_secret_env = "{CLIENT_SECRET_ENV}"',
        f'scope = "{SCOPE}"',
    ]
    return "\n".join(lines) + "\n"


@dataclass
class OAuthFleet:
    fleet: Fleet
    peer: OAuthPeer
    client_id: str
    secret: str

    def submit(
        self, call_node_id: str, tool: str, arguments: dict[str, Any], *, server: str = SECURED, **extra: Any
    ) -> uuid.UUID:
        """``longcall.submit`` on the protected server, the pipeline's record task as ``on_terminal`` and
        ``on_input``."""
        signature = dict(self.fleet.pipeline.signature("pipeline.record", queue="pipeline"))
        answer = self.fleet.send(
            "longcall.submit",
            call_node_id=call_node_id,
            server=server,
            tool=tool,
            arguments=arguments,
            on_terminal=signature,
            on_input=signature,
            **extra,
        )
        return uuid.UUID(answer["op_id"])


@contextmanager
def running_oauth_fleet(
    parts: FleetParts,
    *,
    client_id: str = "basic",
    workers: int = 2,
    extra: Callable[[OAuthPeer], str] | None = None,
) -> Iterator[OAuthFleet]:
    """The OAuth peers, a configuration naming longcall's own MCP server (``reports``) and the protected one
    (``secured``), then :func:`running_fleet` pointed at it (as in ext_fleet, the MCP server it starts
    itself is ``reports``). ``extra``: more of the configuration, made knowing the peers' URLs."""
    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(contextmanager(start_oauth_peer)(parts.log_dir))
        secret = peer.clients[client_id].secret
        assert secret is not None, f"client {client_id!r} has no secret"
        config = parts.tmp_path / "longcall-oauth.toml"
        more = extra(peer) if extra is not None else ""
        config.write_text(fleet_config("http://127.0.0.1:9/mcp") + secured_config(peer.mcp_url) + more)
        env = {"LONGCALL_CONFIG": str(config), CLIENT_ID_ENV: client_id, CLIENT_SECRET_ENV: secret}
        with running_fleet(parts, workers=workers, env=env) as fleet:
            yield OAuthFleet(fleet, peer, client_id, secret)
