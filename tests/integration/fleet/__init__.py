"""Whole fleets as they run: the pipeline that reaches longcall by task name, the brokers (Redis, RabbitMQ)
and a broker's restart, a worker's start-up checks and logs, the execution epoch's owner, the compose file's
commands, Flower, ``longcall dev``, the canary, shadow mode and rollout, and the seeded chaos scenario."""
