"""Conformance peer: an OAuth 2.1 authorization server for machine-to-machine MCP (client credentials).

Run with the oauth-sdk-py venv from scripts/install-peers:
    python oauth_as.py --port N --config clients.json

Authlib's framework-free server core (`authlib.oauth2.rfc6749.AuthorizationServer`) does the protocol: its
`ClientCredentialsGrant`, its client authentication (client_secret_basic, client_secret_post and, through
`rfc7523.JWTBearerClientAssertion`, private_key_jwt), its bearer token generator and its RFC 7662
`IntrospectionEndpoint`. Authlib ships server integrations for Flask and Django only, so the few lines that
turn a Starlette request into an `OAuth2Request` are here. The MCP SDK's own `mcp.server.auth` has no
client_credentials grant (authorization_code and refresh_token only), so it cannot be the server.
What Authlib lacks is added here: RFC 8707 `resource` (`invalid_target`), the RFC 8414 document, and the
test controls.

The config file (JSON):
    {"resources": ["http://127.0.0.1:P/mcp"], "token_lifetime_s": 300, "scopes": ["reports"],
     "clients": [{"client_id": "a", "client_secret": "s", "scope": "reports"},
                 {"client_id": "b", "jwk": {...public JWK...}},
                 {"client_id": "rs", "client_secret": "s", "introspection": true}]}
A client with a secret authenticates with client_secret_basic or client_secret_post, one with a `jwk` with
private_key_jwt (RS256 or ES256); an `introspection` client may only introspect.

Tokens are opaque and live in memory; the resource server introspects them. A token requested without
`resource` has no audience (an MCP resource server refuses it: the MCP auth spec makes `resource` a MUST).

Test controls, JSON over HTTP, loopback only (the server binds 127.0.0.1 and checks the peer address):
    POST   /_control/revoke            {"client_id": "a"}   its tokens go inactive; it gets no new token
    POST   /_control/token-lifetime    {"seconds": 3}       lifetime of tokens issued from now on
    POST   /_control/token-unavailable {"count": 2}         the next N token requests answer 503
    GET    /_control/log                                     the token requests, oldest first (no secrets)
    GET    /_control/issued                                  every access token issued (a test greps for them)
    DELETE /_control/log
    DELETE /_control/faults                                  undo revokes, lifetime and 503s
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from authlib.oauth2.rfc6749 import (
    AuthorizationServer,
    ClientMixin,
    InvalidClientError,
    OAuth2Error,
    OAuth2Payload,
    OAuth2Request,
    TokenMixin,
    grants,
)
from authlib.oauth2.rfc6749.util import extract_basic_authorization, scope_to_list
from authlib.oauth2.rfc6750 import BearerTokenGenerator
from authlib.oauth2.rfc7523 import JWTBearerClientAssertion
from authlib.oauth2.rfc7662 import IntrospectionEndpoint
from authlib.oauth2.rfc8414 import AuthorizationServerMetadata
from joserfc import jwk
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

SECRET_METHODS = ("client_secret_basic", "client_secret_post")
PRIVATE_KEY_JWT = "private_key_jwt"
ASSERTION_ALGORITHMS = ("RS256", "ES256")
LOOPBACK = {"127.0.0.1", "::1"}


class InvalidTargetError(OAuth2Error):
    """RFC 8707 §2: the requested resource is invalid, unknown or malformed."""

    error = "invalid_target"


@dataclass
class Client(ClientMixin):
    client_id: str
    client_secret: str | None = None
    public_jwk: dict[str, Any] | None = None
    scope: str = ""
    introspection: bool = False

    def get_client_id(self) -> str:
        return self.client_id

    def get_default_redirect_uri(self) -> None:
        return None

    def get_allowed_scope(self, scope: str | None) -> str:
        allowed = scope_to_list(self.scope) or []
        if scope is None:  # RFC 6749 §3.3: an omitted scope gets the client's default, all it may have
            return " ".join(allowed)
        return " ".join(item for item in scope_to_list(scope) if item in allowed)

    def check_redirect_uri(self, redirect_uri: str) -> bool:
        return False

    def check_client_secret(self, client_secret: str) -> bool:
        return self.client_secret is not None and secrets.compare_digest(self.client_secret, client_secret)

    def check_endpoint_auth_method(self, method: str, endpoint: str) -> bool:
        if endpoint == "introspection":
            return self.introspection and method in SECRET_METHODS and self.client_secret is not None
        if self.introspection:
            return False
        if method == PRIVATE_KEY_JWT:
            return self.public_jwk is not None
        return method in SECRET_METHODS and self.client_secret is not None

    def check_response_type(self, response_type: str) -> bool:
        return False

    def check_grant_type(self, grant_type: str) -> bool:
        return grant_type == "client_credentials" and not self.introspection


@dataclass
class Token(TokenMixin):
    access_token: str
    client_id: str
    scope: str
    audience: list[str]
    issued_at: int
    expires_at: int
    state: State

    def check_client(self, client: Client) -> bool:
        return client.client_id == self.client_id

    def get_scope(self) -> str:
        return self.scope

    def get_expires_in(self) -> int:
        return self.expires_at - self.issued_at

    def is_expired(self) -> bool:
        return time.time() >= self.expires_at

    def is_revoked(self) -> bool:
        return self.client_id in self.state.revoked


@dataclass
class State:
    """Everything the server holds; one lock, since uvicorn runs the sync handlers one at a time anyway."""

    issuer: str
    resources: list[str]
    scopes: list[str]
    clients: dict[str, Client]
    default_lifetime_s: int
    lifetime_s: int = 0
    revoked: set[str] = field(default_factory=set)
    unavailable: int = 0
    tokens: dict[str, Token] = field(default_factory=dict)
    seen_jti: set[tuple[str, str]] = field(default_factory=set)
    log: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def token_endpoint(self) -> str:
        return f"{self.issuer}/token"

    @property
    def introspection_endpoint(self) -> str:
        return f"{self.issuer}/introspect"

    def reset_faults(self) -> None:
        self.revoked.clear()
        self.lifetime_s = self.default_lifetime_s
        self.unavailable = 0


class FormPayload(OAuth2Payload):
    def __init__(self, items: list[tuple[str, str]]) -> None:
        self._datalist: defaultdict[str, list[str]] = defaultdict(list)
        for key, value in items:
            self._datalist[key].append(value)
        self._data = {key: values[0] for key, values in self._datalist.items()}

    @property
    def data(self) -> dict[str, str]:
        return self._data

    @property
    def datalist(self) -> defaultdict[str, list[str]]:
        return self._datalist


class FormRequest(OAuth2Request):
    """The Starlette side of Authlib's request model (what its Flask integration does for Flask)."""

    def __init__(self, method: str, uri: str, headers: Headers, items: list[tuple[str, str]]) -> None:
        super().__init__(method=method, uri=uri, headers=headers)
        self.payload = FormPayload(items)

    @property
    def args(self) -> dict[str, str]:
        return {}

    @property
    def form(self) -> dict[str, str]:
        data: dict[str, str] = self.payload.data
        return data


