"""OAuth 2.1 for a machine client: the client credentials grant, as MCP's OAuth client credentials
extension (``io.modelcontextprotocol/oauth-client-credentials``) asks of a client with no user at a browser.

:class:`ClientCredentialsToken` is a bearer token provider (``AdapterConfig.token_provider``): called before
every request, it answers from its cache, and asks the token endpoint only when it has no token or the one
it has is about to expire (or was refused: :meth:`~ClientCredentialsToken.renew`). One token request at a
time per provider (one per worker process and server), none while an earlier failure's backoff runs: a
token endpoint that is down or refuses the client is a :class:`TokenUnavailable` with its reason (the
request is not sent; the step is due again), never a storm of token requests.

Where the token endpoint is, when the configuration names none, is discovered as the spec orders it
(:func:`discover`): the protected resource's metadata (RFC 9728: the ``resource_metadata`` of a ``401``'s
``WWW-Authenticate``, else ``/.well-known/oauth-protected-resource`` inserted before the resource's path,
else at its root), whose ``resource`` must be the server's URL; then its first authorization server's
metadata (RFC 8414, then OpenID Connect discovery), whose ``issuer`` must be that server. Every URL must be
``https`` unless it is on the loopback interface.

The client authenticates at the token endpoint with a secret (``client_secret_basic``, else
``client_secret_post`` when the server lists only that) or a signed assertion (``private_key_jwt``, RFC
7523: RS256 for an RSA key, ES256 for a P-256 key), and names the resource it wants the token for (RFC
8707 ``resource``). Nothing secret is logged or put in an error: not the secret, the key, the assertion
nor a token.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import httpx2

from adapters.errors import Transient

__all__ = [
    "AuthMethod",
    "AuthorizationServer",
    "CachedToken",
    "ClientCredentials",
    "ClientCredentialsToken",
    "DiscoveryRefused",
    "TokenUnavailable",
    "discover",
    "resource_metadata_from_challenge",
]

log = logging.getLogger("longcall.oauth")

AuthMethod = Literal["client_secret_basic", "client_secret_post", "private_key_jwt"]
JWT_BEARER = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
#: A token is renewed this long before it expires, or with half its lifetime left if that is less (a short
#: token's last moments are too near its end for a request still on its way).
RENEW_BEFORE_S = 60.0
#: After a failed token request, the next waits this long, doubling to :data:`BACKOFF_MAX_S`.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
#: A token got to replace a refused one, and refused in its turn within this many seconds, is a refusal of
#: the client (revoked, not allowed this resource), not an expiry: it is not renewed again.
REFUSED_AGAIN_S = 30.0
#: The seconds a signed client assertion is valid for.
ASSERTION_LIFETIME_S = 60
#: How much of a metadata or token answer is read (they are small documents).
MAX_DOCUMENT_BYTES = 256 * 1024


class TokenUnavailable(Transient):
    """No token could be had now (the token endpoint is down, answered badly, or refused the client): the
    request that needed it is not sent. ``retry_after``: when the provider will ask again."""


class DiscoveryRefused(TokenUnavailable):
    """Discovery found what the spec says to refuse (a resource that is not this server, an authorization
    server the resource does not list, an issuer that is not the one asked, plain ``http`` off loopback)."""


@dataclass(frozen=True)
class ClientCredentials:
    """Who the client is and how it proves it. ``secret`` for the secret methods, ``private_key_pem`` (and
    its ``key_id``) for ``private_key_jwt``; ``method`` None: the key's method, or for a secret the first
    of basic and post the token endpoint lists."""

    client_id: str
    secret: str | None = field(default=None, repr=False)
    private_key_pem: bytes | None = field(default=None, repr=False)
    key_id: str | None = None
    method: AuthMethod | None = None
    scope: str | None = None

    def __post_init__(self) -> None:
        if (self.secret is None) == (self.private_key_pem is None):
            raise ValueError("a client has a secret or a private key, one of them")


@dataclass(frozen=True)
class AuthorizationServer:
    """What discovery found (or the configuration named): where to ask, and what the server accepts."""

    token_endpoint: str
    issuer: str | None = None
    #: ``token_endpoint_auth_methods_supported`` (RFC 8414 says ``client_secret_basic`` when absent).
    methods: tuple[str, ...] = ("client_secret_basic",)


# ---------------------------------------------------------------------------------------------- discovery
def require_secure(url: str, what: str) -> None:
    """Refuse ``url`` unless it is ``https``, or ``http`` to the loopback interface."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        return
    if parts.scheme == "http" and _loopback(parts.hostname or ""):
        return
    raise DiscoveryRefused(f"{what} {url!r} is not https (plain http is accepted on loopback only)")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_CHALLENGE_PARAM = re.compile(r'([A-Za-z_][A-Za-z0-9_-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')


