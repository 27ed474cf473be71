# One image for every longcall process: migrate, worker, beat, flower, and the demo MCP server.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini beat_schedule.py ./
COPY ledger ledger
COPY workers workers
COPY console console
COPY adapters adapters
COPY demo_server demo_server
COPY examples examples
RUN pip install --no-cache-dir '.[demo]'
USER nobody
