"""Helpers of the contract suite, in a module of its own name (``conftest`` is ambiguous on sys.path)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from xinfra.model import ClusterKind, PhysicalCluster


@dataclass
class Broker:
    """A private broker a test may stop."""

    kind: ClusterKind
    bootstrap: str
    stop: Callable[[], None]


def cluster(kind: ClusterKind, bootstrap: str, **attributes: str) -> PhysicalCluster:
    return PhysicalCluster(
        name=f"contract-{kind.value}", kind=kind, bootstrap=bootstrap, attributes=attributes
    )
