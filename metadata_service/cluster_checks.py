"""What a physical cluster registration must look like, checked before any network use.

A malformed bootstrap or attribute would otherwise reach a client library
that hangs (``:9092``), raises late (``127.0.0.1:abc``) or is stored for later
failures (``check=false``).  The rules are the common ground of the Kafka and
Northguard clients: a comma-separated list of ``host:port`` with a DNS name,
an IPv4 address or a bracketed IPv6 address, and a port in 1..65535; the
numeric attributes the backends read are finite and in range.
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Final

from xinfra.errors import InvalidRequest
from xinfra.model import PhysicalCluster

PORT_MAX: Final = 65535
REQUEST_TIMEOUT_S_MAX: Final = 3600.0
"""The largest ``request_timeout_s`` attribute: a bound that never fires is no bound."""
REPLICATION_FACTOR_MAX: Final = 32767
"""Kafka's replication factor is an int16; -1 means the broker's default."""

_HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z"
)
_PORT = re.compile(r"[0-9]{1,5}\Z")
_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z")
_INTEGER = re.compile(r"-?[0-9]{1,6}\Z")


def check_cluster(cluster: PhysicalCluster) -> None:
    """Raise ``InvalidRequest`` (400) naming what is wrong; return if the registration is sound."""
    for address in cluster.bootstrap.split(","):
        _check_address(cluster.name, address.strip())
    attributes = cluster.attributes
    if "request_timeout_s" in attributes:
        timeout_s = _decimal(cluster.name, "request_timeout_s", attributes["request_timeout_s"])
        if not 0 < timeout_s <= REQUEST_TIMEOUT_S_MAX:
            raise InvalidRequest(
                f"cluster {cluster.name!r}: request_timeout_s must be in (0, "
                f"{REQUEST_TIMEOUT_S_MAX:.0f}] seconds, not {attributes['request_timeout_s']!r}"
            )
    if "replication_factor" in attributes:
        value = attributes["replication_factor"]
        if not _INTEGER.match(value) or not (
            int(value) == -1 or 1 <= int(value) <= REPLICATION_FACTOR_MAX
        ):
            raise InvalidRequest(
                f"cluster {cluster.name!r}: replication_factor must be -1 (the broker's "
                f"default) or an integer in 1..{REPLICATION_FACTOR_MAX}, not {value!r}"
            )


def _check_address(name: str, address: str) -> None:
    host, port = _split(name, address)
    if not _PORT.match(port) or not 1 <= int(port) <= PORT_MAX:
        raise InvalidRequest(
            f"cluster {name!r}: bootstrap address {address!r} needs a port in 1..{PORT_MAX}"
        )
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise InvalidRequest(
                f"cluster {name!r}: {host!r} in {address!r} is not an IPv6 address"
            ) from None
    elif not _HOSTNAME.match(host):
        raise InvalidRequest(
            f"cluster {name!r}: {host!r} in {address!r} is not a host name or an IP address"
        )


def _split(name: str, address: str) -> tuple[str, str]:
    usage = f"cluster {name!r}: bootstrap address {address!r} must be host:port"
    if address.startswith("["):
        host, bracket, rest = address.partition("]")
        if not bracket or not rest.startswith(":"):
            raise InvalidRequest(f"{usage} (an IPv6 host in brackets: [::1]:9092)")
        return host + "]", rest[1:]
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        raise InvalidRequest(f"{usage}, separated by commas")
    return host, port


def _decimal(name: str, key: str, value: str) -> float:
    number = float(value) if _DECIMAL.match(value) else math.nan
    if not math.isfinite(number):
        raise InvalidRequest(
            f"cluster {name!r}: attribute {key} must be a finite decimal number, not {value!r}"
        )
    return number
