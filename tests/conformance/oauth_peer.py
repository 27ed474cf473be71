"""The OAuth 2.1 peers of issue 23: an authorization server and an MCP resource server that trusts only it.

`start_oauth_peer` runs `peers/oauth_as.py` and `peers/oauth_rs.py` from the ``oauth-sdk-py`` runtime that
`scripts/install-peers` installs, each on a free loopback port, and yields an `OAuthPeer` that knows their
URLs, the registered clients and their control switches. The fixtures (`oauth_peers` for a module,
`oauth_peer` reset per test) are in conftest.py.
Also here: a private_key_jwt client assertion (RFC 7523) signed with `cryptography` alone.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from tests.conformance.conftest import (
    PEER_PROGRAMS,
    REPO,
    START_ATTEMPTS,
    START_TIMEOUT_S,
    _free_port,
    _stop,
    _wait_until_listening,
    peers_dir,
)

RUNTIME = "oauth-sdk-py"
DEFAULT_LIFETIME_S = 300
SCOPE = "reports"
CONTROL_TIMEOUT_S = 5.0
JWT_BEARER = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"

PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class OAuthClient:
    """A registered client: a secret (client_secret_basic / _post) or a private key (private_key_jwt)."""

    client_id: str
    secret: str | None = None
    private_key: PrivateKey | None = None


@dataclass(frozen=True)
class OAuthPeer:
    """The running pair. `resource` is the RS's RFC 8707 resource identifier (its /mcp URL)."""

    issuer: str
    token_url: str
    as_control_url: str
    mcp_url: str
    resource: str
    rs_control_url: str
    clients: dict[str, OAuthClient]

    def control(self, url: str, method: str, body: dict[str, Any] | None = None) -> Any:
        with httpx2.Client(timeout=CONTROL_TIMEOUT_S) as client:
            response = client.request(method, url, json=body)
            response.raise_for_status()
            return response.json()

    def revoke_client(self, client_id: str) -> None:
        self.control(f"{self.as_control_url}/revoke", "POST", {"client_id": client_id})

    def set_token_lifetime(self, seconds: int) -> None:
        self.control(f"{self.as_control_url}/token-lifetime", "POST", {"seconds": seconds})

    def token_unavailable(self, count: int) -> None:
        """The next `count` token requests answer 503."""
        self.control(f"{self.as_control_url}/token-unavailable", "POST", {"count": count})

    def token_log(self) -> list[dict[str, Any]]:
        log: list[dict[str, Any]] = self.control(f"{self.as_control_url}/log", "GET")
        return log

    def issued_tokens(self) -> list[str]:
        """Every access token the AS has issued (for a test that greps for them where none may be)."""
        tokens: list[str] = self.control(f"{self.as_control_url}/issued", "GET")
        return tokens

    def fail_once(self, method: str) -> None:
        """The RS answers the next request carrying JSON-RPC `method` with 401 invalid_token."""
        self.control(f"{self.rs_control_url}/fail-once", "POST", {"method": method})

    def rs_log(self) -> list[dict[str, Any]]:
        log: list[dict[str, Any]] = self.control(f"{self.rs_control_url}/log", "GET")
        return log

    def reset(self) -> None:
        """Undo revokes, lifetime, 503s and armed 401s; clear both logs."""
        for url in (self.as_control_url, self.rs_control_url):
            self.control(f"{url}/faults", "DELETE")
            self.control(f"{url}/log", "DELETE")


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _int_b64url(value: int, length: int | None = None) -> str:
    return _b64url(value.to_bytes(length or (value.bit_length() + 7) // 8, "big"))


def public_jwk(key: PrivateKey, kid: str) -> dict[str, str]:
    if isinstance(key, rsa.RSAPrivateKey):
        numbers = key.public_key().public_numbers()
        return {
            "kty": "RSA",
            "kid": kid,
            "alg": "RS256",
            "use": "sig",
            "n": _int_b64url(numbers.n),
            "e": _int_b64url(numbers.e),
        }
    point = key.public_key().public_numbers()
    return {
        "kty": "EC",
        "kid": kid,
        "alg": "ES256",
        "use": "sig",
        "crv": "P-256",
        "x": _int_b64url(point.x, 32),
        "y": _int_b64url(point.y, 32),
    }


def sign_jwt(key: PrivateKey, claims: dict[str, Any], kid: str | None = None) -> str:
    """A compact JWS: RS256 for an RSA key, ES256 (raw r||s, RFC 7518 §3.4) for a P-256 key."""
    alg = "RS256" if isinstance(key, rsa.RSAPrivateKey) else "ES256"
    header = {"alg": alg, "typ": "JWT"} | ({"kid": kid} if kid else {})
    signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}".encode()
    if isinstance(key, rsa.RSAPrivateKey):
        signature = key.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
    else:
        r, s = decode_dss_signature(key.sign(signing_input, ec.ECDSA(hashes.SHA256())))
        signature = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    return f"{signing_input.decode()}.{_b64url(signature)}"


def client_assertion(client: OAuthClient, audience: str, lifetime_s: int = 60) -> str:
    """An RFC 7523 §3 client assertion: iss = sub = client_id, the AS as aud, a short exp, a fresh jti."""
    assert client.private_key is not None, client.client_id
    now = int(time.time())
    claims = {
        "iss": client.client_id,
        "sub": client.client_id,
        "aud": audience,
        "iat": now,
        "exp": now + lifetime_s,
        "jti": str(uuid.uuid4()),
    }
    return sign_jwt(client.private_key, claims, kid=client.client_id)


def default_clients() -> dict[str, OAuthClient]:
    return {
        "basic": OAuthClient("basic", secret=secrets.token_urlsafe(16)),
        "post": OAuthClient("post", secret=secrets.token_urlsafe(16)),
        "jwt-rsa": OAuthClient(
            "jwt-rsa", private_key=rsa.generate_private_key(public_exponent=65537, key_size=2048)
        ),
        "jwt-ec": OAuthClient("jwt-ec", private_key=ec.generate_private_key(ec.SECP256R1())),
        "revocable": OAuthClient("revocable", secret=secrets.token_urlsafe(16)),
    }


def _config(clients: dict[str, OAuthClient], resource: str, rs_secret: str) -> dict[str, Any]:
    entries: list[dict[str, Any]] = [
        {"client_id": "mcp-rs", "client_secret": rs_secret, "introspection": True}
    ]
    for client in clients.values():
        entry: dict[str, Any] = {"client_id": client.client_id, "scope": SCOPE}
        if client.secret is not None:
            entry["client_secret"] = client.secret
        if client.private_key is not None:
            entry["jwk"] = public_jwk(client.private_key, client.client_id)
        entries.append(entry)
    return {
        "resources": [resource],
        "scopes": [SCOPE],
        "token_lifetime_s": DEFAULT_LIFETIME_S,
        "clients": entries,
    }


def _python() -> str:
    python = peers_dir() / RUNTIME / "venv" / "bin" / "python"
    if not (peers_dir() / RUNTIME / ".installed").is_file():
        pytest.fail(
            f"runtime {peers_dir() / RUNTIME} is not installed; run scripts/install-peers "
            "(and set LONGCALL_PEERS_DIR if the peers live elsewhere)",
            pytrace=False,
        )
    return str(python)


def _spawn(argv: list[str], stderr_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with stderr_path.open("wb") as stderr:
        return subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, env=env
        )


def start_oauth_peer(log_dir: Path, clients: dict[str, OAuthClient] | None = None) -> Iterator[OAuthPeer]:
    """Run the AS, then the RS that introspects at it, until the generator is closed.

    Both ports are picked first (the AS must know the RS's resource URL); a start that exits at once (a
    port taken meanwhile) starts both again on new ports, up to START_ATTEMPTS times.
    """
    clients = clients or default_clients()
    python = _python()
    rs_secret = secrets.token_urlsafe(16)
    for attempt in range(1, START_ATTEMPTS + 1):
        as_port, rs_port = _free_port(), _free_port()
        if as_port == rs_port:
            continue
        issuer = f"http://127.0.0.1:{as_port}"
        resource = f"http://127.0.0.1:{rs_port}/mcp"
        config_path = log_dir / f"oauth-as-{attempt}.json"
        config_path.write_text(json.dumps(_config(clients, resource, rs_secret)))
        as_stderr = log_dir / f"oauth-as-{attempt}.stderr"
        rs_stderr = log_dir / f"oauth-rs-{attempt}.stderr"
        authorization = _spawn(
            [
                python,
                str(PEER_PROGRAMS / "oauth_as.py"),
                "--port",
                str(as_port),
                "--config",
                str(config_path),
            ],
            as_stderr,
        )
        processes = [authorization]
        try:
            state = _wait_until_listening(authorization, as_port)
            if state == "listening":
                resource_server = _spawn(
                    [
                        python,
                        str(PEER_PROGRAMS / "oauth_rs.py"),
                        "--port",
                        str(rs_port),
                        "--issuer",
                        issuer,
                        "--introspection-url",
                        f"{issuer}/introspect",
                        "--introspection-client-id",
                        "mcp-rs",
                    ],
                    rs_stderr,
                    env=os.environ | {"OAUTH_RS_INTROSPECTION_SECRET": rs_secret},
                )
                processes.append(resource_server)
                state = _wait_until_listening(resource_server, rs_port)
            if state == "listening":
                yield OAuthPeer(
                    issuer=issuer,
                    token_url=f"{issuer}/token",
                    as_control_url=f"{issuer}/_control",
                    mcp_url=resource,
                    resource=resource,
                    rs_control_url=f"http://127.0.0.1:{rs_port}/_control",
                    clients=clients,
                )
                return
        finally:
            for process in reversed(processes):
                _stop(process)
        if state == "timeout" or attempt == START_ATTEMPTS:
            stderr = "\n".join(
                f"{path.name}:\n{path.read_text(errors='replace')[-3000:]}"
                for path in (as_stderr, rs_stderr)
                if path.exists()
            )
            pytest.fail(
                f"oauth peers {state} after start (attempt {attempt}, "
                f"limit {START_TIMEOUT_S:.0f} s each):\n{stderr}",
                pytrace=False,
            )
    pytest.fail("oauth peers: no two distinct free ports", pytrace=False)
