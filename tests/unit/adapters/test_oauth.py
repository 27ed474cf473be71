"""The client credentials token provider (issue 23) against a faithful in-process authorization server and
protected resource (httpx2's mock transport): discovery in the spec's order and its refusals, the token
cached and renewed before it expires, one request at a time with a backoff after failures, a 401 renewed
once, and a signed client assertion a verifier accepts. The same against the real peers is in
tests/conformance."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import httpx2
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa, utils

from adapters.credentials import Credentials
from adapters.errors import NotSent, TokenRenewed, Unauthorized
from adapters.oauth import (
    ClientCredentials,
    ClientCredentialsToken,
    DiscoveryRefused,
    TokenUnavailable,
    challenge_params,
    client_assertion,
    discover,
)

RESOURCE = "http://127.0.0.1:8765/mcp"
ISSUER = "http://127.0.0.1:9000"
TOKEN_URL = f"{ISSUER}/token"
SECRET = "s3cret-xyz"


@dataclass
class Server:
    """A protected resource's metadata and an authorization server, as the RFCs lay them out."""

    resource: str = RESOURCE
    issuer: str = ISSUER
    metadata_at_path: bool = True
    methods: tuple[str, ...] = ("client_secret_basic", "client_secret_post", "private_key_jwt")
    lifetime_s: int | None = 3600
    down: int = 0
    refuse: bool = False
    delay_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    gets: list[str] = field(default_factory=list)
    issued: int = 0

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        url = str(request.url)
        if request.method == "GET":
            self.gets.append(url)
            prm = "/.well-known/oauth-protected-resource" + ("/mcp" if self.metadata_at_path else "")
            if request.url.path == prm:
                return httpx2.Response(
                    200, json={"resource": self.resource, "authorization_servers": [ISSUER]}
                )
            if request.url.path == "/.well-known/oauth-authorization-server":
                methods = list(self.methods)
                document = {"issuer": self.issuer, "token_endpoint": TOKEN_URL}
                return httpx2.Response(
                    200, json={**document, "token_endpoint_auth_methods_supported": methods}
                )
            return httpx2.Response(404)
        assert url == TOKEN_URL
        form = {k: v[0] for k, v in parse_qs(request.content.decode()).items()}
        authorization = request.headers.get("authorization", "")
        self.requests.append({"form": form, "authorization": authorization})
        time.sleep(self.delay_s)
        if self.down:
            self.down -= 1
            return httpx2.Response(503, text="unavailable")
        if self.refuse:
            return httpx2.Response(401, json={"error": "invalid_client", "error_description": "revoked"})
        self.issued += 1
        answer: dict[str, Any] = {"access_token": f"tok-{self.issued}", "token_type": "Bearer"}
        if self.lifetime_s is not None:
            answer["expires_in"] = self.lifetime_s
        return httpx2.Response(200, json=answer)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def provider(
    server: Server, *, clock: Callable[[], float] = time.monotonic, token_url: str | None = None, **kw: Any
) -> ClientCredentialsToken:
    credentials = ClientCredentials("reports-worker", secret=SECRET, scope="reports.run", **kw)
    http = httpx2.Client(transport=httpx2.MockTransport(server))
    return ClientCredentialsToken(
        lambda: credentials, RESOURCE, client=http, token_url=token_url, clock=clock
    )


def test_discovery_finds_the_token_endpoint_and_the_token_names_its_resource() -> None:
    server = Server()
    tokens = provider(server)
    assert tokens() == "tok-1"
    assert server.gets == [
        "http://127.0.0.1:8765/.well-known/oauth-protected-resource/mcp",
        "http://127.0.0.1:9000/.well-known/oauth-authorization-server",
    ]
    [asked] = server.requests
    assert asked["form"] == {"grant_type": "client_credentials", "resource": RESOURCE, "scope": "reports.run"}
    pair = base64.b64decode(asked["authorization"].removeprefix("Basic ")).decode()
    assert pair == f"reports-worker:{SECRET}"  # client_secret_basic by default


def test_the_root_metadata_is_read_when_the_path_has_none() -> None:
    server = Server(metadata_at_path=False)
    provider(server)()
    assert server.gets[:2] == [
        "http://127.0.0.1:8765/.well-known/oauth-protected-resource/mcp",
        "http://127.0.0.1:8765/.well-known/oauth-protected-resource",
    ]


