"""Downstream signatures (``on_terminal``, ``on_input``) checked at submit as delivery will publish them (rule
9): what could never be published, or would be published and never run, is refused while the caller is there
to hear it, instead of found by the outbox once the operation has ended.

Delivery (``workers/delivery.py``) does ``celery.signature(stored, app=app).apply_async(kwargs={keyword:
value}, task_id=..., headers=...)``. So a signature here is what Celery can build from the stored dict (it is
built, as delivery builds it), nested signatures included (a chain's tasks, a group's, a chord's header and
body, ``link`` and ``link_error``), each with only the Celery message options listed in ``MESSAGE_OPTIONS``,
each of the right JSON type, and:

- routed by ``queue`` only: ``exchange``, ``exchange_type`` and ``routing_key`` are refused (a broker without
  that exchange or binding refuses or drops the message every time; Celery declares a missing queue);
- with a delay inside the broker's limit (``Settings.max_callback_delay_s``), an ``expires`` in seconds at
  least ``MIN_DOWNSTREAM_EXPIRES_S`` beyond that delay, and an ``expires`` date at least
  ``DELIVERY_MARGIN_S`` after the operation's wait budget ends;
- JSON that Celery's serializer delivers unchanged, persistent, serialized as JSON.

Every refusal is an :class:`~workers.errors.InvalidSubmission` naming where the signature is
(``on_terminal.kwargs.tasks[1].options``) and what was wrong; nothing is written.
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ledger.digests import canonical_json
from ledger.errors import NotJson
from workers.errors import InvalidSubmission

SIGNATURE_KEYS = frozenset({"task", "args", "kwargs", "options", "subtask_type", "immutable", "chord_size"})
#: The longest queue name, task id or other text option accepted.
MAX_OPTION_TEXT = 512


log = logging.getLogger(__name__)

#: The keys of Celery's JSON serializer's envelope for a type JSON lacks (kombu's ``{"__type__": "datetime",
#: "__value__": "..."}``): an object with exactly these keys is decoded on delivery, never delivered as sent.
KOMBU_ENVELOPE = frozenset({"__type__", "__value__"})


def delivered_unchanged(value: Any) -> bool:
    """Whether Celery's JSON serializer delivers ``value`` as it is, answered without Celery: a JSON value
    is delivered unchanged unless it holds, at any depth, an object with exactly the keys ``__type__`` and
    ``__value__`` (:data:`KOMBU_ENVELOPE`), which kombu decodes into a datetime, a Decimal, bytes, ... (or
    refuses the whole message for a type it does not know). Not JSON: False. A worker asks the serializer
    itself (``workers/delivery.py``, through :class:`DeliveryCheck`); the two agree on every JSON value
    (``tests/unit/test_boundary.py``)."""
    try:
        canonical_json(value)
    except NotJson:
        return False
    return not _holds_envelope(value)


def _holds_envelope(value: Any) -> bool:
    if isinstance(value, dict):
        return value.keys() == KOMBU_ENVELOPE or any(_holds_envelope(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_envelope(v) for v in value)
    return False


@dataclass(frozen=True, slots=True)
class DeliveryCheck:
    """What delivery's serializer and Celery say of a value before it is sent: ``unchanged(value)``, whether
    the JSON serializer delivers it as it is; ``build(field, signature)``, raising
    :class:`~workers.errors.InvalidSubmission` when Celery cannot build the signature. The Celery layer
    gives its own (``workers/delivery.py`` ``CELERY_DELIVERY``, through the runtime); without it, the JSON
    rule of :func:`delivered_unchanged` and no build. ``chords``: whether the fleet's result backend keeps a
    chord's state (``rpc://`` does not: Celery refuses to send a chord there, so one would never be
    delivered)."""

    unchanged: Callable[[Any], bool] = delivered_unchanged
    build: Callable[[str, dict[str, Any]], None] | None = None
    chords: bool = True


#: Without Celery: the JSON rule, no build.
JSON_RULE = DeliveryCheck()


def makes_a_chord(sig: Mapping[str, Any]) -> bool:
    """Whether Celery sends the signature ``sig`` (as a dict) as a chord: a chord itself, or a chain in
    which a group of two or more tasks is followed by another task, its nested chains flattened as Celery
    flattens them (Celery joins the two; a group of one it sends as its task)."""
    kind = sig.get("subtask_type")
    if kind == "chord":
        return True
    if kind != "chain":
        return False
    steps = list(_chain_steps(sig))
    return any(_a_group(step) for step in steps[:-1])


def _chain_steps(sig: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The steps of a chain, its nested chains' steps in their place."""
    for task in (sig.get("kwargs") or {}).get("tasks") or []:
        if isinstance(task, Mapping) and task.get("subtask_type") == "chain":
            yield from _chain_steps(task)
        elif isinstance(task, Mapping):
            yield task


