"""tests/netns.py, the hosts the multi-host test is built on: hosts reach each other over their segment and
nothing beyond it, a link taken down cuts the host off until it is up again, a mount view hides a
directory from one process only, and nothing is left on the machine afterwards, also when the test
fails. Skipped, with the reason, where namespaces cannot be made (not root, no iproute2, a container
without the capability).
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import wait_for
from netns import Network, namespaces, require_namespaces

PORT = 7000  # any: the namespaces are the test's own, nothing else listens there

# one accept on PORT, answering "hello" to whoever connects
SERVE = (
    "import socket, sys\n"
    "s = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
    "print('listening', flush=True)\n"
    "c, peer = s.accept(); c.sendall(b'hello from ' + sys.argv[1].encode()); c.close()\n"
)
SERVE_FOREVER = (
    "import socket, sys\n"
    "s = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
    "print('listening', flush=True)\n"
    "while True:\n"
    "    c, peer = s.accept(); c.sendall(b'hello from ' + sys.argv[1].encode()); c.close()\n"
)
# connect once; prints what the server said, or the error
DIAL = (
    "import socket, sys\n"
    "try:\n"
    "    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:\n"
    "        print(c.recv(100).decode())\n"
    "except OSError as e:\n"
    "    print('error', e.errno, e)\n"
)


def wait_listening(log: Path) -> None:
    wait_for(lambda: log.exists() and "listening" in log.read_text(), 60, f"the server in {log}")


@pytest.fixture
def network() -> Iterator[Network]:
    require_namespaces()
    with Network(["a", "b"]) as net:
        yield net


def test_hosts_reach_each_other_over_the_bridge_and_nothing_else(network: Network, tmp_path: Path) -> None:
    a, b = network.host("a"), network.host("b")
    assert a.address != b.address and a.netns != b.netns
    log = tmp_path / "serve.log"
    server = network.start("a", [sys.executable, "-c", SERVE, a.address, str(PORT)], log)
    wait_listening(log)
    dialled = network.run("b", [sys.executable, "-c", DIAL, a.address, str(PORT)])
    assert dialled.stdout.strip() == f"hello from {a.address}", dialled
    assert server.wait(60) == 0
    # b's only route is its segment's /24 (loopback's are in the local table): no default route, so no
    # packet can leave for an address the test did not make (read from the table; nothing is sent outside)
    routes = network.run("b", ["ip", "-4", "route", "show"]).stdout.splitlines()
    subnet = ipaddress.ip_network(f"{b.address}/24", strict=False)
    assert [r.split()[:3] for r in routes] == [[str(subnet), "dev", "eth0"]], routes


def test_a_link_taken_down_cuts_the_host_off_until_it_is_up(network: Network, tmp_path: Path) -> None:
    a = network.host("a")
    log = tmp_path / "serve.log"
    network.start("a", [sys.executable, "-c", SERVE_FOREVER, a.address, str(PORT)], log)
    wait_listening(log)

    def dial() -> str:
        out: str = network.run("b", [sys.executable, "-c", DIAL, a.address, str(PORT)]).stdout
        return out.strip()

    assert dial() == f"hello from {a.address}"
    network.link_down("b")
    cut = dial()
    assert cut.startswith("error"), cut  # no route to the segment while the cable is out
    network.link_up("b")
    # right after `up` the link may still be coming up (carrier, then the /24 route back): "did not hang"
    wait_for(lambda: dial().startswith("hello"), 60, "b to reach a again after link up", interval=0.5)


def test_a_mount_view_hides_a_directory_from_that_process_only(network: Network, tmp_path: Path) -> None:
    secret_dir = tmp_path / "learner-run"
    secret_dir.mkdir()
    (secret_dir / "weights.safetensors").write_text("not for workers")
    shown = network.run("a", ["ls", "-A", str(secret_dir)], hidden=[secret_dir])
    assert shown.returncode == 0 and shown.stdout == "", shown  # an empty directory in its view
    # what it writes there stays in its view: the real directory is untouched
    wrote = network.run(
        "a", ["sh", "-c", f"echo x > {secret_dir}/mine && ls {secret_dir}"], hidden=[secret_dir]
    )
    assert wrote.stdout.split() == ["mine"], wrote
    assert sorted(p.name for p in secret_dir.iterdir()) == ["weights.safetensors"]
    # another process of the same host, without the hidden directory, sees it; the mount did not leak
    assert network.run("a", ["ls", str(secret_dir)]).stdout.split() == ["weights.safetensors"]
    assert network.run("b", ["ls", str(secret_dir)]).stdout.split() == ["weights.safetensors"]


def test_cleanup_leaves_nothing_also_when_the_test_fails(tmp_path: Path) -> None:
    require_namespaces()
    before = set(namespaces())
    procs = []
    with pytest.raises(RuntimeError, match="the test failed"), Network(["x", "y", "z"]) as net:
        assert len(set(namespaces()) - before) == 4  # the switch and three hosts
        for name in ("x", "y"):
            procs.append(net.start(name, ["sleep", "600"], tmp_path / f"{name}.log"))
        raise RuntimeError("the test failed")
    assert net.leftovers() == []
    assert set(namespaces()) - before == set()
    assert all(p.poll() is not None for p in procs)  # killed and reaped
    net.close()  # idempotent


def test_a_network_whose_maker_was_killed_is_swept_by_the_next() -> None:
    require_namespaces()
    tests = str(Path(__file__).parent)
    maker = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; sys.path.insert(0, {tests!r}); from netns import Network; "
         "net = Network(['a', 'b']); print(net.tag, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert maker.stdout is not None
    tag = maker.stdout.readline().strip()
    assert tag and len([n for n in namespaces() if n.startswith(tag)]) == 3, tag
    maker.kill()  # SIGKILL: no close()
    maker.wait(60)
    assert len([n for n in namespaces() if n.startswith(tag)]) == 3  # left behind
    with Network(["c"]):
        assert [n for n in namespaces() if n.startswith(tag)] == []
