# The Xinfra image: the metadata service, the Northguard broker and the CLI in one.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

COPY pyproject.toml README.md ./
COPY xinfra ./xinfra
COPY metadata_service ./metadata_service
COPY backends ./backends
COPY migration ./migration
COPY clients ./clients
COPY bench ./bench
RUN pip install ".[couchbase]"

RUN useradd --create-home --uid 10001 xinfra && mkdir /data && chown xinfra /data
USER xinfra
EXPOSE 8780 9470
CMD ["xinfra", "--help"]
