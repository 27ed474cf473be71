"""The broker settings that make a returned publish mean "the broker has it" (issue 8, item 13)."""

from __future__ import annotations

import warnings

import pytest
from celery import Celery, signals
from kombu.transport.redis import Transport

from workers.app import BROKER_SOCKET_TIMEOUT_S, RESULT_STORE_TRIES, celery_config, create_app, is_amqp
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


def test_each_app_runs_its_own_tasks_and_no_other_app_gets_them() -> None:
    # Celery's tasks are "shared" by default: every app finalized later in the process is given them too,
    # and a second longcall app's tasks were refused as duplicates, so calls reached the FIRST app's
    # callables (with the first app's settings and runtime).
    first, second = create_app(Settings(redis_url="redis://127.0.0.1:6379/1")), create_app(Settings())
    other = Celery("pipeline", set_as_current=False)
    with warnings.catch_warnings():
        # Tests that ran before may have left shared tasks of their own (the pipeline app's) to every app
        # finalized later: only a duplicate longcall task is this test's concern.
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", message="Task name 'longcall")
        first.finalize()
        second.finalize()
        other.finalize()
    assert first.tasks["longcall.submit"] is not second.tasks["longcall.submit"]
    assert first.tasks["longcall.submit"].app is first
    assert second.tasks["longcall.submit"].app is second
    assert not [name for name in other.tasks if name.startswith("longcall.")]


def test_an_answer_not_stored_past_its_retries_is_reported_at_error(caplog: pytest.LogCaptureFixture) -> None:
    """Celery stores a task's answer after its body, tried again through a result backend fault for
    ``RESULT_STORE_TRIES``; past them it only warns ("Exception raised outside body") and acknowledges the
    message. The app tells an operator at ERROR which task's answer is missing and where the outcome is."""
    settings = Settings(broker_url="redis://127.0.0.1:6379/0")
    config = celery_config(settings)
    assert config["result_backend_always_retry"] is True
    assert config["result_backend_max_retries"] == RESULT_STORE_TRIES
    assert config["redis_socket_timeout"] == config["redis_socket_connect_timeout"] == BROKER_SOCKET_TIMEOUT_S
    app, other = create_app(settings), create_app(settings)
    with caplog.at_level("ERROR", logger="longcall"):
        signals.task_internal_error.send(
            sender=app.tasks["longcall.submit"], task_id="t-1", exception=ConnectionError("Redis is away")
        )
    [record] = [r for r in caplog.records if "failed outside its body" in r.getMessage()]
    assert record.levelname == "ERROR"
    assert "longcall.submit[t-1]" in record.getMessage()
    assert "ConnectionError: Redis is away" in record.getMessage()
    assert "the ledger keeps the outcome" in record.getMessage()
    del other  # another app's handler says nothing of this app's task: one line, not two
