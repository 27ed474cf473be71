"""The OAuth peers behave per spec (raw httpx2): discovery, three client auth methods, expiry, revocation,
RFC 8707 targets and the test switches. longcall's own OAuth client is tested elsewhere against them."""

from __future__ import annotations

import base64
import json
import re
import time
from typing import Any

import httpx2
import pytest

from tests.conformance.oauth_peer import JWT_BEARER, OAuthPeer, client_assertion

pytestmark = pytest.mark.conformance

PROTOCOL = "2025-11-25"
EXPIRY_WAIT_S = 10.0  # a 2 s token must be refused well within this
POLL_INTERVAL_S = 0.2


def _challenge(response: httpx2.Response) -> dict[str, str]:
    """The auth-params of a `WWW-Authenticate: Bearer k="v", ...` header."""
    header = response.headers["www-authenticate"]
    assert header.startswith("Bearer "), header
    return dict(re.findall(r'(\w+)="([^"]*)"', header))


def _token_request(peer: OAuthPeer, client_id: str, **form: str) -> httpx2.Response:
    """A client_credentials request, authenticated the way the client's id says."""
    client = peer.clients[client_id]
    data = {"grant_type": "client_credentials", **form}
    headers: dict[str, str] = {}
    if client.private_key is not None:
        data |= {
            "client_assertion_type": JWT_BEARER,
            "client_assertion": client_assertion(client, peer.token_url),
        }
    elif client_id == "post":
        assert client.secret is not None
        data |= {"client_id": client_id, "client_secret": client.secret}
    else:
        assert client.secret is not None
        basic = base64.b64encode(f"{client_id}:{client.secret}".encode()).decode()
        headers["Authorization"] = f"Basic {basic}"
    with httpx2.Client(timeout=5.0) as http:
        return http.post(peer.token_url, data=data, headers=headers)


def _token(peer: OAuthPeer, client_id: str) -> str:
    response = _token_request(peer, client_id, resource=peer.resource, scope="reports")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["token_type"] == "Bearer"
    assert body["scope"] == "reports"
    assert isinstance(body["expires_in"], int)
    assert response.headers["cache-control"] == "no-store"
    token: str = body["access_token"]
    return token


def _messages(response: httpx2.Response) -> list[dict[str, Any]]:
    if response.headers.get("content-type", "").startswith("application/json"):
        body = response.json()
        return body if isinstance(body, list) else [body]
    messages = []
    for event in response.text.replace("\r\n", "\n").split("\n\n"):
        data = [line.removeprefix("data:").lstrip() for line in event.split("\n") if line.startswith("data:")]
        if data:
            messages.append(json.loads("\n".join(data)))
    return messages


def _initialize(http: httpx2.Client, peer: OAuthPeer, token: str | None) -> httpx2.Response:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": PROTOCOL,
            "capabilities": {"elicitation": {"form": {}}, "tasks": {"list": {}, "cancel": {}}},
            "clientInfo": {"name": "longcall-oauth-smoke", "version": "0"},
        },
    }
    return http.post(peer.mcp_url, headers=headers, json=request)


def _session(http: httpx2.Client, peer: OAuthPeer, token: str) -> dict[str, str]:
    """initialize + notifications/initialized; the headers for the session's next requests."""
    response = _initialize(http, peer, token)
    assert response.status_code == 200, response.text
    assert _messages(response)[0]["result"]["protocolVersion"] == PROTOCOL
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {token}",
        "Mcp-Session-Id": response.headers["mcp-session-id"],
        "MCP-Protocol-Version": PROTOCOL,
    }
    initialized = http.post(
        peer.mcp_url, headers=headers, json={"jsonrpc": "2.0", "method": "notifications/initialized"}
    )
    assert initialized.status_code == 202
    return headers


def _call(
    http: httpx2.Client,
    peer: OAuthPeer,
    headers: dict[str, str],
    request_id: int,
    method: str,
    params: dict[str, Any] | None = None,
) -> httpx2.Response:
    request: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        request["params"] = params
    return http.post(peer.mcp_url, headers=headers, json=request)


def test_discovery_without_a_token(oauth_peer: OAuthPeer) -> None:
    with httpx2.Client(timeout=5.0) as http:
        refused = _initialize(http, oauth_peer, None)
        assert refused.status_code == 401
        challenge = _challenge(refused)
        metadata_url = challenge["resource_metadata"]
        # RFC 9728 §3.1: the well-known segment goes between the host and the resource's path.
        assert metadata_url == oauth_peer.resource.replace(
            "/mcp", "/.well-known/oauth-protected-resource/mcp"
        )
        # The SDK says invalid_token even when no token came at all (RFC 6750 §3.1: no error code then).
        assert challenge["error"] == "invalid_token"

        resource_metadata = http.get(metadata_url)
        assert resource_metadata.status_code == 200
        document = resource_metadata.json()
        assert document["resource"] == oauth_peer.resource
        # The SDK's pydantic AnyHttpUrl adds a "/" to a path-less issuer (not the AS's issuer string).
        assert document["authorization_servers"] == [f"{oauth_peer.issuer}/"]
        assert document["bearer_methods_supported"] == ["header"]

        as_metadata = http.get(f"{oauth_peer.issuer}/.well-known/oauth-authorization-server")
        assert as_metadata.status_code == 200
        server = as_metadata.json()
    assert server["issuer"] == oauth_peer.issuer
    assert server["token_endpoint"] == oauth_peer.token_url
    assert set(server["token_endpoint_auth_methods_supported"]) == {
        "client_secret_basic",
        "client_secret_post",
        "private_key_jwt",
    }
    assert set(server["token_endpoint_auth_signing_alg_values_supported"]) == {"RS256", "ES256"}
    assert server["grant_types_supported"] == ["client_credentials"]
    assert server["introspection_endpoint"] == f"{oauth_peer.issuer}/introspect"