class ClientCredentialsGrant(grants.ClientCredentialsGrant):
    TOKEN_ENDPOINT_AUTH_METHODS = [*SECRET_METHODS, PRIVATE_KEY_JWT]  # noqa: RUF012  (Authlib's class API)

    def validate_token_request(self) -> None:
        super().validate_token_request()
        state: State = self.server.state
        for resource in self.request.payload.datalist.get("resource", []):
            parts = urlsplit(resource)
            if not parts.scheme or parts.fragment:  # RFC 8707 §2: an absolute URI without a fragment
                raise InvalidTargetError(description="resource must be an absolute URI without a fragment")
            if resource not in state.resources:
                raise InvalidTargetError(description=f"this server issues no tokens for {resource}")


class PrivateKeyJWT(JWTBearerClientAssertion):
    """RFC 7523 §2.2 client authentication: iss = sub = client_id, aud, exp and a jti never seen before."""

    CLIENT_AUTH_METHOD = PRIVATE_KEY_JWT

    def __init__(self, state: State) -> None:
        super().__init__(validate_jti=True, leeway=5)
        self.state = state

    def get_audiences(self) -> list[str]:
        # RFC 7523 §3: the aud identifies the authorization server; the token endpoint URL may be used.
        return [self.state.token_endpoint, self.state.issuer]

    def extract_assertion(self, assertion: str) -> tuple[dict[str, Any], dict[str, Any]]:
        headers, claims = super().extract_assertion(assertion)
        if headers.get("alg") not in ASSERTION_ALGORITHMS:
            raise InvalidClientError(
                description=f"client_assertion alg must be one of {ASSERTION_ALGORITHMS}"
            )
        return headers, claims

    def validate_jti(self, claims: dict[str, Any], jti: str) -> bool:
        key = (str(claims["sub"]), str(jti))
        if key in self.state.seen_jti:
            return False
        self.state.seen_jti.add(key)
        return True

    def resolve_client_public_key(self, client: Client) -> jwk.Key:
        return jwk.import_key(client.public_jwk)


