"""The ledger on a real Postgres: every state transition, the single acceptance point and its races, the
Hypothesis state machine, the schema's constraints, executor control and epochs, the dispatch tick's claim,
fairness and publish, the hot statements' round trips, a result's stored form, and the outbox (its errors
and dead letters)."""