@pytest.mark.parametrize(
    ("server", "refusal"),
    [
        (Server(resource="http://127.0.0.1:8765/other"), "names resource"),
        (Server(issuer="http://127.0.0.1:9000/elsewhere"), "names issuer"),
    ],
)
def test_discovery_refuses_what_the_spec_refuses(server: Server, refusal: str) -> None:
    with pytest.raises(DiscoveryRefused, match=refusal):
        discover(httpx2.Client(transport=httpx2.MockTransport(server)), RESOURCE)
    assert server.requests == []  # no token asked


def test_an_issuer_listed_with_a_slash_for_its_path_is_the_same_issuer() -> None:
    """The official MCP Python SDK's resource metadata lists its authorization server as
    ``http://host:port/`` (pydantic adds the slash) where the server's issuer is ``http://host:port``."""
    server = Server()
    original = server.__call__

    def listed_with_a_slash(request: httpx2.Request) -> httpx2.Response:
        if request.url.path.startswith("/.well-known/oauth-protected-resource"):
            return httpx2.Response(200, json={"resource": RESOURCE, "authorization_servers": [ISSUER + "/"]})
        return original(request)

    http = httpx2.Client(transport=httpx2.MockTransport(listed_with_a_slash))
    assert discover(http, RESOURCE).token_endpoint == TOKEN_URL
    assert server.gets[-1] == "http://127.0.0.1:9000/.well-known/oauth-authorization-server"


def test_plain_http_is_refused_off_loopback() -> None:
    server = Server()
    with pytest.raises(DiscoveryRefused, match="not https"):
        discover(httpx2.Client(transport=httpx2.MockTransport(server)), "http://reports.example/mcp")
    assert server.gets == []


def test_client_secret_post_when_the_server_lists_only_it() -> None:
    server = Server(methods=("client_secret_post",))
    provider(server)()
    [asked] = server.requests
    assert asked["authorization"] == ""
    assert (asked["form"]["client_id"], asked["form"]["client_secret"]) == ("reports-worker", SECRET)


def test_the_token_is_cached_and_renewed_before_it_expires() -> None:
    clock = Clock()
    server = Server(lifetime_s=300)
    tokens = provider(server, clock=clock)
    assert [tokens() for _ in range(5)] == ["tok-1"] * 5
    clock.now += 300 - 60 - 1  # renewed 60 s before its end (or with half its life left, if that is less)
    assert tokens() == "tok-1"
    clock.now += 2
    assert tokens() == "tok-2"
    assert len(server.requests) == 2
    assert len(server.gets) == 2  # discovered once


def test_one_token_request_at_a_time_and_the_others_take_its_token() -> None:
    server = Server(delay_s=0.3)
    tokens = provider(server)
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(tokens())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert got == ["tok-1"] * 8
    assert len(server.requests) == 1


def test_a_failing_token_endpoint_is_asked_again_only_after_a_growing_backoff() -> None:
    clock = Clock()
    server = Server(down=3)
    tokens = provider(server, clock=clock)
    with pytest.raises(TokenUnavailable, match="HTTP 503") as first:
        tokens()
    assert first.value.retry_after == pytest.approx(1.0)
    with pytest.raises(TokenUnavailable, match="asked again in 1 s"):
        tokens()  # within the backoff: not asked
    assert len(server.requests) == 1
    clock.now += 1.0
    with pytest.raises(TokenUnavailable) as second:
        tokens()
    assert second.value.retry_after == pytest.approx(2.0)
    clock.now += 2.0
    with pytest.raises(TokenUnavailable):
        tokens()
    clock.now += 4.0
    assert tokens() == "tok-1"
    assert (len(server.requests), tokens.requests, tokens.failed) == (4, 4, 3)


def test_a_refused_client_is_a_wait_with_its_reason_and_no_secret_in_it() -> None:
    server = Server(refuse=True)
    with pytest.raises(TokenUnavailable, match=r"HTTP 401: invalid_client \(revoked\)") as refused:
        provider(server)()
    assert SECRET not in str(refused.value)


