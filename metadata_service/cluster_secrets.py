"""Cluster attributes split into public configuration and secrets.

A physical cluster's ``attributes`` hold what a client needs to reach it
(``request_timeout_s``, ``replication_factor``, ``security.protocol``...) and,
on a secured Kafka cluster, what only the service may know (``sasl.password``,
``ssl.key.password``...).  A key is a secret when its name says so
(``SECRET_KEY``: password, secret, token, credential, private, a trailing
``key``, a private key in PEM (``ssl.key.pem``), a keytab, an OAUTHBEARER
config, jaas); everything else is public, certificates included.

- Clients (a non-admin token, and every topic-metadata response) see the public
  attributes only: a secret key is left out, not blanked, so a client never
  mistakes a placeholder for a value.
- Admin listings see every key, a secret's value replaced by ``REDACTED``.
- A secret's value may be a reference instead of the secret itself:
  ``env:NAME`` (an environment variable of the service) or ``file:/path`` (a
  file readable by the service, its content without the trailing newline).
  The database then holds the reference only; ``resolve`` reads it when the
  service opens a backend.  A plain value is stored as given (in clear: the
  database is as sensitive as the secret; prefer a reference).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from xinfra.errors import BackendUnavailable
from xinfra.model import PhysicalCluster

SECRET_KEY = re.compile(
    r"(password|passwd|secret|token|credential|private|jaas|keytab|oauthbearer[._-]config"
    r"|(^|[._-])key$|(^|[._-])key[._-]pem$|api[._-]?key)",
    re.IGNORECASE,
)
REDACTED = "<redacted>"
ENV_PREFIX = "env:"
FILE_PREFIX = "file:"


def is_secret(key: str) -> bool:
    return SECRET_KEY.search(key) is not None


def public_attributes(attributes: Mapping[str, str]) -> dict[str, str]:
    """What a client may see: the attributes without any secret key."""
    return {k: v for k, v in attributes.items() if not is_secret(k)}


def redacted_attributes(attributes: Mapping[str, str]) -> dict[str, str]:
    """What an admin listing shows: every key, secrets' values replaced (references too:
    a file name or variable name says where the secret is)."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in attributes.items()}


def resolve(cluster: PhysicalCluster) -> PhysicalCluster:
    """The cluster with each secret reference (``env:``/``file:``) replaced by its value.

    Raises ``BackendUnavailable`` naming the reference (never a value) when it
    cannot be read: the service cannot reach the cluster without it.
    """
    resolved: dict[str, str] = {}
    changed = False
    for key, value in cluster.attributes.items():
        if is_secret(key) and value.startswith((ENV_PREFIX, FILE_PREFIX)):
            resolved[key] = _read_reference(cluster.name, key, value)
            changed = True
        else:
            resolved[key] = value
    return cluster.model_copy(update={"attributes": resolved}) if changed else cluster


def _read_reference(cluster: str, key: str, reference: str) -> str:
    if reference.startswith(ENV_PREFIX):
        name = reference.removeprefix(ENV_PREFIX)
        value = os.environ.get(name)
        if value is None:
            raise BackendUnavailable(
                f"cluster {cluster!r}: attribute {key!r} refers to the environment variable "
                f"{name!r}, which the service does not have"
            )
        return value
    path = Path(reference.removeprefix(FILE_PREFIX))
    try:
        return path.read_text().rstrip("\n")
    except OSError as error:
        raise BackendUnavailable(
            f"cluster {cluster!r}: attribute {key!r} refers to the file {str(path)!r}, "
            f"which the service cannot read ({error.strerror})"
        ) from None
