"""free_port: the port a test hands a server must not be handed to another one."""

from __future__ import annotations

import socket

from xinfra.services.ports import _ephemeral_range, free_port


def test_consecutive_ports_differ_and_sit_below_the_ephemeral_range() -> None:
    # The suite once gave a broker the same client and HTTP port, and `xinfra up` the same
    # port for Kafka and a Northguard broker: the kernel reuses a probe's port at once.
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    low, _ = _ephemeral_range()
    assert all(port < low for port in ports)


def test_a_handed_out_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