def test_a_401_invalid_token_renews_once_and_a_fresh_token_refused_again_is_a_refusal() -> None:
    clock = Clock()
    server = Server()
    tokens = provider(server, clock=clock)
    credentials = Credentials(tokens)
    challenge = 'Bearer error="invalid_token", resource_metadata="http://127.0.0.1:8765/.well-known/oauth-protected-resource/mcp"'
    sent = credentials.headers()
    assert sent == {"Authorization": "Bearer tok-1"}
    refused = Unauthorized("HTTP 401", http_status=401, challenge=challenge)
    assert isinstance(credentials.refused(refused, sent), TokenRenewed)
    sent = credentials.headers()
    assert sent == {"Authorization": "Bearer tok-2"}
    # The new token refused at once: the client is refused, not its token's age; no third token.
    assert credentials.refused(refused, sent) is refused
    assert credentials.headers() == {"Authorization": "Bearer tok-2"}
    # Much later (an ordinary expiry), a refusal renews again.
    clock.now += 31
    assert isinstance(credentials.refused(refused, credentials.headers()), TokenRenewed)
    assert credentials.headers() == {"Authorization": "Bearer tok-3"}


def test_a_403_or_another_error_or_a_static_token_is_not_renewed() -> None:
    tokens = provider(Server())
    credentials = Credentials(tokens)
    sent = credentials.headers()
    forbidden = Unauthorized("HTTP 403", http_status=403, challenge='Bearer error="insufficient_scope"')
    assert credentials.refused(forbidden, sent) is forbidden
    scope = Unauthorized("HTTP 401", http_status=401, challenge='Bearer error="invalid_request"')
    assert credentials.refused(scope, sent) is scope
    static = Credentials("static-token")
    plain = Unauthorized("HTTP 401", http_status=401, challenge='Bearer error="invalid_token"')
    assert static.refused(plain, static.headers()) is plain


def test_a_token_that_cannot_be_had_sends_nothing_and_keeps_the_backoff() -> None:
    credentials = Credentials(provider(Server(down=1)))
    with pytest.raises(NotSent, match="the token endpoint") as raised:
        credentials.headers()
    assert raised.value.retry_after == pytest.approx(1.0, abs=0.1)


def test_challenge_parameters_are_read_as_rfc_6750_writes_them() -> None:
    header = (
        'Bearer realm="mcp", error="invalid_token", error_description="The token \\"x\\" expired", scope=a'
    )
    assert challenge_params(header) == {
        "realm": "mcp",
        "error": "invalid_token",
        "error_description": 'The token "x" expired',
        "scope": "a",
    }
    assert challenge_params('Basic realm="x"') == {}


def _verify(assertion: str, key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> dict[str, Any]:
    head, body, signature = assertion.split(".")
    signed = f"{head}.{body}".encode()
    raw = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
    header = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
    if isinstance(key, rsa.RSAPrivateKey):
        assert header["alg"] == "RS256"
        key.public_key().verify(raw, signed, padding.PKCS1v15(), hashes.SHA256())
    else:
        assert header["alg"] == "ES256"
        der = utils.encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
        key.public_key().verify(der, signed, ec.ECDSA(hashes.SHA256()))
    assert header["kid"] == "k1"
    claims: dict[str, Any] = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    return claims


@pytest.mark.parametrize("kind", ["rsa", "ec"])
def test_a_private_key_jwt_assertion_verifies_with_the_public_key(kind: str) -> None:
    key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if kind == "rsa"
        else ec.generate_private_key(ec.SECP256R1())
    )
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    credentials = ClientCredentials("reports-worker", private_key_pem=pem, key_id="k1")
    claims = _verify(client_assertion(credentials, TOKEN_URL, now=1_000_000), key)
    assert {k: claims[k] for k in ("iss", "sub", "aud", "iat", "exp")} == {
        "iss": "reports-worker",
        "sub": "reports-worker",
        "aud": TOKEN_URL,
        "iat": 1_000_000,
        "exp": 1_000_060,
    }
    second = _verify(client_assertion(credentials, TOKEN_URL, now=1_000_000), key)
    assert second["jti"] != claims["jti"]  # never replayed

    server = Server()
    http = httpx2.Client(transport=httpx2.MockTransport(server))
    ClientCredentialsToken(lambda: credentials, RESOURCE, client=http, token_url=TOKEN_URL)()
    [asked] = server.requests
    assert asked["authorization"] == ""
    assert asked["form"]["client_assertion_type"] == "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
    assert _verify(asked["form"]["client_assertion"], key)["aud"] == TOKEN_URL
    assert server.gets == []  # a configured token_url: no discovery


