"""The pipeline of :mod:`tests.support.pipeline_app` as a consumer whose tasks are short, so it sets a
short Redis ``visibility_timeout``: a receipt it held when the broker crashed (its ack, and the restore the
consumer tries at once, both fail while the broker is down) is redelivered after seconds, not after the
default hour. The message itself is never lost: it waits in the broker's (persisted) unacked set till then."""

from __future__ import annotations

import os

from tests.support.pipeline_app import make_app

#: Seconds before a message taken but not acknowledged is given back to the queue.
VISIBILITY_TIMEOUT_S = 5

app = make_app(
    os.environ["PIPELINE_BROKER_URL"], os.environ["PIPELINE_KEYPREFIX"], os.environ["PIPELINE_SINK"]
)
app.conf.broker_transport_options = {
    **app.conf.broker_transport_options,
    "visibility_timeout": VISIBILITY_TIMEOUT_S,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}
