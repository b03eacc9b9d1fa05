"""Free TCP ports on 127.0.0.1: the ports a run, a benchmark or a test binds when it must not collide with
whatever else runs on the machine (the OS picks them; they were free a moment ago); this machine's
address on its route to another host, which peers there can reach it at; whether an address a user
gave is one a ZeroMQ socket can connect to; and whether a host to bind is this machine's loopback."""

from __future__ import annotations

import ipaddress
import re
import socket

# tcp://HOST:PORT, HOST a name, an IPv4 address or a bracketed IPv6 one (not `*`: that binds, it does not
# connect); ipc://PATH
_TCP_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]*]+):(\d{1,5})")


def endpoint_problem(address: str) -> str | None:
    """Why ZeroMQ could not connect to `address` (what to give instead), or None when it is well formed."""
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return None
    m = _TCP_ENDPOINT.fullmatch(address)
    if m is None:
        return "must look like tcp://HOST:PORT (or ipc://PATH)"
    if not 1 <= int(m.group(2)) <= 65535:
        return "its port must be in 1..65535"
    return None


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


def route_address(host: str) -> str:
    """This machine's address on its route to `host` (a name or an address): a UDP socket connected there
    sends nothing, it only asks the kernel which source address it would use. OSError when there is none."""
    family, _, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return str(probe.getsockname()[0])


def is_loopback(host: str) -> bool:
    """`host` ("localhost" or an IP address) reaches only this machine; a name or anything else: False."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
