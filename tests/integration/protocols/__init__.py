"""Each protocol beside MCP 2025-11-25 end to end: AIP-151 (its executor, faults, route arguments, the
lookup's proof) and the MCP tasks extension 2026-07-28 (executor, faults), and a disabled adapter version."""
