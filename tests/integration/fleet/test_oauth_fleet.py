"""Issue 23, done when: an MCP server that accepts only OAuth client-credentials tokens (the official MCP
Python SDK's auth, in front of a real task server; an Authlib authorization server) serves a whole long call
to a real fleet (create, polls, an input round, a cancel, results), its tokens expiring every 4 s and one
status read refused with a 401, with one ``tools/call`` per call node, and no token nor the client's secret
in any log line, ledger row, event, metric or Redis key (all of them read back and searched)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest
import redis
from sqlalchemy import text

from ledger.states import OpState
from tests import support
from tests.conformance.oauth_peer import SCOPE, OAuthPeer
from tests.support.fleet import FleetParts
from tests.support.oauth_fleet import OAuthFleet, running_oauth_fleet

pytestmark = pytest.mark.slow


@pytest.fixture
def oauth_fleet(fleet_parts: FleetParts) -> Iterator[OAuthFleet]:
    with running_oauth_fleet(fleet_parts) as running:
        yield running


def redis_value(client: redis.Redis, key: bytes) -> object:
    """A key's value, whatever its type."""
    named = client.type(key)
    kind = named.decode() if isinstance(named, bytes) else str(named)
    reads: dict[str, Callable[[], object]] = {
        "string": lambda: client.get(key),
        "hash": lambda: client.hgetall(key),
        "list": lambda: client.lrange(key, 0, -1),
        "set": lambda: client.smembers(key),
        "zset": lambda: client.zrange(key, 0, -1, withscores=True),
        "stream": lambda: client.xrange(key),
    }
    assert kind in reads, f"{key!r} is a {kind}"
    return reads[kind]()


