"""The terminal-state protocol under faults, one area a module (``test_faults_*``: create, result and its
bounds, cancel and its stalls, budget, input and its replies, durability, infrastructure, operations, a
refused poll, Retry-After), workers killed mid-call (``test_executor_faults``), and a server removed from
the configuration with operations in flight."""
