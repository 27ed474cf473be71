"""``kind = "google"`` (issue 23): google-auth's own service-account credentials (a key file the test makes)
sign their assertion against a local token endpoint that verifies it with the public key; the token is
cached, renewed when it nears its expiry, and sent by the AIP-151 transport."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx2
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from adapters import AdapterConfig, GoogleToken, RemoteRef, TokenRenewed, TokenUnavailable
from adapters.aip151 import AipOperationsAdapter
from workers.auth import TokenProviders, describe_auth
from workers.settings import FleetConfig

SCOPE = "https://www.googleapis.com/auth/cloud-platform"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"


class TokenEndpoint(ThreadingHTTPServer):
    """Google's token endpoint as a service account meets it: a signed JWT (RS256) in, an access token out."""

    def __init__(self, public_key: rsa.RSAPublicKey, lifetime_s: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.public_key = public_key
        self.lifetime_s = lifetime_s
        self.issued = 0
        self.claims: list[dict[str, Any]] = []
        self.refuse = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/token"


class _Handler(BaseHTTPRequestHandler):
    server: TokenEndpoint

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_POST(self) -> None:
        form = {
            k: v[0]
            for k, v in parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode()).items()
        }
        head, body, signature = form["assertion"].split(".")
        raw = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
        try:
            self.server.public_key.verify(raw, f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256())
            valid = form["grant_type"] == JWT_BEARER and not self.server.refuse
        except Exception:  # noqa: BLE001 - any bad signature is a refusal
            valid = False
        if not valid:
            self._answer(400, {"error": "invalid_grant", "error_description": "Invalid JWT Signature."})
            return
        self.server.claims.append(json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))
        self.server.issued += 1
        token = f"ya29.local-{self.server.issued}"
        self._answer(
            200, {"access_token": token, "token_type": "Bearer", "expires_in": self.server.lifetime_s}
        )

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def endpoint_and_key(tmp_path: Path) -> Iterator[tuple[TokenEndpoint, Path]]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    endpoint = TokenEndpoint(key.public_key(), lifetime_s=4)
    thread = threading.Thread(target=endpoint.serve_forever, daemon=True)
    thread.start()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    account = {
        "type": "service_account",
        "project_id": "demo",
        "private_key_id": "k1",
        "private_key": pem.decode(),
        "client_email": "longcall@demo.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": endpoint.url,
    }
    path = tmp_path / "sa.json"
    path.write_text(json.dumps(account))
    try:
        yield endpoint, path
    finally:
        endpoint.shutdown()
        endpoint.server_close()
        thread.join(timeout=5)


def test_a_service_account_token_is_got_cached_and_renewed_near_its_expiry(
    endpoint_and_key: tuple[TokenEndpoint, Path],
) -> None:
    endpoint, path = endpoint_and_key
    tokens = GoogleToken(path, (SCOPE,), what="exports")
    assert [tokens() for _ in range(3)] == ["ya29.local-1"] * 3
    [claims] = endpoint.claims
    # google-auth's own assertion (its audience is Google's token URI, whatever the file's token_uri).
    assert (claims["iss"], claims["scope"]) == ("longcall@demo.iam.gserviceaccount.com", SCOPE)
    # A 4 s token is renewed with half its life left: within 4 s, a second one.
    deadline = time.monotonic() + 8
    while tokens() == "ya29.local-1":
        assert time.monotonic() < deadline, "the token was not renewed"
        time.sleep(0.1)
    assert tokens() == "ya29.local-2"
    assert endpoint.issued == 2


def test_a_refused_service_account_is_a_wait_with_google_s_reason(
    endpoint_and_key: tuple[TokenEndpoint, Path],
) -> None:
    endpoint, path = endpoint_and_key
    endpoint.refuse = True
    with pytest.raises(TokenUnavailable, match="invalid_grant") as refused:
        GoogleToken(path, (SCOPE,), what="exports")()
    assert "PRIVATE KEY" not in str(refused.value)
    with pytest.raises(TokenUnavailable, match="cannot be loaded"):
        GoogleToken(path.with_name("missing.json"), (SCOPE,), what="exports")()


def test_an_aip151_server_with_kind_google_sends_its_token(
    endpoint_and_key: tuple[TokenEndpoint, Path], tmp_path: Path
) -> None:
    _, path = endpoint_and_key
    config = tmp_path / "longcall.toml"
    config.write_text(
        '[servers.exports]\nprotocol = "aip151"\nprotocol_version = "v1"\nurl = "https://exports.example"\n'
        f'[servers.exports.auth]\nkind = "google"\ncredentials_file = "{path}"\n'
    )
    server = FleetConfig.from_toml(config).servers["exports"]
    providers = TokenProviders()
    try:
        assert providers.provider("exports", server)() == "ya29.local-1"
        assert describe_auth("exports", server, providers) == {"kind": "google", "token": "granted"}
    finally:
        providers.close()


def test_the_aip151_adapter_sends_the_google_token_and_renews_it_once_on_a_401(
    endpoint_and_key: tuple[TokenEndpoint, Path],
) -> None:
    """An AIP-151 API (as Google's answer an expired token: 401 UNAUTHENTICATED, ``invalid_token``) read with
    the service account's token; refused once, the token is renewed and the next read carries the new one."""
    endpoint, path = endpoint_and_key
    seen: list[str] = []
    refuse = {"ya29.local-1"}

    def api(request: httpx2.Request) -> httpx2.Response:
        token = request.headers["authorization"].removeprefix("Bearer ")
        seen.append(token)
        if token in refuse:
            refuse.discard(token)
            body = {
                "error": {
                    "code": 401,
                    "message": "Request had invalid credentials.",
                    "status": "UNAUTHENTICATED",
                }
            }
            challenge = 'Bearer realm="https://accounts.google.com/", error="invalid_token"'
            return httpx2.Response(401, json=body, headers={"WWW-Authenticate": challenge})
        return httpx2.Response(200, json={"name": "operations/1", "done": False})

    tokens = GoogleToken(path, (SCOPE,), what="exports")
    config = AdapterConfig(
        name="exports",
        url="https://exports.example",
        protocol="aip151",
        protocol_version="v1",
        token_provider=tokens,
    )
    ref = RemoteRef("operations/1", None, "v1", "aip151")
    with httpx2.Client(transport=httpx2.MockTransport(api)) as client:
        adapter = AipOperationsAdapter(config, client)
        with pytest.raises(TokenRenewed, match="UNAUTHENTICATED"):
            adapter.get(ref)
        assert adapter.get(ref).terminal is None
    assert seen == ["ya29.local-1", "ya29.local-2"]
    assert endpoint.issued == 2
