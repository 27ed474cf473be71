"""The MCP adapter for protocol version 2026-07-28 with the tasks extension
(``io.modelcontextprotocol/tasks``, SEP-2663).

- :mod:`.wire`: pure functions from the extension's JSON to :mod:`adapters.base` values; no I/O.
- :mod:`.transport`: one POST per request, the version and routing headers, errors mapped at the edge.
- :mod:`.adapter`: :class:`McpExtTasksAdapter`, the :class:`~adapters.base.ToolAdapter` verbs.
- :mod:`.discovery`: which MCP generation a server speaks (``server/discover``, then ``initialize``),
  cached per server.
- :mod:`.spec`: :data:`SPEC`, what the worker asks of the version (its rounds answered by key).

Facts (reference/mcp-tasks-extension.md): no handshake or session; the opt-in on every request; the
create result flat (the nested ``task.taskId`` tolerated); the result inline in ``tasks/get``; input
answered by key with ``tasks/update``; the cancel only acknowledged; no ``tasks/list`` and no
idempotency key, so a lost create answer is unprovable.
"""

from adapters.mcp_2026_07_28.adapter import McpExtTasksAdapter
from adapters.mcp_2026_07_28.spec import SPEC
from adapters.mcp_2026_07_28.wire import ADAPTER_VERSION, EXTENSION, PROTOCOL, PROTOCOL_VERSION

__all__ = ["ADAPTER_VERSION", "EXTENSION", "PROTOCOL", "PROTOCOL_VERSION", "SPEC", "McpExtTasksAdapter"]
