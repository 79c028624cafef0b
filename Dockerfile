# The Xinfra image: the metadata service, the Northguard broker and the CLI in one.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

COPY pyproject.toml setup.py README.md ./
COPY xinfra ./xinfra
COPY metadata_service ./metadata_service
COPY backends ./backends
COPY migration ./migration
COPY clients ./clients
COPY bench ./bench
# gcc only for the build of xinfra's C extension (xinfra/_records.c), removed in the same layer.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install ".[couchbase]" \
 && apt-get purge -y --auto-remove gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 xinfra && mkdir /data && chown xinfra /data
USER xinfra
EXPOSE 8780 9470
CMD ["xinfra", "--help"]
