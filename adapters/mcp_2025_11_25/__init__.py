"""The MCP adapter for protocol version 2025-11-25 (core Tasks, experimental).

Five modules, as the house asks of an adapter (sans-I/O at the core):

- :mod:`.wire`: pure functions from MCP JSON to the typed values of :mod:`adapters.base` (negotiation,
  tasks, results, input requests and replies, JSON-RPC errors); no I/O.
- :mod:`.session`: one worker's session with one server: the ``initialize`` handshake, its renewal
  after a 404, the declared facts and the cached tool list.
- :mod:`.task_requests`: the requests about a task the server already made (``tasks/get``,
  ``tasks/result``, ``tasks/cancel``, ``tasks/list``, the streams that carry its input requests), on
  the session its reference stored.
- :mod:`.adapter`: :class:`McpTasksAdapter`, the :class:`~adapters.base.ToolAdapter` verbs.
- :mod:`.spec`: :data:`SPEC`, what the worker asks of the version (its tools listed, its tasks
  bound to a session).

Facts this adapter is built on (reference/mcp-tasks.md): task ids come from the server and there is no
idempotency key, so a lost create answer is :class:`~adapters.errors.OutcomeUnknown` and
``lookup_by_key`` can never prove "never created"; every unknown/expired/terminal task error is
``-32602``; ``-32601`` and ``-32600`` on ``tools/call`` both mean "wrong task mode"; ``ttl`` may be
missing on the wire (read as null); ``tasks/result`` blocks until the task is terminal, so it is only
called after a terminal status.
"""

from adapters.mcp_2025_11_25.adapter import McpTasksAdapter
from adapters.mcp_2025_11_25.spec import SPEC
from adapters.mcp_2025_11_25.wire import ADAPTER_VERSION, PROTOCOL, PROTOCOL_VERSION

# The parsing functions are imported from .wire, where they live.
__all__ = ["ADAPTER_VERSION", "PROTOCOL", "PROTOCOL_VERSION", "SPEC", "McpTasksAdapter"]
