"""The broker settings that make a returned publish mean "the broker has it" (issue 8, item 13)."""

from __future__ import annotations

import pytest
from kombu.transport.redis import Transport

from workers.app import BROKER_SOCKET_TIMEOUT_S, celery_config, create_app, is_amqp
from workers.settings import Settings


@pytest.mark.parametrize(
    "url", ["amqp://guest@rabbit//", "pyamqp://guest@rabbit:5672//", "amqps://guest@rabbit//"]
)
def test_an_amqp_broker_gets_publisher_confirms(url: str) -> None:
    settings = Settings(broker_url=url)
    assert is_amqp(url)
    assert celery_config(settings)["broker_transport_options"]["confirm_publish"] is True
    # What kombu hands to py-amqp's Connection when the outbox publishes.
    app = create_app(settings)
    with app.connection_for_write() as connection:
        assert (connection.transport_options or {}).get("confirm_publish") is True


def test_a_redis_broker_fails_a_hung_command_instead_of_waiting_for_ever() -> None:
    settings = Settings(broker_url="redis://127.0.0.1:6379/0")
    assert not is_amqp(settings.broker)
    options = celery_config(settings)["broker_transport_options"]
    assert "confirm_publish" not in options
    assert options["socket_timeout"] == options["socket_connect_timeout"] == BROKER_SOCKET_TIMEOUT_S
    # The consumer's blocking pop must fit inside the timeout, or an idle queue would look like a dead broker.
    assert Transport.brpop_timeout < BROKER_SOCKET_TIMEOUT_S
