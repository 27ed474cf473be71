"""The only part of longcall that knows Celery: the app factory, thin tasks, the CLI."""

__version__ = "0.1.0"