@pytest.mark.parametrize(
    ("client_id", "method"),
    [
        ("basic", "client_secret_basic"),
        ("post", "client_secret_post"),
        ("jwt-rsa", "private_key_jwt"),
        ("jwt-ec", "private_key_jwt"),
    ],
)
def test_each_auth_method_gets_a_token_the_server_takes(
    oauth_peer: OAuthPeer, client_id: str, method: str
) -> None:
    token = _token(oauth_peer, client_id)
    with httpx2.Client(timeout=10.0) as http:
        headers = _session(http, oauth_peer, token)
        listed = _call(http, oauth_peer, headers, 2, "tools/list")
    assert listed.status_code == 200, listed.text
    tools = {tool["name"] for tool in _messages(listed)[0]["result"]["tools"]}
    assert {"slow_report", "quick_lookup", "ask_approval"} <= tools

    (entry,) = oauth_peer.token_log()
    assert (entry["client_id"], entry["auth_method"], entry["outcome"]) == (client_id, method, "issued")
    assert entry["resource"] == [oauth_peer.resource]
    secret = oauth_peer.clients[client_id].secret
    logged = json.dumps(oauth_peer.token_log())
    assert token not in logged
    assert secret is None or secret not in logged
    assert "client_assertion" not in logged


def test_a_replayed_client_assertion_is_refused(oauth_peer: OAuthPeer) -> None:
    client = oauth_peer.clients["jwt-ec"]
    assertion = client_assertion(client, oauth_peer.issuer)  # the issuer is an accepted aud as well
    form = {
        "grant_type": "client_credentials",
        "resource": oauth_peer.resource,
        "client_assertion_type": JWT_BEARER,
        "client_assertion": assertion,
    }
    with httpx2.Client(timeout=5.0) as http:
        first = http.post(oauth_peer.token_url, data=form)
        again = http.post(oauth_peer.token_url, data=form)
    assert first.status_code == 200, first.text
    assert again.status_code in (400, 401)
    assert again.json()["error"] == "invalid_client"


def test_an_expired_token_is_invalid_token(oauth_peer: OAuthPeer) -> None:
    oauth_peer.set_token_lifetime(2)
    token = _token(oauth_peer, "basic")
    issued = time.monotonic()
    with httpx2.Client(timeout=5.0) as http:
        assert _initialize(http, oauth_peer, token).status_code == 200
        while (refused := _initialize(http, oauth_peer, token)).status_code == 200:
            assert time.monotonic() - issued < EXPIRY_WAIT_S, "a 2 s token still accepted"
            time.sleep(POLL_INTERVAL_S)  # a bounded poll for the expiry, not a wait for a result
    assert time.monotonic() - issued >= 1.0
    assert refused.status_code == 401
    assert _challenge(refused)["error"] == "invalid_token"


def test_a_revoked_client_gets_no_token_and_its_token_stops_working(oauth_peer: OAuthPeer) -> None:
    token = _token(oauth_peer, "revocable")
    with httpx2.Client(timeout=5.0) as http:
        assert _initialize(http, oauth_peer, token).status_code == 200
        oauth_peer.revoke_client("revocable")
        refused = _initialize(http, oauth_peer, token)
    assert refused.status_code == 401
    assert _challenge(refused)["error"] == "invalid_token"
    again = _token_request(oauth_peer, "revocable", resource=oauth_peer.resource)
    assert again.status_code == 401
    assert again.json()["error"] == "invalid_client"
    assert oauth_peer.token_log()[-1]["outcome"] == "invalid_client"


def test_a_resource_the_server_does_not_serve_is_invalid_target(oauth_peer: OAuthPeer) -> None:
    wrong = _token_request(oauth_peer, "basic", resource="http://127.0.0.1:1/elsewhere")
    assert wrong.status_code == 400
    assert wrong.json()["error"] == "invalid_target"
    # A token with no resource at all has no audience: the RS (validate_token_resource) refuses it.
    unbound = _token_request(oauth_peer, "basic")
    assert unbound.status_code == 200, unbound.text
    with httpx2.Client(timeout=5.0) as http:
        refused = _initialize(http, oauth_peer, unbound.json()["access_token"])
    assert refused.status_code == 401


def test_switches_token_503_and_a_401_on_one_method(oauth_peer: OAuthPeer) -> None:
    oauth_peer.token_unavailable(1)
    unavailable = _token_request(oauth_peer, "basic", resource=oauth_peer.resource)
    assert unavailable.status_code == 503
    token = _token(oauth_peer, "basic")

    oauth_peer.fail_once("tools/list")
    with httpx2.Client(timeout=10.0) as http:
        headers = _session(http, oauth_peer, token)
        refused = _call(http, oauth_peer, headers, 2, "tools/list")
        listed = _call(http, oauth_peer, headers, 3, "tools/list")
    assert refused.status_code == 401
    assert _challenge(refused)["error"] == "invalid_token"
    assert listed.status_code == 200, listed.text
    assert [entry["status"] for entry in oauth_peer.rs_log() if entry["method"] == "tools/list"] == [401, 200]
    assert [entry["status"] for entry in oauth_peer.token_log()] == [503, 200]
