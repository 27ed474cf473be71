"""What a worker process runs: the Celery app factory, thin tasks, the executor and its steps. The
operator's ``longcall`` command, which a worker never runs, is ``console/``."""

__version__ = "0.1.0"