def _a_group(task: Mapping[str, Any]) -> bool:
    return task.get("subtask_type") == "group" and len((task.get("kwargs") or {}).get("tasks") or []) > 1


def checked_signature(
    field: str, value: Any, max_delay_s: float | None = None, *, delivery: DeliveryCheck = JSON_RULE
) -> dict[str, Any] | None:
    """A downstream signature (``on_terminal``, ``on_input``) checked as delivery will publish it
    (``workers/delivery.py``: ``celery.signature(stored, app=app).apply_async(kwargs=..., task_id=...,
    headers=...)``), every signature nested in it too (the members of a chain or a group, a chord's header
    and body, ``link`` and ``link_error`` callbacks): what could never be published or never run is refused
    now, while the caller is there to hear it, rather than found by the outbox once the operation has ended.
    ``delivery``: the serializer's and Celery's own answers (:class:`DeliveryCheck`).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidSubmission(f"{field} must be a Celery signature as a dict (signature.dict()), or None")
    try:
        canonical_json(value)
    except NotJson as exc:
        raise InvalidSubmission(f"{field} is not JSON: {exc}") from exc
    for where, sig in downstream_signatures(field, value):
        _check_options(where, sig.get("options") or {}, max_delay_s)
        if not delivery.chords and makes_a_chord(sig):
            raise InvalidSubmission(
                f"{where} is a chord (or a chain Celery sends as one: a group followed by a task), and "
                "this fleet's result backend (rpc://: a Redis Cluster with a RabbitMQ broker) keeps no "
                "chord state: Celery would refuse to send it; give the group's tasks a task of their own "
                "to report to"
            )
    # Celery builds a signature from a dict as it is: one without ``kwargs`` cannot take the receipt
    # (``apply_async(kwargs=...)`` raises TypeError), so the parts a dict may leave out are filled in.
    value = completed_signature(value)
    if not delivery.unchanged(value):
        raise InvalidSubmission(
            f"{field} holds an object with exactly the keys __type__ and __value__: Celery's JSON serializer "
            "would decode it into another type (a date, a Decimal, bytes) or refuse the message"
        )
    if delivery.build is not None:
        delivery.build(field, value)
    unrouted = unrouted_tasks(field, value)
    if unrouted:
        log.warning(
            "%s names no queue: delivery sends it to Celery's default queue %r, which a pipeline app that "
            "sets none consumes; give each task queue='...' (workers.client.call fills it from your app's "
            "routes)",
            ", ".join(unrouted),
            DEFAULT_DOWNSTREAM_QUEUE,
        )
    checked: dict[str, Any] = value
    return checked


#: Where delivery sends a downstream task whose signature names no queue: Celery's own default queue (a
#: pipeline app that sets none consumes it), never longcall's default one, whose workers would discard the
#: task as unregistered (the receipt lost in silence). The submission is warned of it.
DEFAULT_DOWNSTREAM_QUEUE = "celery"


def routed_signature(value: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` (a completed signature dict) with :data:`DEFAULT_DOWNSTREAM_QUEUE` as the queue of every
    task in it that names none (a chain's or a group's members, a chord's header and body, callbacks)."""
    routed = copy.deepcopy(dict(value))
    for _, sig in downstream_signatures("signature", routed):
        if sig.get("subtask_type") is None and not (sig.get("options") or {}).get("queue"):
            sig["options"] = {**(sig.get("options") or {}), "queue": DEFAULT_DOWNSTREAM_QUEUE}
    return routed


def unrouted_tasks(field: str, value: Mapping[str, Any]) -> list[str]:
    """Where in ``value`` a task names no queue (delivery sends it to :data:`DEFAULT_DOWNSTREAM_QUEUE`)."""
    return [
        where
        for where, sig in downstream_signatures(field, dict(value))
        if sig.get("subtask_type") is None and not (sig.get("options") or {}).get("queue")
    ]


#: What a signature dict may leave out (or give as null), filled in as Celery writes it.
SIGNATURE_DEFAULTS: Mapping[str, Any] = {"args": [], "kwargs": {}, "options": {}}


