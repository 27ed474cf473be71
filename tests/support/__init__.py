"""What the tests share, in one package: the real services and processes a test runs against, the fleets
the integration tests start, and the ledger rows they build.

- ``services``: a Postgres database per test (from a migrated template), Redis, RabbitMQ, private
  ``redis-server``/``postgres``/RabbitMQ instances (and a private 3-node Redis Cluster), Celery worker and
  beat subprocesses, and ``wait_for`` (every wait bounded). Its names are re-exported here, so
  ``from tests import support`` then ``support.wait_for(...)`` reads as before; a test that monkeypatches
  one of its constants patches ``tests.support.services`` (the module whose functions read it), not this
  package.
- ``fleet``: a whole fleet for end-to-end tests (longcall's MCP server, workers, beat, a pipeline worker);
  ``aip_fleet`` and ``ext_fleet`` the same with the demo AIP-151 server or the MCP tasks extension's peer.
- ``aip_server``: the demo AIP-151 server as a child process.
- ``pipeline_app`` and ``durable_pipeline_app``: the pipeline's Celery apps (they import nothing of
  longcall; their workers are started with ``-A tests.support.pipeline_app``).
- ``ledger_rows``: ledger rows built for a test (a submitted operation, one placed in any state).
- ``races``: entry points of the race tests' child processes.
- ``chaos``: the parts of the chaos scenario (a path to the server that can be cut, a seeded fault schedule).
"""

from __future__ import annotations

from tests.support.services import (
    ADMIN_URL,
    POSTGRES_OS_USER,
    RABBITMQ_URL,
    REDIS_URL,
    REPO,
    CeleryProcess,
    PrivatePostgres,
    PrivateRabbitMQ,
    PrivateRedis,
    PrivateRedisCluster,
    admin_execute,
    celery_env,
    child_pids,
    create_database,
    database_url,
    drop_database,
    free_port,
    private_postgres,
    private_rabbitmq,
    private_redis,
    private_redis_cluster,
    rabbitmq_messages,
    rabbitmq_vhost,
    rabbitmqctl,
    release_app,
    require_rabbitmq,
    require_services,
    running,
    start_celery,
    start_celery_like,
    start_worker,
    stop_all,
    wait_for,
)

__all__ = [
    "ADMIN_URL",
    "POSTGRES_OS_USER",
    "RABBITMQ_URL",
    "REDIS_URL",
    "REPO",
    "CeleryProcess",
    "PrivatePostgres",
    "PrivateRabbitMQ",
    "PrivateRedis",
    "PrivateRedisCluster",
    "admin_execute",
    "celery_env",
    "child_pids",
    "create_database",
    "database_url",
    "drop_database",
    "free_port",
    "private_postgres",
    "private_rabbitmq",
    "private_redis",
    "private_redis_cluster",
    "rabbitmq_messages",
    "rabbitmq_vhost",
    "rabbitmqctl",
    "release_app",
    "require_rabbitmq",
    "require_services",
    "running",
    "start_celery",
    "start_celery_like",
    "start_worker",
    "stop_all",
    "wait_for",
]
