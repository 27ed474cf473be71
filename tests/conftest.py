from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ledger.migrate import upgrade
from ledger.repository import Ledger
from tests import support


@pytest.fixture(scope="session")
def services() -> None:
    support.require_services()


@pytest.fixture(scope="session")
def template_database(services: None) -> Iterator[str]:
    """A database migrated once per session; each test copies it (CREATE DATABASE ... TEMPLATE)."""
    name = support.create_database()
    try:
        upgrade(support.database_url(name))
        yield name
    finally:
        support.drop_database(name)


@pytest.fixture
def database_url(template_database: str) -> Iterator[str]:
    name = support.create_database(template=template_database)
    try:
        yield support.database_url(name)
    finally:
        support.drop_database(name)


@pytest.fixture
def empty_database_url(services: None) -> Iterator[str]:
    name = support.create_database()
    try:
        yield support.database_url(name)
    finally:
        support.drop_database(name)


@pytest.fixture
def ledger(database_url: str) -> Iterator[Ledger]:
    repository = Ledger.from_url(database_url)
    try:
        yield repository
    finally:
        repository.dispose()


@pytest.fixture(scope="module")
def shared_ledger(template_database: str) -> Iterator[Ledger]:
    """One database for a module whose tests each work on rows of their own (e.g. the pair tables)."""
    name = support.create_database(template=template_database)
    repository = Ledger.from_url(support.database_url(name))
    try:
        yield repository
    finally:
        repository.dispose()
        support.drop_database(name)


@pytest.fixture
def redis_client(services: None) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(support.REDIS_URL)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def broker_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """Isolates this test's queues on the shared Redis; its keys are removed afterwards."""
    prefix = f"lctest-{uuid.uuid4().hex[:10]}:"
    try:
        yield prefix
    finally:
        keys = list(redis_client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            redis_client.delete(*keys)


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    path = tmp_path / "logs"
    path.mkdir()
    return path