def challenge_params(www_authenticate: str) -> dict[str, str]:
    """The parameters of a ``Bearer`` challenge (``error``, ``resource_metadata``, ``scope``...)."""
    _, _, rest = www_authenticate.strip().partition(" ")
    if not www_authenticate.strip().lower().startswith("bearer"):
        return {}
    return {
        m[1].lower(): (m[2] if m[2] is not None else m[3]).replace('\\"', '"')
        for m in _CHALLENGE_PARAM.finditer(rest)
    }


def resource_metadata_from_challenge(www_authenticate: str | None) -> str | None:
    """RFC 9728 §5.1: the ``resource_metadata`` URL a ``401``'s ``WWW-Authenticate`` names, if any."""
    if not www_authenticate:
        return None
    return challenge_params(www_authenticate).get("resource_metadata")


def _well_known(url: str, name: str) -> list[str]:
    """RFC 9728 §3.1 / RFC 8414 §3.1: ``/.well-known/{name}`` inserted between the host and the path, then
    (for a URL with a path) at the root."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    inserted = urlunsplit((parts.scheme, parts.netloc, f"/.well-known/{name}{path}", "", ""))
    root = urlunsplit((parts.scheme, parts.netloc, f"/.well-known/{name}", "", ""))
    return [inserted] if inserted == root else [inserted, root]


def authorization_server_metadata_urls(issuer: str) -> list[str]:
    """Where an authorization server's metadata is looked for, in the order MCP's authorization spec gives:
    for an issuer with a path, OAuth's path insertion (RFC 8414), OpenID Connect's path insertion, then
    OpenID Connect's path appending (``{issuer}/.well-known/openid-configuration``: Entra, Keycloak realms);
    for one without, OAuth's then OpenID Connect's at the root."""
    parts = urlsplit(issuer)
    path = parts.path.rstrip("/")

    def at(well_known_path: str) -> str:
        return urlunsplit((parts.scheme, parts.netloc, well_known_path, "", ""))

    if not path:
        return [at("/.well-known/oauth-authorization-server"), at("/.well-known/openid-configuration")]
    return [
        at(f"/.well-known/oauth-authorization-server{path}"),
        at(f"/.well-known/openid-configuration{path}"),
        at(f"{path}/.well-known/openid-configuration"),
    ]


def _same_resource(a: str, b: str) -> bool:
    """Two resource identifiers compared as RFC 8707 / MCP's canonical URI: the scheme and host in any
    case, a trailing ``/`` ignored."""
    pa, pb = urlsplit(a), urlsplit(b)
    return (
        pa.scheme.lower() == pb.scheme.lower()
        and pa.netloc.lower() == pb.netloc.lower()
        and pa.path.rstrip("/") == pb.path.rstrip("/")
        and pa.query == pb.query
    )


def _same_issuer(named: str, asked: str) -> bool:
    """RFC 8414 §3.3: the metadata's ``issuer`` is the one its URL was built from, identical, except for a
    ``/`` alone as the path: the official MCP Python SDK lists ``https://as.example/`` in the resource's
    metadata (pydantic's URL type adds it) for an issuer ``https://as.example``."""
    if named == asked:
        return True
    a, b = urlsplit(named), urlsplit(asked)
    return (a.scheme, a.netloc, a.query) == (b.scheme, b.netloc, b.query) and {a.path, b.path} == {"", "/"}


def _get_json(client: httpx2.Client, url: str, what: str) -> dict[str, Any] | None:
    """A metadata document, or None when there is none there (a 4xx: the next place is tried); a server
    error, no answer or an unusable document raises."""
    require_secure(url, what)
    try:
        answer = client.get(url, headers={"Accept": "application/json"})
    except httpx2.HTTPError as exc:
        raise TokenUnavailable(f"{what} at {url} cannot be read: {type(exc).__name__}") from None
    if 400 <= answer.status_code < 500:
        return None
    if answer.status_code != 200:
        raise TokenUnavailable(f"{what} at {url} answered HTTP {answer.status_code}")
    if len(answer.content) > MAX_DOCUMENT_BYTES:
        raise TokenUnavailable(f"{what} at {url} is larger than {MAX_DOCUMENT_BYTES} bytes")
    try:
        document = answer.json()
    except ValueError:
        raise TokenUnavailable(f"{what} at {url} is not JSON") from None
    if not isinstance(document, dict):
        raise TokenUnavailable(f"{what} at {url} is not a JSON object")
    return document


def discover(
    client: httpx2.Client, resource: str, *, resource_metadata_url: str | None = None
) -> AuthorizationServer:
    """The authorization server of the protected resource at ``resource`` (the MCP server's URL), as RFC
    9728 and RFC 8414 find it; ``resource_metadata_url``: the one a ``401`` named."""
    # The URL a 401 named first (RFC 9728 §5.1), then the well-known ones: a named URL that is not there,
    # or not https, is passed over (a wrong one would otherwise stop every token request for good).
    candidates = [
        *([resource_metadata_url] if resource_metadata_url else []),
        *_well_known(resource, "oauth-protected-resource"),
    ]
    metadata = None
    for url in candidates:
        try:
            metadata = _get_json(client, url, "the protected resource metadata")
        except DiscoveryRefused:
            if url != resource_metadata_url:
                raise
            continue
        if metadata is not None:
            break
    if metadata is None:
        raise TokenUnavailable(
            f"no protected resource metadata for {resource} (tried {', '.join(candidates)})"
        )
    named = metadata.get("resource")
    if not isinstance(named, str) or not _same_resource(named, resource):
        raise DiscoveryRefused(f"the protected resource metadata names resource {named!r}, not {resource!r}")
    servers = metadata.get("authorization_servers")
    if not isinstance(servers, list) or not servers or not all(isinstance(s, str) for s in servers):
        raise DiscoveryRefused(f"the protected resource metadata of {resource} lists no authorization server")
    issuer: str = servers[0]
    require_secure(issuer, "the authorization server")
    document = None
    for url in authorization_server_metadata_urls(issuer):
        document = _get_json(client, url, "the authorization server metadata")
        if document is not None:
            break
    if document is None:
        raise TokenUnavailable(f"no authorization server metadata for {issuer}")
    named = document.get("issuer")
    if not isinstance(named, str) or not _same_issuer(named, issuer):  # RFC 8414 §3.3
        raise DiscoveryRefused(
            f"the authorization server metadata names issuer {document.get('issuer')!r}, not {issuer!r}"
        )
    endpoint = document.get("token_endpoint")
    if not isinstance(endpoint, str):
        raise DiscoveryRefused(f"the authorization server {issuer} names no token endpoint")
    require_secure(endpoint, "the token endpoint")
    methods = document.get("token_endpoint_auth_methods_supported") or ["client_secret_basic"]
    return AuthorizationServer(endpoint, issuer, tuple(str(m) for m in methods))


# ------------------------------------------------------------------------------------------ the token
def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def client_assertion(credentials: ClientCredentials, audience: str, *, now: float | None = None) -> str:
    """RFC 7523 §3: a JWT the client signs with its private key (RS256 for RSA, ES256 for P-256): issuer and
    subject the client id, audience the token endpoint, a short life and a unique ``jti``."""
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415 - private_key_jwt only
    from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa, utils  # noqa: PLC0415

    if credentials.private_key_pem is None:
        raise ValueError("private_key_jwt needs a private key")
    key = serialization.load_pem_private_key(credentials.private_key_pem, password=None)
    issued = int(now if now is not None else time.time())
    claims = {
        "iss": credentials.client_id,
        "sub": credentials.client_id,
        "aud": audience,
        "iat": issued,
        "exp": issued + ASSERTION_LIFETIME_S,
        "jti": str(uuid.uuid4()),
    }
    header: dict[str, str] = {"typ": "JWT"}
    if credentials.key_id:
        header["kid"] = credentials.key_id

    def signed_part(algorithm: str) -> bytes:
        head = _b64url(json.dumps({"alg": algorithm, **header}).encode())
        return f"{head}.{_b64url(json.dumps(claims).encode())}".encode("ascii")

    if isinstance(key, rsa.RSAPrivateKey):
        signed = signed_part("RS256")
        signature = key.sign(signed, padding.PKCS1v15(), hashes.SHA256())
    elif isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1":
        signed = signed_part("ES256")
        r, s = utils.decode_dss_signature(key.sign(signed, ec.ECDSA(hashes.SHA256())))
        signature = r.to_bytes(32, "big") + s.to_bytes(32, "big")  # JWS: R and S, not DER
    else:
        raise ValueError("private_key_jwt takes an RSA key (RS256) or a P-256 key (ES256)")
    return f"{signed.decode('ascii')}.{_b64url(signature)}"


@dataclass
class _Held:
    token: str
    renew_at: float
    got_at: float
    #: Got to replace a token a server refused: refused in its turn soon after, it is not renewed again.
    after_refusal: bool = False


class CachedToken:
    """A bearer token provider that asks for a token only when it has none fit to send: one request at a
    time, a backoff after failures, renewed before it expires and once after a ``401 invalid_token``. What
    asks is :meth:`_ask` (a subclass's). ``what``: the server's URL, for the log. ``clock``:
    ``time.monotonic``."""

    def __init__(self, what: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._what = what
        self._clock = clock
        self._lock = threading.Lock()
        self._held: _Held | None = None
        self._failures = 0
        self._replacing = False
        self._retry_at = 0.0
        self._last_failure = ""
        #: Token requests made, and failed.
        self.requests = 0
        self.failed = 0

    def _ask(self) -> tuple[str, float | None]:
        """One token request: the token and its lifetime in seconds (None: unknown).

        Raises:
            TokenUnavailable: no token now, with the reason.
        """
        raise NotImplementedError

    def _on_resource_metadata(self, url: str) -> None:
        """A ``401`` named the resource's metadata at ``url`` (RFC 9728 §5.1)."""

    def __call__(self) -> str:
        held = self._held
        if held is not None and self._clock() < held.renew_at:
            return held.token
        with self._lock:  # one token request at a time; who waited finds the new token
            held = self._held
            now = self._clock()
            if held is not None and now < held.renew_at:
                return held.token
            if now < self._retry_at:
                raise TokenUnavailable(self._last_failure, retry_after=self._retry_at - now)
            self.requests += 1
            try:
                token, lifetime = self._ask()
            except Exception as exc:  # noqa: BLE001 - any failure is a wait with its reason, backed off
                # A variable unset since the start, a key it cannot sign with, an unreadable answer: as a
                # token endpoint that is down, never a step retried at once without a backoff.
                reason = str(exc) if isinstance(exc, TokenUnavailable) else f"{type(exc).__name__}: {exc}"
                self._failed(reason)
                raise TokenUnavailable(reason, retry_after=self._retry_at - self._clock()) from None
            self._failures = 0
            now = self._clock()
            renew_in = (
                lifetime - min(RENEW_BEFORE_S, 0.5 * lifetime) if lifetime is not None else float("inf")
            )
            self._held = _Held(token, now + max(renew_in, 0.0), now, self._replacing)
            self._replacing = False
            return token

    def renew(self, refused: str | None, *, resource_metadata_url: str | None = None) -> bool:
        """A server answered ``401 invalid_token`` to a request sent with ``refused``: the next call asks
        for a new token. True when the request is worth sending again: False when ``refused`` was itself
        got to replace a refused token, less than :data:`REFUSED_AGAIN_S` ago (renewed once, not for ever).
        ``resource_metadata_url``: what the ``401`` named, for the next discovery."""
        with self._lock:
            if resource_metadata_url:
                self._on_resource_metadata(resource_metadata_url)
            held = self._held
            if held is None or (refused is not None and held.token != refused):
                return True  # renewed already (by another thread): sent again with the new one
            if held.after_refusal and self._clock() - held.got_at < REFUSED_AGAIN_S:
                return False
            self._held = None
            self._replacing = True
            return True

    def _failed(self, reason: str) -> None:
        self.failed += 1
        self._failures += 1
        backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self._failures - 1))
        self._retry_at = self._clock() + backoff
        self._last_failure = f"{reason} (asked again in {backoff:.0f} s at the earliest)"
        log.warning("no token for %s: %s", self._what, self._last_failure)