class Introspection(IntrospectionEndpoint):
    CLIENT_AUTH_METHODS = list(SECRET_METHODS)  # noqa: RUF012  (Authlib's class API)
    SUPPORTED_TOKEN_TYPES = ("access_token",)

    def query_token(self, token_string: str, token_type_hint: str | None) -> Token | None:
        state: State = self.server.state
        return state.tokens.get(token_string)

    def check_permission(self, token: Token, client: Client, request: OAuth2Request) -> bool:
        return client.introspection

    def introspect_token(self, token: Token) -> dict[str, Any]:
        state: State = self.server.state
        audience: str | list[str] | None = token.audience[0] if len(token.audience) == 1 else token.audience
        answer: dict[str, Any] = {
            "active": True,
            "client_id": token.client_id,
            "sub": token.client_id,
            "scope": token.scope,
            "token_type": "Bearer",
            "iss": state.issuer,
            "iat": token.issued_at,
            "exp": token.expires_at,
        }
        if audience:
            answer["aud"] = audience
        return answer


class Server(AuthorizationServer):
    def __init__(self, state: State) -> None:
        super().__init__(scopes_supported=state.scopes or None)
        self.state = state
        self.register_token_generator(
            "default",
            BearerTokenGenerator(
                access_token_generator=lambda **_: secrets.token_urlsafe(32),
                expires_generator=lambda client, grant_type: self.state.lifetime_s,
            ),
        )
        self.register_client_auth_method(PRIVATE_KEY_JWT, PrivateKeyJWT(state))
        self.register_grant(ClientCredentialsGrant)
        self.register_endpoint(Introspection)

    def query_client(self, client_id: str) -> Client | None:
        if client_id in self.state.revoked:
            return None
        return self.state.clients.get(client_id)

    def save_token(self, token: dict[str, Any], request: OAuth2Request) -> None:
        now = int(time.time())
        self.state.tokens[token["access_token"]] = Token(
            access_token=token["access_token"],
            client_id=request.client.client_id,
            scope=token.get("scope", ""),
            audience=list(request.payload.datalist.get("resource", [])),
            issued_at=now,
            expires_at=now + int(token["expires_in"]),
            state=self.state,
        )

    def create_oauth2_request(self, request: FormRequest) -> FormRequest:
        return request  # the handlers below build it from the Starlette request, whose form is async

    def send_signal(self, name: str, *args: Any, **kwargs: Any) -> None:
        return None

    def handle_response(self, status: int, body: Any, headers: list[tuple[str, str]]) -> Response:
        return JSONResponse(body, status_code=status, headers=dict(headers))

    def metadata(self) -> dict[str, Any]:
        state = self.state
        document = AuthorizationServerMetadata(
            {
                "issuer": state.issuer,
                "token_endpoint": state.token_endpoint,
                "token_endpoint_auth_methods_supported": [*SECRET_METHODS, PRIVATE_KEY_JWT],
                "token_endpoint_auth_signing_alg_values_supported": list(ASSERTION_ALGORITHMS),
                "grant_types_supported": ["client_credentials"],
                # RFC 8414 §2 makes it REQUIRED; no grant here uses the authorization endpoint.
                "response_types_supported": [],
                "scopes_supported": state.scopes,
                "introspection_endpoint": state.introspection_endpoint,
                "introspection_endpoint_auth_methods_supported": list(SECRET_METHODS),
            }
        )
        for key in document.REGISTRY_KEYS:
            if key != "response_types_supported":  # Authlib wants it non-empty; nothing here has one
                getattr(document, f"validate_{key}")()
        return dict(document)


def _claimed_client_id(request: FormRequest) -> str | None:
    """Who the request says it is, for the log (the secret and the assertion are never logged)."""
    basic_id, _ = extract_basic_authorization(request.headers)
    if basic_id:
        return str(basic_id)
    form = request.payload.data
    if form.get("client_id"):
        return str(form["client_id"])
    if form.get("client_assertion"):
        try:
            _, claims = JWTBearerClientAssertion().extract_assertion(form["client_assertion"])
        except OAuth2Error:
            return None
        sub = claims.get("sub")
        return sub if isinstance(sub, str) else None
    return None


def _auth_method_used(request: FormRequest) -> str | None:
    if request.auth_method:
        return str(request.auth_method)
    form = request.payload.data
    if form.get("client_assertion"):
        return PRIVATE_KEY_JWT
    if "authorization" in request.headers:  # Starlette's Headers: case-insensitive
        return "client_secret_basic"
    if form.get("client_secret"):
        return "client_secret_post"
    return None


