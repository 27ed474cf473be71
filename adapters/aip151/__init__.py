"""The AIP-151 adapter: ``google.longrunning`` operations over REST/JSON, protocol version ``v1``.

- :mod:`.wire`: pure functions from Operation JSON and error envelopes to the typed values of
  :mod:`adapters.base` and the package's errors; the create call built from a tool's route; no I/O.
- :mod:`.adapter`: :class:`AipOperationsAdapter`, the :class:`~adapters.base.ToolAdapter` verbs.
- :mod:`.spec`: :data:`SPEC`, what the worker asks of the version (its config and argument checks).

Facts it is built on (reference/aip-151.md): a create is service-specific (configured per tool) and
carries the submission key as its AIP-155 request id, so repeating it is the lookup by key; an operation
is followed by its ``name`` (``/v1/{name}``); the result is the done Operation; a cancel's ``Empty``
confirms nothing (the outcome is polled for); there is no poll hint, TTL or input round on the wire.
"""

from adapters.aip151.adapter import DEDUPE_TRUST_S, AipOperationsAdapter
from adapters.aip151.spec import SPEC
from adapters.aip151.wire import ADAPTER_VERSION, PROTOCOL, PROTOCOL_VERSION

__all__ = [
    "ADAPTER_VERSION",
    "DEDUPE_TRUST_S",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "SPEC",
    "AipOperationsAdapter",
]