class ClientCredentialsToken(CachedToken):
    """A bearer token provider for one server: the client credentials grant, cached per process.

    ``resource``: the server's URL (the token is asked for it, RFC 8707, and discovery starts from it).
    ``token_url``: the token endpoint, when configured (no discovery). ``clock``: ``time.monotonic``.
    """

    def __init__(
        self,
        credentials: Callable[[], ClientCredentials],
        resource: str,
        *,
        client: httpx2.Client,
        token_url: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(resource, clock=clock)
        self._credentials = credentials
        self._resource = resource
        self._client = client
        self._token_url = token_url
        self._server: AuthorizationServer | None = None
        self._resource_metadata_url: str | None = None

    def _on_resource_metadata(self, url: str) -> None:
        if url != self._resource_metadata_url:
            self._resource_metadata_url = url
            self._server = None

    def authorization_server(self) -> AuthorizationServer:
        if self._server is None:
            if self._token_url is not None:
                require_secure(self._token_url, "the token endpoint")
                self._server = AuthorizationServer(
                    self._token_url, None, ("client_secret_basic", "client_secret_post", "private_key_jwt")
                )
            else:
                self._server = discover(
                    self._client, self._resource, resource_metadata_url=self._resource_metadata_url
                )
        return self._server

    def _ask(self) -> tuple[str, float | None]:
        """One token request: the token and its lifetime in seconds (None: the server did not say)."""
        server = self.authorization_server()
        credentials = self._credentials()
        method = _method(credentials, server)
        form: dict[str, str] = {"grant_type": "client_credentials", "resource": self._resource}
        if credentials.scope:
            form["scope"] = credentials.scope
        headers = {"Accept": "application/json"}
        if method == "client_secret_basic":
            headers["Authorization"] = _basic(credentials.client_id, credentials.secret or "")
        elif method == "client_secret_post":
            form |= {"client_id": credentials.client_id, "client_secret": credentials.secret or ""}
        else:  # RFC 7523 §3: the audience identifies the server; its token endpoint's URL does
            form |= {
                "client_id": credentials.client_id,
                "client_assertion_type": JWT_BEARER,
                "client_assertion": client_assertion(credentials, server.token_endpoint),
            }
        try:
            answer = self._client.post(server.token_endpoint, data=form, headers=headers)
        except httpx2.HTTPError as exc:
            raise TokenUnavailable(
                f"the token endpoint {server.token_endpoint} cannot be reached: {type(exc).__name__}"
            ) from None
        try:
            return _token_answer(answer, server.token_endpoint)
        except TokenUnavailable as exc:
            # An authorization server that echoes what it was sent does not put it in a log line.
            secrets = [credentials.secret, form.get("client_assertion")]
            raise TokenUnavailable(_scrubbed(str(exc), secrets)) from None


def _method(credentials: ClientCredentials, server: AuthorizationServer) -> AuthMethod:
    if credentials.method is not None:
        return credentials.method
    if credentials.private_key_pem is not None:
        return "private_key_jwt"
    if "client_secret_basic" not in server.methods and "client_secret_post" in server.methods:
        return "client_secret_post"
    return "client_secret_basic"


def _basic(client_id: str, secret: str) -> str:
    """RFC 6749 §2.3.1: each part form-encoded, then ``id:secret`` in base64."""
    from urllib.parse import quote_plus  # noqa: PLC0415

    pair = f"{quote_plus(client_id)}:{quote_plus(secret)}".encode()
    return "Basic " + base64.b64encode(pair).decode("ascii")


_ERROR_CODE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _scrubbed(text: str, secrets: Sequence[str | None]) -> str:
    """``text`` with each of ``secrets`` (a client secret, an assertion, a token) in it replaced."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "[redacted]")
    return text


def _token_answer(answer: httpx2.Response, endpoint: str) -> tuple[str, float | None]:
    body: Mapping[str, Any] = {}
    try:
        parsed = answer.json() if len(answer.content) <= MAX_DOCUMENT_BYTES else None
        if isinstance(parsed, dict):
            body = parsed
    except ValueError:
        pass
    if answer.status_code != 200:
        error = body.get("error")
        said = f": {error}" if isinstance(error, str) and _ERROR_CODE.match(error) else ""
        description = body.get("error_description")
        if isinstance(description, str):
            said += f" ({description[:200]})"
        raise TokenUnavailable(
            f"the token endpoint {endpoint} refused the request: HTTP {answer.status_code}{said}"
        )
    token = body.get("access_token")
    kind = body.get("token_type")
    if not isinstance(token, str) or not token:
        raise TokenUnavailable(f"the token endpoint {endpoint} answered without an access_token")
    if not isinstance(kind, str) or kind.lower() != "bearer":
        raise TokenUnavailable(f"the token endpoint {endpoint} gave a {kind!r} token, not a Bearer token")
    expires = body.get("expires_in")
    lifetime = (
        float(expires)
        if isinstance(expires, int | float) and not isinstance(expires, bool) and expires > 0
        else None
    )
    return token, lifetime