def test_an_issuer_with_a_path_is_looked_up_in_the_specs_order_down_to_openid_s_path_appending() -> None:
    """Entra's and Keycloak's issuers have a path; their metadata is at ``{issuer}/.well-known/openid-
    configuration``, the third place MCP's authorization spec names (a 4xx at the others is passed over)."""
    issuer = "http://127.0.0.1:9000/tenant/v2.0"
    asked: list[str] = []

    def realm(request: httpx2.Request) -> httpx2.Response:
        asked.append(request.url.path)
        if request.url.path == "/.well-known/oauth-protected-resource/mcp":
            return httpx2.Response(200, json={"resource": RESOURCE, "authorization_servers": [issuer]})
        if request.url.path == "/tenant/v2.0/.well-known/openid-configuration":
            return httpx2.Response(200, json={"issuer": issuer, "token_endpoint": f"{issuer}/oauth2/token"})
        return httpx2.Response(404 if "oauth" in request.url.path else 400)

    found = discover(httpx2.Client(transport=httpx2.MockTransport(realm)), RESOURCE)
    assert found.token_endpoint == f"{issuer}/oauth2/token"
    assert asked == [
        "/.well-known/oauth-protected-resource/mcp",
        "/.well-known/oauth-authorization-server/tenant/v2.0",
        "/.well-known/openid-configuration/tenant/v2.0",
        "/tenant/v2.0/.well-known/openid-configuration",
    ]


@pytest.mark.parametrize("named", ["http://127.0.0.1:8765/nowhere", "http://metadata.internal/prm"])
def test_a_resource_metadata_url_a_401_named_that_is_not_there_falls_back_to_the_well_known_ones(
    named: str,
) -> None:
    server = Server()
    found = discover(
        httpx2.Client(transport=httpx2.MockTransport(server)), RESOURCE, resource_metadata_url=named
    )
    assert found.token_endpoint == TOKEN_URL
    assert "http://metadata.internal/prm" not in server.gets  # plain http off loopback: not even asked


def test_what_the_token_endpoint_echoes_of_the_secret_never_reaches_the_error() -> None:
    def echo(request: httpx2.Request) -> httpx2.Response:
        body = {"error": f"bad {SECRET}", "error_description": f"secret {SECRET} is not this client's"}
        return httpx2.Response(401, json=body)

    tokens = ClientCredentialsToken(
        lambda: ClientCredentials("reports-worker", secret=SECRET, method="client_secret_post"),
        RESOURCE,
        client=httpx2.Client(transport=httpx2.MockTransport(echo)),
        token_url=TOKEN_URL,
    )
    with pytest.raises(TokenUnavailable) as refused:
        tokens()
    assert SECRET not in str(refused.value)
    assert "[redacted]" in str(refused.value)


def test_a_token_the_server_echoes_in_its_401_is_taken_out_of_the_error() -> None:
    credentials = Credentials("tok-static-123")
    echoed = Unauthorized("HTTP 401: token tok-static-123 is not valid", http_status=401, challenge=None)
    said = credentials.refused(echoed, credentials.headers())
    assert isinstance(said, Unauthorized)
    assert "tok-static-123" not in str(said)


def test_any_failure_to_get_a_token_is_a_wait_with_its_reason_and_a_backoff() -> None:
    clock = Clock()

    def unset() -> ClientCredentials:
        raise LookupError("servers.reports.auth.client_secret_env 'REPORTS_CLIENT_SECRET' is not set")

    server = Server()
    tokens = ClientCredentialsToken(
        unset, RESOURCE, client=httpx2.Client(transport=httpx2.MockTransport(server)), clock=clock
    )
    with pytest.raises(
        TokenUnavailable, match=r"LookupError: servers\.reports\.auth\.client_secret_env"
    ) as first:
        tokens()
    assert first.value.retry_after == pytest.approx(1.0)
    with pytest.raises(TokenUnavailable, match="asked again in 1 s"):
        tokens()  # within the backoff: not tried again
    assert tokens.failed == 1
