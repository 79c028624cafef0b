"""Ports: find a free one, ask whether one answers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's choice, so parallel runs do not collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def split_host_port(address: str, default_port: int) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host:
        return address, default_port
    return host, int(port)
