"""Configuration is refused at start with a message that names the key and what was wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.app import celery_config
from workers.errors import ConfigError
from workers.settings import FleetConfig, Settings, load_settings

GOOD = """
[servers.reports]
protocol = "mcp"
protocol_version = "2025-11-25"
url = "http://127.0.0.1:8765/mcp"
auth_env = "REPORTS_TOKEN"
poll_qps = 10
control_qps = 5
default_ttl_ms = 600000
wait_budget_s = 3600

[servers.reports.tools.quick_lookup]
sync_upper_bound_s = 20

[servers.exports]
protocol = "aip151"
protocol_version = "v1"
url = "http://127.0.0.1:9000"
poll_qps = 10

[servers.exports.tools.run_job]
create = "POST /v1/jobs:run"
request_id_field = "requestId"
"""


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "longcall.toml"
    path.write_text(body)
    return path


def test_the_design_example_loads(tmp_path: Path) -> None:
    fleet = FleetConfig.from_toml(_write(tmp_path, GOOD))
    assert fleet.servers["reports"].tools["quick_lookup"].sync_upper_bound_s == 20
    assert fleet.servers["exports"].tools["run_job"].request_id_field == "requestId"
    assert fleet.servers["exports"].control_qps == 5  # default


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("poll_qps = 10", "poll_qps = 10\npoll_qsp = 3"), r"servers\.reports\.poll_qsp: unknown key"),
        (("poll_qps = 10", "poll_qps = 0"), r"servers\.reports\.poll_qps: Input should be greater than 0"),
        (('protocol = "mcp"', 'protocol = "grpc"'), r"servers\.reports\.protocol"),
        (('url = "http://127.0.0.1:8765/mcp"', 'url = "127.0.0.1:8765"'), r"servers\.reports\.url"),
        (('auth_env = "REPORTS_TOKEN"', 'auth_env = "Bearer abc.def"'), "NAME of an environment variable"),
        (('create = "POST /v1/jobs:run"', 'create = "/v1/jobs:run"'), "an HTTP method"),
        (
            ("sync_upper_bound_s = 20", "sync_upper_bound_s = 20\nsync = 1"),
            r"quick_lookup\.sync: unknown key",
        ),
    ],
)
def test_bad_config_is_refused_with_a_clear_message(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        FleetConfig.from_toml(_write(tmp_path, GOOD.replace(*change, 1)))


def test_a_missing_or_broken_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        FleetConfig.from_toml(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        FleetConfig.from_toml(_write(tmp_path, "[servers.x\n"))


def test_the_token_is_read_from_the_named_variable_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server = FleetConfig.from_toml(_write(tmp_path, GOOD)).servers["reports"]
    monkeypatch.delenv("REPORTS_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="REPORTS_TOKEN"):
        server.token()
    monkeypatch.setenv("REPORTS_TOKEN", "s3cret")
    assert server.token() == "s3cret"
    assert "s3cret" not in repr(server)


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONGCALL_DATABASE_URL", "postgresql://db/longcall")
    monkeypatch.setenv("LONGCALL_REDIS_URL", "redis://cache:6379/1")
    monkeypatch.delenv("LONGCALL_BROKER_URL", raising=False)
    settings = Settings()
    assert settings.database_url == "postgresql://db/longcall"
    assert settings.broker == "redis://cache:6379/1"


CLUSTER_NODE = "redis://10.0.0.1:7000/0"


@pytest.mark.parametrize(
    ("broker", "message"),
    [
        (None, "LONGCALL_BROKER_URL: Value error, required with LONGCALL_REDIS_CLUSTER on"),
        (CLUSTER_NODE, "LONGCALL_BROKER_URL: Value error, names the Redis Cluster of LONGCALL_REDIS_URL"),
    ],
)
def test_a_redis_cluster_without_a_broker_of_its_own_is_refused(
    monkeypatch: pytest.MonkeyPatch, broker: str | None, message: str
) -> None:
    """A Redis Cluster is neither a Celery broker nor a result backend: with LONGCALL_REDIS_CLUSTER on, the
    broker must be named, and not be the cluster."""
    monkeypatch.setenv("LONGCALL_REDIS_URL", CLUSTER_NODE)
    monkeypatch.setenv("LONGCALL_REDIS_CLUSTER", "true")
    monkeypatch.delenv("LONGCALL_BROKER_URL", raising=False)
    if broker is not None:
        monkeypatch.setenv("LONGCALL_BROKER_URL", broker)
    with pytest.raises(ConfigError, match=message):
        load_settings()


@pytest.mark.parametrize(
    ("broker", "results"),
    [
        ("redis://broker:6379/2", "redis://broker:6379/2"),
        ("rediss://:pw@broker:6380/0", "rediss://:pw@broker:6380/0"),
        ("amqp://guest:guest@rabbit:5672/fleet", "rpc://"),
    ],
)
def test_beside_a_redis_cluster_the_results_go_to_the_broker(broker: str, results: str) -> None:
    settings = Settings(redis_url=CLUSTER_NODE, redis_cluster=True, broker_url=broker)
    assert (settings.broker, settings.result_backend) == (broker, results)
    assert celery_config(settings)["result_backend"] == results
    # Without the cluster, the results stay on LONGCALL_REDIS_URL whatever the broker.
    alone = Settings(redis_url="redis://cache:6379/1", broker_url=broker)
    assert celery_config(alone)["result_backend"] == "redis://cache:6379/1"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ('protocol_version = "v1"', 'protocol_version = "v2"'),
            r'servers\.exports: .*protocol_version "v1"',
        ),
        (('request_id_field = "requestId"\n', ""), r"tool 'run_job' needs request_id_field"),
        (('create = "POST /v1/jobs:run"\n', ""), r"tool 'run_job' needs create"),
        (
            ('request_id_field = "requestId"', 'request_id_field = "requestId"\nsync_upper_bound_s = 5'),
            r"run_job'.*sync_upper_bound_s is for MCP tools",
        ),
        (('request_id_field = "requestId"', 'request_id_field = "request id"'), r"request_id_field"),
        (
            ("sync_upper_bound_s = 20", 'sync_upper_bound_s = 20\ncreate = "POST /v1/x:run"'),
            r"mcp tool 'quick_lookup': create and request_id_field are for aip151 servers",
        ),
        (
            ("sync_upper_bound_s = 20", 'sync_upper_bound_s = 20\nrequest_id_field = "requestId"'),
            r"mcp tool 'quick_lookup': create and request_id_field are for aip151 servers",
        ),
    ],
)
def test_aip151_tool_routes_are_checked_at_start(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        FleetConfig.from_toml(_write(tmp_path, GOOD.replace(*change, 1)))


def test_an_aip151_server_without_tools_loads(tmp_path: Path) -> None:
    """A server with no tools configured loads; a submission to an unconfigured tool is refused by the
    adapter (rule 12), not at start."""
    body = GOOD.split("[servers.exports.tools.run_job]", maxsplit=1)[0]
    fleet = FleetConfig.from_toml(_write(tmp_path, body))
    assert fleet.servers["exports"].tools == {}