def build_app(state: State) -> Starlette:
    server = Server(state)

    async def form_request(request: Request) -> FormRequest:
        form = await request.form()
        items = [(key, value) for key, value in form.multi_items() if isinstance(value, str)]
        return FormRequest(request.method, str(request.url), request.headers, items)

    async def metadata(request: Request) -> Response:
        return JSONResponse(server.metadata())

    async def token(request: Request) -> Response:
        oauth_request = await form_request(request)
        entry: dict[str, Any] = {
            "time": time.time(),
            "grant_type": oauth_request.payload.data.get("grant_type"),
            "scope": oauth_request.payload.data.get("scope"),
            "resource": oauth_request.payload.datalist.get("resource", []),
        }
        with state.lock:
            if state.unavailable > 0:
                state.unavailable -= 1
                response: Response = JSONResponse(
                    {"error": "temporarily_unavailable", "error_description": "test fault: 503"},
                    status_code=503,
                    headers={"Retry-After": "1", "Cache-Control": "no-store"},
                )
            else:
                response = server.create_token_response(oauth_request)
            body = json.loads(bytes(response.body))
            entry |= {
                "client_id": oauth_request.client.client_id
                if oauth_request.client
                else _claimed_client_id(oauth_request),
                "auth_method": _auth_method_used(oauth_request),
                "status": response.status_code,
                "outcome": "issued" if response.status_code == 200 else body.get("error"),
                "granted_scope": body.get("scope") if response.status_code == 200 else None,
                "expires_in": body.get("expires_in") if response.status_code == 200 else None,
            }
            state.log.append(entry)
        return response

    async def introspect(request: Request) -> Response:
        oauth_request = await form_request(request)
        with state.lock:
            response: Response = server.create_endpoint_response("introspection", oauth_request)
        return response

    def loopback_only(request: Request) -> Response | None:
        if request.client is None or request.client.host not in LOOPBACK:
            return JSONResponse({"error": "forbidden"}, status_code=403)
        return None

    async def control(request: Request) -> Response:
        if (refused := loopback_only(request)) is not None:
            return refused
        what = request.path_params["what"]
        body: dict[str, Any] = await request.json() if request.method == "POST" else {}
        with state.lock:
            if (what, request.method) == ("revoke", "POST"):
                state.revoked.add(str(body["client_id"]))
            elif (what, request.method) == ("token-lifetime", "POST"):
                state.lifetime_s = int(body["seconds"])
            elif (what, request.method) == ("token-unavailable", "POST"):
                state.unavailable = int(body["count"])
            elif (what, request.method) == ("log", "GET"):
                return JSONResponse(state.log)
            elif (what, request.method) == ("issued", "GET"):
                # Every access token issued so far, for a test that looks for them where none may be.
                return JSONResponse(sorted(state.tokens))
            elif (what, request.method) == ("log", "DELETE"):
                state.log.clear()
            elif (what, request.method) == ("faults", "DELETE"):
                state.reset_faults()
            else:
                return JSONResponse({"error": "unknown control"}, status_code=404)
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/.well-known/oauth-authorization-server", metadata, methods=["GET"]),
            Route("/token", token, methods=["POST"]),
            Route("/introspect", introspect, methods=["POST"]),
            Route("/_control/{what}", control, methods=["GET", "POST", "DELETE"]),
        ]
    )


def load_state(config_path: Path, issuer: str) -> State:
    config = json.loads(config_path.read_text())
    clients = {
        item["client_id"]: Client(
            client_id=item["client_id"],
            client_secret=item.get("client_secret"),
            public_jwk=item.get("jwk"),
            scope=item.get("scope", ""),
            introspection=bool(item.get("introspection", False)),
        )
        for item in config["clients"]
    }
    lifetime = int(config.get("token_lifetime_s", 300))
    return State(
        issuer=issuer,
        resources=list(config["resources"]),
        scopes=list(config.get("scopes", [])),
        clients=clients,
        default_lifetime_s=lifetime,
        lifetime_s=lifetime,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", type=Path, required=True)
    args = parser.parse_args()
    if args.host not in LOOPBACK:
        parser.error("a test peer listens on loopback only")
    os.environ.pop("AUTHLIB_INSECURE_TRANSPORT", None)  # loopback http is allowed without it
    state = load_state(args.config, f"http://{args.host}:{args.port}")
    uvicorn.run(build_app(state), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
