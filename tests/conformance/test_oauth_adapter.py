"""longcall's OAuth client against the real peers (issue 23): the official MCP Python SDK as the protected
resource (token verification by introspection) and an Authlib authorization server. The MCP 2025-11-25
adapter, given a client credentials token provider, runs whole tasks with each client authentication
method; a token that expires in the middle of a call is renewed before it does; a 401 to one status read
renews the token once; a revoked client and a token endpoint that is down send nothing to the server, with
the reason. Every wait is bounded."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx2
import pytest
from cryptography.hazmat.primitives import serialization

from adapters import (
    AdapterConfig,
    ClientCredentials,
    ClientCredentialsToken,
    InputRequest,
    McpTasksAdapter,
    NotSent,
    RemoteRef,
    RemoteStatus,
    Timeouts,
    TokenRenewed,
)
from tests.conformance.oauth_peer import SCOPE, OAuthClient, OAuthPeer

pytestmark = pytest.mark.conformance

WAIT_S = 30.0
TTL_MS = 120_000
Connect = Callable[..., tuple[McpTasksAdapter, ClientCredentialsToken]]


def credentials_of(client: OAuthClient) -> ClientCredentials:
    if client.private_key is None:
        return ClientCredentials(client.client_id, secret=client.secret, scope=SCOPE)
    pem = client.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ClientCredentials(client.client_id, private_key_pem=pem, key_id=client.client_id, scope=SCOPE)


@pytest.fixture
def connect(oauth_peer: OAuthPeer) -> Iterator[Connect]:
    """An adapter on the resource server whose bearer token comes from a client credentials provider that
    discovers the authorization server from the resource (no token_url)."""
    clients: list[httpx2.Client] = []

    def build(
        client_id: str = "basic", *, method: str | None = None
    ) -> tuple[McpTasksAdapter, ClientCredentialsToken]:
        credentials = credentials_of(oauth_peer.clients[client_id])
        if method is not None:
            credentials = ClientCredentials(
                credentials.client_id,
                secret=credentials.secret,
                scope=SCOPE,
                method=method,  # type: ignore[arg-type]
            )
        token_client, mcp_client = httpx2.Client(timeout=5.0), httpx2.Client()
        clients.extend((token_client, mcp_client))
        tokens = ClientCredentialsToken(lambda: credentials, oauth_peer.resource, client=token_client)
        config = AdapterConfig(
            name="secured",
            url=oauth_peer.mcp_url,
            protocol="mcp",
            protocol_version="2025-11-25",
            token_provider=tokens,
            timeouts=Timeouts(connect=5.0, read=20.0, write=5.0, pool=5.0, input_wait=3.0),
        )
        return McpTasksAdapter(config, mcp_client), tokens

    yield build
    for client in clients:
        client.close()


def until(
    adapter: McpTasksAdapter,
    ref: RemoteRef,
    done: Callable[[RemoteStatus], bool],
    *,
    read_input: bool = False,
) -> RemoteStatus:
    deadline = time.monotonic() + WAIT_S
    while True:
        status = adapter.get(ref, read_input=read_input)
        if done(status):
            return status
        assert time.monotonic() < deadline, f"task {ref.remote_id} still {status.server_state}"
        time.sleep(min((status.poll_interval_ms or 200) / 1000, 0.3))


def text_of(adapter: McpTasksAdapter, ref: RemoteRef, status: RemoteStatus) -> str:
    result = adapter.result(ref, status=status)
    assert result.outcome == "completed", result
    content = result.payload["content"]
    return "".join(block["text"] for block in content if block.get("type") == "text")


@pytest.mark.parametrize(
    ("client_id", "method"),
    [("basic", None), ("post", "client_secret_post"), ("jwt-rsa", None), ("jwt-ec", None)],
)
def test_a_whole_task_with_each_client_authentication(
    connect: Connect, oauth_peer: OAuthPeer, client_id: str, method: str | None
) -> None:
    adapter, tokens = connect(client_id, method=method)
    created = adapter.create("slow_report", {"seconds": 1}, submission_key=f"k-{client_id}", ttl_ms=TTL_MS)
    assert created.ref is not None
    final = until(adapter, created.ref, lambda s: s.terminal is not None)
    assert final.server_state == "completed"
    assert "report" in text_of(adapter, created.ref, final)
    # One token for the whole task, asked with the method named, for this resource.
    granted = [e for e in oauth_peer.token_log() if e.get("outcome") == "issued"]
    assert len(granted) == 1, oauth_peer.token_log()
    assert granted[0]["client_id"] == client_id
    expected = method or ("private_key_jwt" if client_id.startswith("jwt") else "client_secret_basic")
    assert granted[0]["auth_method"] == expected
    assert granted[0]["resource"] == [oauth_peer.resource]
    assert tokens.requests == 1
    assert all(e["status"] != 401 for e in oauth_peer.rs_log()), oauth_peer.rs_log()


def test_a_token_that_expires_in_the_middle_of_a_call_is_renewed_before_it_does(
    connect: Connect, oauth_peer: OAuthPeer
) -> None:
    oauth_peer.set_token_lifetime(2)
    adapter, tokens = connect()
    created = adapter.create("slow_report", {"seconds": 5}, submission_key="k-expiry", ttl_ms=TTL_MS)
    assert created.ref is not None
    final = until(adapter, created.ref, lambda s: s.terminal is not None)
    assert final.server_state == "completed"
    assert tokens.requests >= 3  # a 2 s token, renewed with 1 s left, over a call of 5 s and more
    assert all(e["status"] != 401 for e in oauth_peer.rs_log()), oauth_peer.rs_log()


def test_a_401_to_a_status_read_renews_the_token_once_and_the_next_read_succeeds(
    connect: Connect, oauth_peer: OAuthPeer
) -> None:
    adapter, tokens = connect()
    created = adapter.create("slow_report", {"seconds": 3}, submission_key="k-401", ttl_ms=TTL_MS)
    assert created.ref is not None
    oauth_peer.fail_once("tasks/get")
    with pytest.raises(TokenRenewed):
        adapter.get(created.ref)  # no work done: the step reads again (charged again)
    status = adapter.get(created.ref)
    assert status.server_state in ("working", "completed")
    assert tokens.requests == 2
    refused = [e for e in oauth_peer.rs_log() if e["status"] == 401]
    assert len(refused) == 1, oauth_peer.rs_log()


def test_a_revoked_client_sends_nothing_more_and_says_why(connect: Connect, oauth_peer: OAuthPeer) -> None:
    adapter, tokens = connect("revocable")
    created = adapter.create("slow_report", {"seconds": 30}, submission_key="k-revoked", ttl_ms=TTL_MS)
    assert created.ref is not None
    oauth_peer.revoke_client("revocable")
    with pytest.raises(TokenRenewed):
        adapter.get(created.ref)  # its token stopped introspecting as active: renewed once...
    sent = len(oauth_peer.rs_log())
    with pytest.raises(NotSent, match="invalid_client") as refused:
        adapter.get(created.ref)  # ...and the new one is refused: nothing is sent to the server
    assert refused.value.retry_after is not None
    assert refused.value.retry_after > 0
    assert len(oauth_peer.rs_log()) == sent
    with pytest.raises(NotSent, match="asked again in"):
        adapter.get(created.ref)  # within the backoff: not even the token endpoint is asked
    assert tokens.failed == 1


def test_a_token_endpoint_that_is_down_sends_nothing_to_the_server(
    connect: Connect, oauth_peer: OAuthPeer
) -> None:
    oauth_peer.token_unavailable(1)
    adapter, tokens = connect()
    with pytest.raises(NotSent, match="HTTP 503"):
        adapter.create("slow_report", {"seconds": 1}, submission_key="k-down", ttl_ms=TTL_MS)
    assert [e for e in oauth_peer.rs_log() if e.get("method") == "tools/call"] == []
    time.sleep(1.1)  # the backoff's first second, then it is asked again
    created = adapter.create("slow_report", {"seconds": 1}, submission_key="k-down", ttl_ms=TTL_MS)
    assert created.ref is not None
    assert (tokens.requests, tokens.failed) == (2, 1)


def test_an_input_round_over_oauth(connect: Connect) -> None:
    adapter, _ = connect()
    created = adapter.create("ask_approval", {"question": "Ship?"}, submission_key="k-input", ttl_ms=TTL_MS)
    assert created.ref is not None
    ref = created.ref
    status = until(
        adapter, ref, lambda s: s.input_request is not None or s.terminal is not None, read_input=True
    )
    request = status.input_request
    assert request is not None, status
    stored = InputRequest.from_json(json.loads(json.dumps(request.to_json())))
    other_worker, _ = connect()
    other_worker.reply_input(ref, stored, {"action": "accept", "content": {"approved": True}})
    final = until(other_worker, ref, lambda s: s.terminal is not None)
    assert text_of(other_worker, ref, final) == "approved"