def completed_signature(value: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` (a signature as a dict) with the parts a dict may leave out filled in, its nested signatures
    too (a chain's or a group's tasks, a chord's header and body, ``link`` and ``link_error``): Celery
    builds a signature from a dict as it is, and one whose ``kwargs`` is missing cannot take the receipt
    (``apply_async(kwargs=...)`` raises TypeError, every time). Submit stores signatures completed; delivery
    (``workers/delivery.py``) completes the ones stored before it did."""
    sig = dict(value)
    for key, empty in SIGNATURE_DEFAULTS.items():
        if sig.get(key) is None:
            sig[key] = copy.copy(empty)

    def nested(member: Any) -> Any:
        if isinstance(member, dict):
            return completed_signature(member)
        if isinstance(member, list | tuple):
            return [completed_signature(m) if isinstance(m, dict) else m for m in member]
        return member

    if isinstance(sig["kwargs"], dict):
        kind = sig.get("subtask_type")
        parts = ("tasks",) if kind in ("chain", "group") else ("header", "body") if kind == "chord" else ()
        sig["kwargs"] = {k: nested(v) if k in parts else v for k, v in sig["kwargs"].items()}
    if isinstance(sig["options"], dict):
        links = ("link", "link_error")
        sig["options"] = {k: nested(v) if k in links else v for k, v in sig["options"].items()}
    return sig


#: The signature types delivery can publish with a receipt: a task, a chain (its first task gets the
#: receipt), a group (each member gets it) and a chord (each member of its header gets it); and the task
#: name Celery gives each composite.
COMPOSITES: Mapping[str, str] = {"chain": "celery.chain", "group": "celery.group", "chord": "celery.chord"}
#: How deep signatures may nest (a chain of groups of chains ...).
MAX_SIGNATURE_DEPTH = 8


def downstream_signatures(field: str, value: Any, depth: int = 0) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every signature in ``value``, itself first, each with where it is (``on_terminal.kwargs.tasks[1]``),
    its shape checked: a task name, the keys of a signature, args a list and kwargs an object, a known
    ``subtask_type`` with its members."""
    if depth > MAX_SIGNATURE_DEPTH:
        raise InvalidSubmission(f"{field}: signatures nest more than {MAX_SIGNATURE_DEPTH} deep")
    if not isinstance(value, dict):
        raise InvalidSubmission(f"{field} must be a Celery signature as a dict (signature.dict())")
    task = value.get("task")
    if not isinstance(task, str) or not task:
        raise InvalidSubmission(f"{field} must name its task: {{'task': 'pipeline.step', ...}}")
    unknown = sorted(set(value) - SIGNATURE_KEYS)
    if unknown:
        raise InvalidSubmission(f"{field} has keys {unknown} that a Celery signature does not have")
    args = value["args"] if value.get("args") is not None else []
    kwargs = value["kwargs"] if value.get("kwargs") is not None else {}
    if not isinstance(args, list | tuple) or not isinstance(kwargs, dict):
        raise InvalidSubmission(f"{field}: args must be a list and kwargs an object")
    options = value.get("options") or {}
    if not isinstance(options, dict):
        raise InvalidSubmission(f"{field}: options must be an object")
    kind = value.get("subtask_type")
    if kind is not None and kind not in COMPOSITES:
        raise InvalidSubmission(
            f"{field}: subtask_type {kind!r} cannot take a receipt; a downstream signature is a task, a "
            "chain, a group or a chord"
        )
    if (COMPOSITES.get(kind) if kind else None) != (task if task in COMPOSITES.values() else None):
        raise InvalidSubmission(f"{field}: task {task!r} and subtask_type {kind!r} do not go together")
    yield field, value
    if kind in ("chain", "group"):
        yield from _members(f"{field}.kwargs.tasks", kwargs.get("tasks"), depth)
    elif kind == "chord":
        header = kwargs.get("header")
        if isinstance(header, dict):
            yield from downstream_signatures(f"{field}.kwargs.header", header, depth + 1)
        else:
            yield from _members(f"{field}.kwargs.header", header, depth)
        yield from downstream_signatures(f"{field}.kwargs.body", kwargs.get("body"), depth + 1)
    for callback in ("link", "link_error"):
        linked = options.get(callback)
        if isinstance(linked, dict):
            yield from downstream_signatures(f"{field}.options.{callback}", linked, depth + 1)
        elif linked is not None and linked != []:
            yield from _members(f"{field}.options.{callback}", linked, depth)
    if options.get("chord") is not None and not isinstance(options["chord"], dict):
        raise InvalidSubmission(f"{field}: options.chord must be the chord's signature (as Celery writes it)")


def _members(where: str, members: Any, depth: int) -> Iterator[tuple[str, dict[str, Any]]]:
    if not isinstance(members, list | tuple) or not members:
        # An empty chain or group publishes nothing: the receipt would reach nobody.
        raise InvalidSubmission(f"{where} must be a non-empty list of signatures")
    for i, member in enumerate(members):
        yield from downstream_signatures(f"{where}[{i}]", member, depth + 1)


#: The Celery message options a downstream signature may carry, all JSON values (``_check_options`` checks
#: each one's type). Routing is by queue only: see ``ROUTING_OPTIONS``.
MESSAGE_OPTIONS = frozenset(
    {
        "queue",
        "priority",
        "countdown",
        "eta",
        "expires",
        "time_limit",
        "soft_time_limit",
        "retry",
        "retry_policy",
        "ignore_result",
        "shadow",
        "headers",
        "serializer",
        "compression",
        "delivery_mode",
        "link",
        "link_error",
        # What Celery itself writes into a signature it froze or stamped (ids, the chord it belongs to).
        "task_id",
        "parent_id",
        "root_id",
        "group_id",
        "group_index",
        "chord",
        "reply_to",
        "stamped_headers",
        "stamps",
    }
)
#: Refused: a message sent to an exchange the broker lacks, or with a routing key no queue is bound by, is
#: refused (RabbitMQ: NOT_FOUND) or dropped (RabbitMQ without a binding; Redis: to its undeliverable list)
#: every time it is sent. ``queue`` is the one route: Celery declares a missing queue as it publishes.
ROUTING_OPTIONS = frozenset({"exchange", "exchange_type", "routing_key"})
RETRY_POLICY_KEYS = frozenset({"max_retries", "interval_start", "interval_step", "interval_max"})
#: Codecs every Python consumer has (kombu's aliases of the standard library's zlib, bz2 and lzma).
COMPRESSIONS = frozenset({"zlib", "gzip", "bzip2", "lzma"})
#: The least time a downstream message must be allowed from its publish (plus its own countdown) before it
#: expires: a receipt sent while the pipeline's workers are busy must still run when one takes it.
MIN_DOWNSTREAM_EXPIRES_S = 60.0
#: An absolute ``expires`` must fall this long after the operation's wait budget ends: the result is still
#: fetched, accepted and sent after that (a result read retried for ``result_retry_s``, an outbox row for
#: up to ``outbox_max_attempts`` pauses of ``outbox_retry_max_s``: under an hour with the defaults).
DELIVERY_MARGIN_S = 3600.0


def _check_options(where: str, options: Mapping[str, Any], max_delay_s: float | None) -> None:
    routing = sorted(set(options) & ROUTING_OPTIONS)
    if routing:
        raise InvalidSubmission(
            f"{where}: {', '.join(routing)} refused: longcall sends downstream messages by queue only (a "
            "broker that lacks the exchange or the binding refuses or drops the message every time); give "
            "queue='...' instead (created if missing)"
        )
    unknown = sorted(set(options) - MESSAGE_OPTIONS)
    if unknown:
        raise InvalidSubmission(
            f"{where}: options {unknown} are not Celery message options longcall can send; accepted: "
            f"{sorted(MESSAGE_OPTIONS)}"
        )
    for name in ("queue", "shadow", "task_id", "parent_id", "root_id", "group_id", "reply_to"):
        value = options.get(name)
        if value is not None and (
            not isinstance(value, str) or not value.strip() or len(value) > MAX_OPTION_TEXT
        ):
            raise InvalidSubmission(
                f"{where}: {name} must be a non-empty string of at most {MAX_OPTION_TEXT} characters"
            )
    priority = options.get("priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255
    ):
        raise InvalidSubmission(f"{where}: priority must be a whole number in 0..255")
    for name in ("time_limit", "soft_time_limit"):
        value = options.get(name)
        if value is not None and not _positive(value):
            raise InvalidSubmission(f"{where}: {name} must be a positive number of seconds")
    for name in ("retry", "ignore_result"):
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise InvalidSubmission(f"{where}: {name} must be true or false")
    _check_retry_policy(where, options.get("retry_policy"))
    headers = options.get("headers")
    if headers is not None and not isinstance(headers, dict):
        raise InvalidSubmission(f"{where}: headers must be an object")
    if options.get("serializer") not in (None, "json"):
        raise InvalidSubmission(f"{where}: serializer must be json (longcall sends JSON only)")
    compression = options.get("compression")
    if compression is not None and compression not in COMPRESSIONS:
        raise InvalidSubmission(f"{where}: compression must be one of {sorted(COMPRESSIONS)}")
    if options.get("delivery_mode") not in (None, 2, "persistent"):
        raise InvalidSubmission(
            f"{where}: delivery_mode must be persistent (2): a transient receipt is lost when the broker "
            "restarts"
        )
    group_index = options.get("group_index")
    if group_index is not None and (isinstance(group_index, bool) or not isinstance(group_index, int)):
        raise InvalidSubmission(f"{where}: group_index must be a whole number")
    delay = _delay_s(where, options)
    if delay is not None and max_delay_s is not None and delay > max_delay_s:
        raise InvalidSubmission(
            f"{where} would run {delay:.0f}s after it is sent (countdown/eta); a message held that long "
            f"outlives the broker's visibility timeout (Redis: delivered twice) or consumer timeout "
            f"(RabbitMQ: the worker holding it exits): at most {max_delay_s:.0f}s"
        )
    expires = options.get("expires")
    if isinstance(expires, str):
        _when(where, "expires", expires)  # checked against the wait budget by validate_submission
    elif expires is not None:
        if not _positive(expires):
            raise InvalidSubmission(
                f"{where}: expires must be a positive number of seconds or an ISO 8601 date and time"
            )
        least = max(delay or 0.0, 0.0) + MIN_DOWNSTREAM_EXPIRES_S
        if expires < least:
            raise InvalidSubmission(
                f"{where}: expires={expires:g}s would let the message expire unrun: it must leave at least "
                f"{MIN_DOWNSTREAM_EXPIRES_S:.0f}s beyond its countdown/eta for a worker to take it (at least "
                f"{least:.0f}s here)"
            )


def _check_retry_policy(where: str, policy: Any) -> None:
    if policy is None:
        return
    if not isinstance(policy, dict) or set(policy) - RETRY_POLICY_KEYS:
        raise InvalidSubmission(
            f"{where}: retry_policy must be an object with keys among {sorted(RETRY_POLICY_KEYS)}"
        )
    for key, value in policy.items():
        if value is None and key == "max_retries":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise InvalidSubmission(f"{where}: retry_policy.{key} must be a number, at least 0")


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf


def _when(where: str, name: str, value: Any) -> dt.datetime:
    """An ISO 8601 date and time (UTC when it names no zone)."""
    try:
        when = dt.datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        when = None
    if when is None:
        raise InvalidSubmission(f"{where}: {name} must be an ISO 8601 date and time")
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def check_absolute_expiry(field: str, value: dict[str, Any] | None, wait_budget_s: float) -> None:
    """An ``expires`` given as a date and time must fall after the receipt can still be sent: the wait
    budget's end and ``DELIVERY_MARGIN_S`` after it (see ``_check_options`` for one given in seconds)."""
    if value is None:
        return
    latest = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=wait_budget_s + DELIVERY_MARGIN_S)
    for where, sig in downstream_signatures(field, value):
        expires = (sig.get("options") or {}).get("expires")
        if isinstance(expires, str) and _when(where, "expires", expires) < latest:
            raise InvalidSubmission(
                f"{where}: expires={expires} comes before the receipt can be sent: the operation may end at "
                f"the end of its wait budget ({wait_budget_s:.0f}s from now) and its receipt be sent up to "
                f"{DELIVERY_MARGIN_S:.0f}s later; give a later date, or expires in seconds (counted from "
                "the moment it is sent)"
            )


def _delay_s(field: str, options: Mapping[str, Any]) -> float | None:
    """How long after it is sent the signature's message runs: its ``countdown``, or its ``eta`` from now."""
    delays: list[float] = []
    countdown = options.get("countdown")
    if countdown is not None:
        if (
            isinstance(countdown, bool)
            or not isinstance(countdown, int | float)
            or not 0 <= countdown < math.inf
        ):
            raise InvalidSubmission(f"{field}: countdown must be a number of seconds, at least 0")
        delays.append(float(countdown))
    eta = options.get("eta")
    if eta is not None:
        when = _when(field, "eta", eta)
        delays.append((when - dt.datetime.now(dt.UTC)).total_seconds())
    return max(delays) if delays else None
