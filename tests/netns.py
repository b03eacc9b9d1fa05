"""Hosts for a test, made of Linux network and mount namespaces (needs root and iproute2's `ip`).

Owns one private Ethernet segment per `Network`: a bridge inside a namespace of its own (the "switch"),
and one network namespace per host joined to it by a veth pair (`eth0` in the host, `p-<i>` on the
bridge), each host with its own address in a /24 of 198.18.0.0/15 (RFC 2544's range for benchmarking,
which no real network routes), loopback up and no route anywhere else: a host reaches the other hosts of
its network and nothing else. Owns the processes started in a host (each also in a mount namespace of
its own, where chosen directories are hidden under an empty tmpfs, so a worker cannot see the learner's
run directory), taking a host's link down and up, and removing all of it: processes killed, namespaces
deleted (which deletes the bridge and every veth with them: nothing was ever made in the machine's own
namespace).

Names carry a random tag and the maker's pid ("apr" + 8 hex digits + "p" + pid), so parallel or crashed
runs never collide, and a network whose maker died unclosed is swept by the next one made. Does not own
what runs in the hosts (the test's processes) or any port choice.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli.supervisor import own_session_dying_with_parent

PREFIX = "apr"
# a network's namespaces are named apr<8 hex>p<pid of the process that made them>-<switch or host index>
OURS = re.compile(rf"^{PREFIX}[0-9a-f]{{8}}p(\d+)-")
IP_TIMEOUT_S = 60.0  # one `ip` command: generous, the machine is loaded


class NamespaceError(RuntimeError):
    """An `ip` command that made or changed the network failed."""


@functools.cache
def unavailable_reason() -> str | None:
    """Why this process cannot make hosts here (None: it can): not root, a tool missing, or the kernel or
    container refusing a step (probed by making a one-host network, running a command in it with a
    directory hidden, and removing it). Asked once per test session."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this test runs as uid {os.geteuid()})"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    try:
        with Network(["probe"]) as net, tempfile.TemporaryDirectory(prefix="april-netns-") as tmp:
            done = net.run("probe", ["true"], hidden=[Path(tmp)])
            if done.returncode != 0:
                return f"cannot run a process in a namespace with a mount view: {done.stderr.strip()}"
    except NamespaceError as e:
        return f"cannot make network namespaces here: {e}"
    return None


def require_namespaces() -> None:
    """Skip the calling test, with the one-line reason, where namespaces cannot be made."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if done.returncode != 0:
        raise NamespaceError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def namespaces() -> list[str]:
    """Every network namespace name on the machine (`ip netns list` prints "NAME (id: N)")."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def sweep_orphans() -> None:
    """Delete the namespaces of networks whose maker died without closing them (a SIGKILLed pytest): their
    processes died with it (parent-death signal), their names would only pile up. A maker still alive,
    or a pid since reused, keeps its namespaces."""
    for name in namespaces():
        made_by = OURS.match(name)
        if made_by is not None and not Path(f"/proc/{made_by[1]}").exists():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=IP_TIMEOUT_S)


@dataclass(frozen=True, slots=True)
class Host:
    name: str  # the test's name for it ("broker", "worker-0", ...)
    netns: str  # its network namespace
    address: str  # its IPv4 address on the segment
    port: str  # its veth end on the bridge, in the switch namespace


class Network:
    """Hosts on one private segment; use as a context manager (everything is removed on exit, also when
    the test fails)."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not 0 < len(names) < 250:
            raise ValueError(f"host names must be distinct, 1..249 of them; got {list(names)}")
        sweep_orphans()
        self.tag = f"{PREFIX}{secrets.token_hex(4)}p{os.getpid()}"
        self.switch = f"{self.tag}-switch"
        # a /24 picked at random per network: the segments are isolated anyway, distinct numbers only make
        # a log easier to read when several runs are compared
        subnet = ipaddress.ip_network(f"198.{18 + secrets.randbelow(2)}.{secrets.randbelow(256)}.0/24")
        self.hosts = {
            name: Host(name, f"{self.tag}-{i}", str(subnet[i + 10]), f"p-{i}") for i, name in enumerate(names)
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.made: list[str] = []  # namespaces made so far, deleted by close()
        try:
            self._build(subnet.prefixlen)
        except BaseException:
            self.close()
            raise

    def _build(self, prefixlen: int) -> None:
        self._add_netns(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts.values():
            self._add_netns(host.netns)
            ip("-n", host.netns, "link", "set", "lo", "up")
            ip(
                "-n",
                host.netns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                host.port,
                "netns",
                self.switch,
            )
            ip("-n", self.switch, "link", "set", host.port, "master", "br0")
            ip("-n", self.switch, "link", "set", host.port, "up")
            ip("-n", host.netns, "addr", "add", f"{host.address}/{prefixlen}", "dev", "eth0")
            ip("-n", host.netns, "link", "set", "eth0", "up")

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self.made.append(name)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def command(self, host: str, argv: Sequence[str], hidden: Sequence[Path] = ()) -> list[str]:
        """`argv` as run in `host`: its network namespace, and a mount namespace of its own (private
        propagation: nothing mounted there is seen outside) where each of `hidden` is an empty tmpfs."""
        mounts = "".join(
            f"mount -t tmpfs -o size=64k,mode=0755 hidden {shlex.quote(str(d))} && " for d in hidden
        )
        script = f'{mounts}exec "$@"'
        netns = self.hosts[host].netns
        return ["ip", "netns", "exec", netns, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", script, "sh", *argv]  # fmt: skip

    def start(
        self,
        host: str,
        argv: Sequence[str],
        log: Path,
        env: Mapping[str, str] | None = None,
        hidden: Sequence[Path] = (),
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` in `host` (see `command`), stdout and stderr to `log`; `env` is added to this
        process's environment. Each directory in `hidden` is made if missing (a mount point must exist).
        The process gets a session of its own and dies with this one; close() kills it."""
        for d in hidden:
            d.mkdir(parents=True, exist_ok=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                self.command(host, argv, hidden),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                preexec_fn=own_session_dying_with_parent,
            )
        self.procs.append(proc)
        return proc

    def run(
        self, host: str, argv: Sequence[str], hidden: Sequence[Path] = (), timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in `host` to completion (a probe: ping, `april status`); its output as text."""
        return subprocess.run(
            self.command(host, argv, hidden), capture_output=True, text=True, timeout=timeout
        )

    def link_down(self, host: str) -> None:
        """Pull the host's cable: its `eth0` goes down (no carrier, no route to the segment) until
        link_up; its processes and their sockets live on."""
        ip("-n", self.hosts[host].netns, "link", "set", "eth0", "down")

    def link_up(self, host: str) -> None:
        ip("-n", self.hosts[host].netns, "link", "set", "eth0", "up")

    def close(self) -> None:
        """Kill every process started here (its whole session), then delete the namespaces; idempotent."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            # unkillable (D state): the namespaces still go; the kernel frees them with the process
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
        self.procs.clear()
        while self.made:
            name = self.made.pop()
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=IP_TIMEOUT_S)

    def leftovers(self) -> list[str]:
        """This network's namespaces still on the machine (empty after close())."""
        return [n for n in namespaces() if n.startswith(self.tag)]
