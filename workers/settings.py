"""One typed settings object: the environment (``LONGCALL_*``) plus the TOML file of servers it names.

Built once, by the app factory or the CLI, never at import time. Unknown keys and bad values are refused
with a message that names the key, the file and what was wrong.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from workers import __version__
from workers.errors import ConfigError

if TYPE_CHECKING:
    from adapters import ClientCredentials

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
CREATE_SPEC = re.compile(r"^(GET|POST|PUT|PATCH|DELETE) (/\S*)$")

PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]

#: The Redis broker's visibility timeout by default (``workers.app``; ``redis_visibility_timeout_s``): a
#: message not acknowledged within it is delivered again, so a countdown or ETA message outliving it runs
#: twice, and a message held by a worker that was killed comes back only then.
REDIS_VISIBILITY_TIMEOUT_S = 3600
#: How far inside the visibility timeout a downstream signature's countdown or ETA must end: the message
#: is reserved at publish and may wait in a busy worker's prefetch before its countdown even starts (at
#: most a quarter of a shorter visibility timeout).
CALLBACK_DELAY_MARGIN_S = 300
REDIS_BROKERS = frozenset({"redis", "rediss", "sentinel"})
#: The Redis broker URLs Celery takes as a result backend as they are (beside a Redis Cluster, the results go
#: to the broker's Redis).
REDIS_RESULT_BACKENDS = frozenset({"redis", "rediss", "redis+socket"})
#: RabbitMQ's default ``consumer_timeout``: a delivery a consumer holds unacknowledged longer than this closes
#: the worker's channel (PRECONDITION_FAILED), the Celery worker exits ("Unrecoverable error") and the
#: message is delivered again. A held countdown/ETA message and a long synchronous call both hold theirs.
AMQP_CONSUMER_TIMEOUT_S = 1800
AMQP_BROKERS = frozenset({"amqp", "amqps", "pyamqp", "librabbitmq"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class ToolConfig(_Strict):
    #: A tool without task support may run as one synchronous call for at most this long.
    sync_upper_bound_s: PositiveFloat | None = None
    #: AIP-151: the create call, "METHOD /path/{placeholder}"; placeholders are filled from the arguments.
    create: str | None = None
    #: AIP-155: the body field that carries the submission key.
    request_id_field: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    #: The tool changes nothing outside its answer (a read, a report): running it twice is harmless, so
    #: shadow mode (``longcall rollout --shadow on``) may run it beside the caller's legacy path, receipted
    #: and never delivered. A tool without it is never shadowed.
    side_effect_free: bool = False

    @field_validator("create")
    @classmethod
    def _create_spec(cls, value: str | None) -> str | None:
        if value is not None and not CREATE_SPEC.match(value):
            raise ValueError('must look like "POST /v1/jobs:run" (an HTTP method, one space, a path)')
        return value


def _env_name(value: str | None, holding: str) -> str | None:
    if value is not None and not ENV_NAME.match(value):
        raise ValueError(f"must be the NAME of an environment variable holding {holding}, not the value")
    return value


def _variable(key: str, name: str) -> str:
    """The value of the environment variable ``name`` that the key ``key`` names (never logged).

    Raises:
        ConfigError: it is not set, or empty.
    """
    value = os.environ.get(name)
    if not value:
        raise ConfigError(
            f"{key} {name!r} is configured but that environment variable is not set or is empty"
        )
    return value


class BearerAuth(_Strict):
    """A static bearer token (as ``auth_env`` / ``auth_file`` give it)."""

    kind: Literal["bearer"]
    #: The name of the variable that holds the token, read before every request.
    token_env: str | None = None
    #: Or a file holding it, read again whenever it changed (``read_token_file``).
    token_file: Path | None = None

    @field_validator("token_env")
    @classmethod
    def _token_env(cls, value: str | None) -> str | None:
        return _env_name(value, "the token")

    @model_validator(mode="after")
    def _one_source(self) -> BearerAuth:
        if (self.token_env is None) == (self.token_file is None):
            raise ValueError("set token_env or token_file (one of them)")
        return self


class OAuthClientCredentialsAuth(_Strict):
    """OAuth 2.1 client credentials (MCP's ``io.modelcontextprotocol/oauth-client-credentials``): a token
    asked of the authorization server the server's metadata names (or ``token_url``), cached per worker
    process and renewed before it expires (``adapters.oauth``). The secret, or the private key, is read
    from the environment or a file when a token is asked for, never stored."""

    kind: Literal["oauth_client_credentials"]
    client_id_env: str
    #: ``client_secret_basic`` / ``client_secret_post``: the variable holding the client's secret.
    client_secret_env: str | None = None
    #: ``private_key_jwt`` (RFC 7523, recommended): a PEM file holding the client's RSA or P-256 key, and
    #: the ``kid`` its public key is registered under at the authorization server.
    private_key_file: Path | None = None
    key_id: Annotated[str, Field(min_length=1)] | None = None
    #: Force one method (by default: ``private_key_jwt`` with a key; with a secret, ``client_secret_basic``
    #: unless the authorization server lists only ``client_secret_post``).
    token_endpoint_auth_method: (
        Literal["client_secret_basic", "client_secret_post", "private_key_jwt"] | None
    ) = None
    scope: Annotated[str, Field(min_length=1)] | None = None
    #: The token endpoint; by default discovered from the server (RFC 9728, then RFC 8414).
    token_url: Annotated[str, Field(pattern=r"^https?://[^\s/]+(/\S*)?$")] | None = None

    @field_validator("client_id_env", "client_secret_env")
    @classmethod
    def _names(cls, value: str | None) -> str | None:
        return _env_name(value, "it")

    @field_validator("token_url")
    @classmethod
    def _token_url(cls, value: str | None) -> str | None:
        """https (plain http on loopback only, as discovery requires), with no credentials or query in it."""
        if value is None:
            return value
        parts = urlsplit(value)
        if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
            raise ValueError("must be the token endpoint's URL alone (no user:password, query or fragment)")
        loopback = parts.hostname in ("localhost", "127.0.0.1", "::1")
        if parts.scheme != "https" and not (parts.scheme == "http" and loopback):
            raise ValueError("must be https (plain http is accepted on loopback only)")
        return value

    @model_validator(mode="after")
    def _one_proof(self) -> OAuthClientCredentialsAuth:
        if (self.client_secret_env is None) == (self.private_key_file is None):
            raise ValueError("set client_secret_env or private_key_file (one of them)")
        if self.key_id is not None and self.private_key_file is None:
            raise ValueError("key_id goes with private_key_file")
        method = self.token_endpoint_auth_method
        if method == "private_key_jwt" and self.private_key_file is None:
            raise ValueError("token_endpoint_auth_method private_key_jwt needs private_key_file")
        if method in ("client_secret_basic", "client_secret_post") and self.client_secret_env is None:
            raise ValueError(f"token_endpoint_auth_method {method} needs client_secret_env")
        return self

    def credentials(self, key: str) -> ClientCredentials:
        """The client's credentials as the environment and the key file hold them now (read at each token
        request, never kept beyond it). ``key``: ``servers.X.auth``, for the errors.

        Raises:
            ConfigError: a variable is not set or empty, or the key file cannot be read.
        """
        from adapters import ClientCredentials  # noqa: PLC0415 - HTTP, for a worker that sends

        return ClientCredentials(
            client_id=_variable(f"{key}.client_id_env", self.client_id_env),
            secret=None
            if self.client_secret_env is None
            else _variable(f"{key}.client_secret_env", self.client_secret_env),
            private_key_pem=None if self.private_key_file is None else self.private_key(key),
            key_id=self.key_id,
            method=self.token_endpoint_auth_method,
            scope=self.scope,
        )

    def private_key(self, key: str = "auth") -> bytes:
        """The PEM key file as it is now (read at each token request: a rotated key needs no restart).

        Raises:
            ConfigError: the file cannot be read or holds no PEM private key.
        """
        if self.private_key_file is None:
            raise ConfigError(f"{key}.private_key_file is not set")
        try:
            pem = self.private_key_file.read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"{key}.private_key_file {str(self.private_key_file)!r} cannot be read: {exc.strerror}"
            ) from None
        if b"PRIVATE KEY-----" not in pem:
            raise ConfigError(
                f"{key}.private_key_file {str(self.private_key_file)!r} holds no PEM private key"
            )
        return pem


class GoogleAuth(_Strict):
    """Google's access tokens (an AIP-151 API on Google Cloud): google-auth's credentials, from a service
    account's key file or, without one, Application Default Credentials (workload identity, the metadata
    server); cached per worker process and renewed before they expire (``adapters.GoogleToken``). Needs
    the ``google`` extra."""

    kind: Literal["google"]
    credentials_file: Path | None = None
    scopes: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] = Field(
        default_factory=lambda: ["https://www.googleapis.com/auth/cloud-platform"]
    )


AuthConfig = Annotated[BearerAuth | OAuthClientCredentialsAuth | GoogleAuth, Field(discriminator="kind")]


class ServerConfig(_Strict):
    #: One of the protocols an adapter is shipped for (``adapters.SHIPPED``).
    protocol: str
    protocol_version: Annotated[str, Field(min_length=1)]
    url: Annotated[str, Field(pattern=r"^https?://[^\s/]+(/\S*)?$")]
    #: The bearer token is read from this environment variable before every request; it is never stored.
    auth_env: str | None = None
    #: Or from this file (stripped), checked before every request and read again whenever it changed: rotate
    #: the token by rewriting the file (a mounted secret), no restart needed. At most one of ``auth_env``
    #: and ``auth_file``.
    auth_file: Path | None = None
    #: How requests to the server are authorized (``[servers.X.auth]``), instead of ``auth_env`` /
    #: ``auth_file``: ``kind = "bearer"`` (the same, as a table) or ``"oauth_client_credentials"``.
    auth: AuthConfig | None = None
    poll_qps: PositiveFloat = 10.0
    control_qps: PositiveFloat = 5.0
    default_ttl_ms: PositiveInt = 600_000
    wait_budget_s: PositiveFloat = 3600.0
    #: Poll interval when the server gives none.
    default_poll_interval_ms: PositiveInt = 1000
    #: Read the task's status (on the control budget) before ``tasks/cancel`` and send no cancel for a task
    #: already terminal: for a server that answers "cancelled" to a cancel of a completed task (FastMCP).
    #: Off by default: the cancel is sent first and a "-32602 already terminal" answer is read after.
    read_status_before_cancel: bool = False
    tools: dict[str, ToolConfig] = Field(default_factory=dict)

    @field_validator("protocol", mode="before")
    @classmethod
    def _shipped_protocol(cls, value: object) -> object:
        from adapters import SHIPPED  # noqa: PLC0415 - HTTP and the protocols, for a fleet that has servers

        protocols = SHIPPED.protocols()
        if value not in protocols:  # worded as pydantic words a Literal's refusal
            *others, last = (repr(p) for p in protocols)
            expected = f"{', '.join(others)} or {last}" if others else last
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
        return value

    @field_validator("auth_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not ENV_NAME.match(value):
            raise ValueError("must be the NAME of an environment variable holding the token, not the token")
        return value

    @model_validator(mode="after")
    def _one_token_source(self) -> ServerConfig:
        if self.auth_env is not None and self.auth_file is not None:
            raise ValueError("set auth_env or auth_file, not both")
        if self.auth is not None and (self.auth_env is not None or self.auth_file is not None):
            raise ValueError("set [auth] or auth_env / auth_file, not both")
        return self

    @model_validator(mode="after")
    def _tools_suit_the_protocol(self) -> ServerConfig:
        """The tools checked as the server's protocol version says (its spec's ``check_config``): AIP-151
        tools are started by their configured route; MCP tools are discovered, so a route on one is a
        mistake, refused rather than ignored."""
        from adapters import SHIPPED  # noqa: PLC0415

        SHIPPED.check_config(self.protocol, self.protocol_version, self.tools)
        return self

    def token(self) -> str | None:
        """The bearer token as the named variable or file holds it now (never logged; the file is read
        again whenever it changed: :func:`read_token_file`).

        Raises:
            ConfigError: the variable is empty, or the file cannot be read or is empty.
        """
        if isinstance(self.auth, BearerAuth):
            if self.auth.token_file is not None:
                return read_token_file(self.auth.token_file)
            if self.auth.token_env is not None:
                return _variable("auth.token_env", self.auth.token_env)
        if isinstance(self.auth, OAuthClientCredentialsAuth):
            raise TypeError(
                "an OAuth server's token comes from its provider (workers.auth), not from token()"
            )
        if self.auth_file is not None:
            return read_token_file(self.auth_file)
        if self.auth_env is None:
            return None
        variable = os.environ.get(self.auth_env)
        if not variable:
            raise ConfigError(
                f"auth_env {self.auth_env!r} is configured but that environment variable is empty"
            )
        return variable


#: Each token file's last read: what ``stat`` said of the file then, and the token it held.
_token_reads: dict[Path, tuple[tuple[int, int, int, int], str]] = {}


def read_token_file(path: Path) -> str:
    """The token in ``path`` (stripped), as the file is now: read again whenever the file changed since its
    last read (another file, another size, a new modification or change time: a rewrite, or a mounted
    secret's atomic swap), so a rotated token is sent from the next request on. An unchanged file costs
    a ``stat`` per request, not an open and a read (~20 us of a status read's CPU).

    Raises:
        ConfigError: the file cannot be read, or is empty.
    """
    try:
        stat = path.stat()
        seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        last = _token_reads.get(path)
        if last is not None and last[0] == seen:
            return last[1]
        value = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"auth_file {str(path)!r} cannot be read: {exc.strerror}") from None
    if not value:
        raise ConfigError(f"auth_file {str(path)!r} is empty")
    # Changed between the stat and the read: its next stat differs from this one, so it is read again.
    _token_reads[path] = (seen, value)
    return value


class FleetConfig(_Strict):
    servers: dict[str, ServerConfig] = Field(default_factory=dict)

    @field_validator("servers")
    @classmethod
    def _server_names(cls, value: dict[str, ServerConfig]) -> dict[str, ServerConfig]:
        for name in value:
            if not re.match(r"^[A-Za-z0-9_.-]{1,64}$", name):
                raise ValueError(f"server name {name!r}: use letters, digits, '_', '.', '-' (at most 64)")
        return value

    @classmethod
    def from_toml(cls, path: Path) -> FleetConfig:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"LONGCALL_CONFIG names {path}, which does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"{path}: {_explain(exc)}") from exc


class Settings(BaseSettings):
    """The environment. Defaults run a fleet against a local Postgres and Redis."""

    model_config = SettingsConfigDict(env_prefix="LONGCALL_", extra="ignore", frozen=True)

    database_url: str = "postgresql://postgres@127.0.0.1:5432/longcall"
    #: longcall's own Redis: the hot state (buckets, holds, the cancel CAS, the request meter) and, unless
    #: ``redis_cluster``, the Celery result backend and the default broker.
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: ``redis_url`` names one node of a Redis Cluster: every Redis client longcall owns (the hot state in
    #: the workers, ``longcall metrics``, ``longcall gate``, ``longcall gate simulate``) connects in cluster
    #: mode, and finds the other nodes from that one. A cluster is neither a Celery broker nor a result
    #: backend: ``broker_url`` is then required (a standalone Redis or a RabbitMQ), and the results go where
    #: :attr:`result_backend` says.
    redis_cluster: bool = False
    #: Defaults to ``redis_url`` (required with ``redis_cluster``).
    broker_url: Annotated[str | None, Field(validate_default=True)] = None
    #: The TOML file of servers (DESIGN §7).
    config: Path | None = None
    #: A prefix for every broker key, to share one Redis between fleets (or test runs).
    broker_keyprefix: str = ""
    dispatch_interval_s: PositiveFloat = 0.25
    outbox_interval_s: PositiveFloat = 1.0
    reconcile_interval_s: PositiveFloat = 30.0
    #: The largest arguments body accepted by ``longcall.submit``, in bytes of canonical JSON.
    max_body_bytes: PositiveInt = 1_048_576
    #: How long a claimed operation is held by one worker before another may take it over.
    lease_s: PositiveFloat = 30.0
    #: How long the approval gate has to answer an input request.
    input_timeout_s: PositiveFloat = 3600.0
    #: How long a server may say it waits for input while its request cannot be read (the stream that
    #: carried it was cut and neither a resumption nor a re-read brings it back) before an operator is
    #: asked (rule 10; reconciliation reason INPUT_UNREADABLE).
    input_unreadable_s: PositiveFloat = 60.0
    #: How long an operator has to resolve a reconciliation record: the seed's gate (an UNKNOWN resolved
    #: within 15 minutes). A record past it is flagged overdue (``longcall reconcile`` shows it).
    reconcile_deadline_s: PositiveFloat = 900.0
    #: How long the events of a final operation are kept (its row and receipt are kept forever).
    event_retention_s: PositiveFloat = 30 * 86_400.0
    #: How long an outbox row is kept once dispatched (a ready row is never deleted).
    outbox_retention_s: PositiveFloat = 7 * 86_400.0
    #: How many due operations one dispatch_due tick claims at most.
    dispatch_batch: PositiveInt = 500
    #: How many claimed polls of one server travel in one ``longcall.poll`` message, run side by side by the
    #: worker that takes it (rule 3); 1: one operation per message. A message's own cost (its Celery
    #: delivery, publish, the batch's read, slot booking and record: about 7 ms of worker CPU on the bench's
    #: machine) is shared by its members: 64 rather than 32 cut an unchanged poll's worker CPU by about a
    #: tenth at 120 polls of a server a tick (``docs/scaling.md``, issue 21's fifteenth part).
    poll_batch: PositiveInt = 64
    #: What sends the status reads of the polls (the requests a poll's budget paid for): ``httptools``, on
    #: sockets of the worker's own, answers parsed in C (``adapters/socket_transport.py``), on the
    #: member's own thread; ``aiohttp``, on one event loop thread of each worker process
    #: (``adapters/loop_transport.py``: less CPU than httpx2 where a process's reads overlap, more where
    #: each goes alone); ``httpx2``, on
    #: httpx2's own transport, as every other request is sent. Measured in ``docs/scaling.md``.
    status_reads: Literal["httptools", "aiohttp", "httpx2"] = "httptools"
    #: How long a result that contradicts the observed terminal state (an error for a completed task) is
    #: read again before an operator gets the operation (reason RESULT_CONTRADICTS_STATUS).
    result_contradiction_s: PositiveFloat = 300.0
    #: The largest result accepted, in bytes of canonical JSON; a larger one goes to an operator
    #: (reason RESULT_UNSTORABLE) rather than into the ledger, the outbox and the broker.
    max_result_bytes: PositiveInt = 8_388_608
    #: The executor identity this fleet runs under (rule 13): ``longcall rollback`` records which identity
    #: owns the new epoch, and a fleet of another identity claims and writes nothing from then on. Defaults
    #: to the package version, which a rolling deploy changes.
    executor_id: Annotated[str, Field(min_length=1, max_length=200)] = f"longcall/{__version__}"
    #: How long a message sent by name (``longcall.submit``, ``cancel``, ``provide_input``) is retried
    #: through a Postgres, Redis or broker fault before it fails, loudly, with the fault named (rule 3: every
    #: retry loop has a bound). Its backoff grows to ``INTENT_RETRY_MAX_PAUSE_S``.
    intent_retry_s: PositiveFloat = 3600.0
    #: How many times an outbox row's publish may fail (a broker that refuses it, not one that is down)
    #: before it is dead-lettered for an operator (rule 9), and the longest pause between two attempts.
    outbox_max_attempts: PositiveInt = 10
    outbox_retry_max_s: PositiveFloat = 300.0
    #: How long a result read may keep failing the same way (a refusal, an unparsable answer, a protocol
    #: violation, a server that does not answer) before an operator gets the operation (RESULT_UNREADABLE).
    result_retry_s: PositiveFloat = 300.0
    #: How long an answered input round may stay unacknowledged (its stored reply not taken by the server)
    #: or still shown by the server before an operator is asked (INPUT_REPLY_NOT_TAKEN, rule 10).
    input_reply_s: PositiveFloat = 120.0
    #: The Redis broker's visibility timeout: how soon a message a killed worker held (a submission being
    #: recorded, a step) is delivered again. Every longcall message is safe to run twice (the ledger fences
    #: it), but it must outlast the longest step (a synchronous call: ``sync_upper_bound_s``) and any
    #: countdown a message carries (a downstream signature's: ``max_callback_delay_s``).
    redis_visibility_timeout_s: Annotated[int, Field(ge=10)] = REDIS_VISIBILITY_TIMEOUT_S

    @field_validator("broker_url")
    @classmethod
    def _broker_beside_a_cluster(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("redis_cluster"):
            if value is None:
                raise ValueError(
                    "required with LONGCALL_REDIS_CLUSTER on: a Redis Cluster cannot be the Celery broker "
                    "nor its result backend; name a standalone Redis or a RabbitMQ"
                )
            if value == info.data.get("redis_url"):
                raise ValueError(
                    "names the Redis Cluster of LONGCALL_REDIS_URL, which cannot be the Celery broker; "
                    "name a standalone Redis or a RabbitMQ"
                )
        return value

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def result_backend(self) -> str:
        """Where the workers keep the results of the tasks a caller may wait on (``longcall.submit``,
        ``longcall.cancel``, ``longcall.provide_input``; every other task keeps none): ``redis_url``; with
        ``redis_cluster``, the broker's Redis when the broker is a standalone Redis, else ``rpc://`` (each
        result sent back as a message on the broker, to the caller that sent the task: for RabbitMQ). A
        caller waiting on a result reads it from the same place (its Celery app's ``result_backend``)."""
        if not self.redis_cluster:
            return self.redis_url
        if self.broker.partition("://")[0].lower() in REDIS_RESULT_BACKENDS:
            return self.broker
        return "rpc://"

    @property
    def max_callback_delay_s(self) -> float | None:
        """The longest countdown (or ETA ahead) an ``on_terminal`` / ``on_input`` signature may carry: a
        delayed message is held unacknowledged by the worker that reserved it, so it must end inside the
        Redis broker's visibility timeout (a longer one is delivered twice) or RabbitMQ's consumer timeout
        (a longer one makes the worker that holds it exit and the message come back). None: a broker with
        neither limit known."""
        return self.max_held_delivery_s

    @property
    def max_held_delivery_s(self) -> float | None:
        """How long a worker may hold one delivery unacknowledged on this broker (with ``task_acks_late``):
        a countdown, or a step that runs long (a synchronous call of up to ``sync_upper_bound_s``)."""
        transport = self.broker.partition("://")[0].lower().partition("+")[0]
        if transport in REDIS_BROKERS:
            visibility = self.redis_visibility_timeout_s
            return float(visibility - min(CALLBACK_DELAY_MARGIN_S, visibility // 4))
        if transport in AMQP_BROKERS:
            return float(AMQP_CONSUMER_TIMEOUT_S - CALLBACK_DELAY_MARGIN_S)
        return None

    def checked_fleet(self) -> FleetConfig:
        """The fleet config, refused when a tool's synchronous upper bound outlasts what the broker lets a
        worker hold one delivery (the submit step holds its message for the whole synchronous call).

        Raises:
            ConfigError: the file is invalid, or such a tool is configured.
        """
        fleet = self.fleet()
        limit = self.max_held_delivery_s
        if limit is None:
            return fleet
        for server_name, server in fleet.servers.items():
            for tool_name, tool in server.tools.items():
                if tool.sync_upper_bound_s is not None and tool.sync_upper_bound_s > limit:
                    raise ConfigError(
                        f"servers.{server_name}.tools.{tool_name}.sync_upper_bound_s = "
                        f"{tool.sync_upper_bound_s:g}: a synchronous call holds its broker message that "
                        f"long, longer than this broker allows ({limit:.0f}s: the Redis visibility timeout "
                        f"or RabbitMQ's consumer_timeout, less a margin)"
                    )
        return fleet

    def fleet(self) -> FleetConfig:
        return FleetConfig.from_toml(self.config) if self.config is not None else FleetConfig()


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        raise ConfigError(f"environment: {_explain(exc, prefix='LONGCALL_')}") from exc


def _explain(exc: ValidationError, prefix: str = "") -> str:
    parts = []
    for error in exc.errors():
        location = ".".join(str(p) for p in error["loc"])
        if prefix:
            location = prefix + location.upper()
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        parts.append(f"{location}: {message}")
    return "; ".join(parts)
