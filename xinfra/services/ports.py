"""Ports: find a free one, ask whether one answers."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

# Ports this process has handed out.  The kernel forgets a port the moment its probe socket
# closes, so two calls in a row could name the same one (a broker's client and HTTP ports
# were once equal) unless we remember them.
_handed_out: set[int] = set()
_lock = threading.Lock()
_LOWEST = 10_000


def _ephemeral_range() -> tuple[int, int]:
    """The range the kernel draws outgoing connections' local ports from: a port picked in it
    can be taken by any client's connect() between the pick and the server's bind."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, never one this process handed out before, and outside
    the ephemeral range so that no outgoing connection takes it before its server binds.

    Random rather than sequential, so parallel runs on one machine rarely try the same one.
    """
    low, _ = _ephemeral_range()
    with _lock:
        if low - _LOWEST > 1_000:
            for _ in range(200):
                port = random.randrange(_LOWEST, low)
                if port not in _handed_out and _bindable(host, port):
                    _handed_out.add(port)
                    return port
        while True:  # no room below the ephemeral range: the kernel's choice
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
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