def everything_kept(oauth: OAuthFleet) -> dict[str, str]:
    """Every place a secret could end up, as text: the fleet's logs, every row of every ledger table, every
    Redis key of this fleet (its name and its value), and a scrape of ``longcall metrics``."""
    fleet = oauth.fleet
    places: dict[str, str] = {}
    for path in sorted(fleet.log_dir.rglob("*")):
        if path.is_file() and not path.name.startswith("oauth-"):  # the peers' own logs are not longcall's
            places[f"log {path.name}"] = path.read_text(errors="replace")
    with fleet.ledger.engine.begin() as conn:
        tables = conn.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
        ).scalars()
        for table in list(tables):
            rows = conn.execute(text(f'SELECT t::text FROM "{table}" t')).scalars()
            places[f"table {table}"] = "\n".join(rows)
    client = fleet.redis
    prefix = fleet.env["LONGCALL_BROKER_KEYPREFIX"]
    dumped = [
        f"{key!r} {redis_value(client, key)!r}" for key in client.scan_iter(match=f"{prefix}*", count=1000)
    ]
    places["redis"] = "\n".join(dumped)
    scrape = subprocess.run(
        [sys.executable, "-m", "console", "metrics", "--once"],
        env={**os.environ, **fleet.env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    places["metrics"] = scrape.stdout
    return places


@pytest.mark.timeout(240)
def test_a_whole_long_call_through_oauth_and_no_token_anywhere(oauth_fleet: OAuthFleet) -> None:
    peer, fleet = oauth_fleet.peer, oauth_fleet.fleet
    peer.set_token_lifetime(4)
    peer.token_unavailable(1)  # the first token request answers 503: nothing is sent, the create waits

    # A report of 6 s: its tokens renewed as they near their end, polled through.
    report = oauth_fleet.submit("n/oauth-report", "slow_report", {"seconds": 6})
    # One status read refused with a 401: the token renewed once, the read made again.
    peer.fail_once("tasks/get")
    oauth_fleet.submit("n/oauth-401", "slow_report", {"seconds": 2})
    # An input round: the approval gate answers through longcall.provide_input.
    oauth_fleet.submit("n/oauth-input", "ask_approval", {"question": "Ship?"})
    [request] = support.wait_for("the input request", lambda: fleet.input_requests() or None, timeout=60)
    fleet.send(
        "longcall.provide_input",
        op_id=request["op_id"],
        input_round=request["input_round"],
        response={"action": "accept", "content": {"approved": True}},
    )
    # A cancel of a long one once it works.
    op_id = oauth_fleet.submit("n/oauth-cancel", "slow_report", {"seconds": 60})
    fleet.wait_state(op_id, OpState.WORKING, timeout=60)
    fleet.send("longcall.cancel", op_id=str(op_id))

    expected = {
        "n/oauth-report": "completed",
        "n/oauth-401": "completed",
        "n/oauth-input": "completed",
        "n/oauth-cancel": "cancelled",
    }
    for node, terminal in expected.items():
        receipt = fleet.wait_receipt(node, timeout=90)
        assert receipt["terminal_state"] == terminal, receipt
    assert sorted(r["call_node_id"] for r in fleet.receipts()) == sorted(expected)  # one receipt each
    # The token endpoint's 503 is why the first step waited (its event's error, longcall status's last
    # error), and it held nothing for the server's other requests (no "asked for a wait" line).
    errors = [str((e["detail"] or {}).get("error", "")) for e in fleet.ledger.events(report)]
    said = [e for e in errors if "not sent: the bearer token could not be read" in e]
    assert said, errors
    assert "HTTP 503" in said[0]
    logs = "".join(p.log() for p in fleet.processes if p.name.startswith("longcall"))
    assert "secured asked for a" not in logs
    approval = fleet.wait_receipt("n/oauth-input")["result"]
    assert approval["content"][0]["text"] == "approved"

    # One tools/call per call node; one 401 on the wire (the armed one), every other request authorized.
    served = peer.rs_log()
    assert sum(1 for e in served if e.get("method") == "tools/call" and e["status"] == 200) == len(expected)
    assert [e["method"] for e in served if e["status"] == 401] == ["tasks/get"], served
    issued = peer.issued_tokens()
    assert len(issued) >= 3, issued  # 4 s tokens over the run, and the one the 401 replaced

    # No token, no secret: not in a log line, a ledger row, an event, a Redis key or value, a metric.
    secrets = [*issued, oauth_fleet.secret]
    fleet.redis.hset(f"{fleet.env['LONGCALL_BROKER_KEYPREFIX']}canary", "field", "canary-value")
    places = everything_kept(oauth_fleet)
    # Each place was read (what is known to be there is found there).
    logs = "".join(body for name, body in places.items() if name.startswith("log longcall"))
    assert str(op_id) in logs
    assert "n/oauth-cancel" in places["table tool_operation"]
    assert (
        "stale_write_rejected" in places["table operation_event"]
        or "created" in places["table operation_event"]
    )
    assert "canary-value" in places["redis"]
    assert 'longcall_token_requests_total{outcome="ok",server="secured"}' in places["metrics"]
    assert 'longcall_token_requests_total{outcome="server_error",server="secured"} 1.0' in places["metrics"]
    leaks = [
        (name, secret[:6] + "...") for name, body in places.items() for secret in secrets if secret in body
    ]
    assert leaks == []


def a_token_for(peer: OAuthPeer, client_id: str) -> str:
    """A token asked of the authorization server directly (client_secret_post), for the static server."""
    client = peer.clients[client_id]
    answer = httpx2.post(
        peer.token_url,
        data={
            "grant_type": "client_credentials",
            "client_id": client_id,
            "client_secret": client.secret or "",
            "resource": peer.resource,
            "scope": SCOPE,
        },
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    token: str = answer.json()["access_token"]
    return token


@pytest.mark.timeout(240)
def test_a_refused_credential_holds_the_call_before_any_create_until_it_is_put_right(
    fleet_parts: FleetParts,
) -> None:
    """A static bearer token the server refuses (401 to the handshake): no tools/call, no receipt, the call
    asked again after a growing pause (1, 2, 4 s...), the reason on its events; once the token file holds a
    good token, the same operation goes on to its one create and its receipt."""
    token_file = fleet_parts.tmp_path / "static-token"
    token_file.write_text("not-a-token-the-server-knows")

    def static(peer: OAuthPeer) -> str:
        return (
            '[servers.static]\nprotocol = "mcp"\nprotocol_version = "2025-11-25"\n'
            f'url = "{peer.mcp_url}"\nauth_file = "{token_file}"\npoll_qps = 50\ncontrol_qps = 50\n'
        )

    with running_oauth_fleet(fleet_parts, extra=static) as oauth:
        fleet, peer = oauth.fleet, oauth.peer
        op_id = oauth.submit("n/static", "slow_report", {"seconds": 1}, server="static")

        def refusals() -> list[dict[str, Any]]:
            return [
                e
                for e in fleet.ledger.events(op_id)
                if str((e["detail"] or {}).get("error", "")).startswith("Unauthorized: HTTP 401")
            ]

        support.wait_for("three refusals of the credential", lambda: len(refusals()) >= 3, timeout=60)
        gaps = [(b["at"] - a["at"]).total_seconds() for a, b in zip(refusals(), refusals()[1:], strict=False)]
        assert gaps[1] > 1.5 * gaps[0], gaps  # the pause grows (2 s, then 4 s)
        assert fleet.receipts() == []
        assert not [e for e in peer.rs_log() if e.get("method") == "tools/call"]
        assert fleet.ledger.get(op_id).state is OpState.SUBMITTING

        token_file.write_text(a_token_for(peer, "basic"))
        receipt = fleet.wait_receipt("n/static", timeout=60)
        assert receipt["terminal_state"] == "completed"
        assert sum(1 for e in peer.rs_log() if e.get("method") == "tools/call") == 1
