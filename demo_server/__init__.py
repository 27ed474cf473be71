"""longcall's demo peers: a faithful MCP 2025-11-25 Tasks server (`demo_server.mcp`) for tests and demos."""
