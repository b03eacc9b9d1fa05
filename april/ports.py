"""Free TCP ports on 127.0.0.1: the ports a run, a benchmark or a test binds when it must not collide with
whatever else runs on the machine (the OS picks them; they were free a moment ago)."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """`n` distinct ports, all held open together while they are chosen (so no two are the same)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_pair() -> int:
    """A port p with p + 1 free too (the weight service's and its broadcast rendezvous's, `weights.port`)."""
    for _ in range(100):
        (port,) = free_ports(1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise OSError("no two consecutive free ports on 127.0.0.1")
