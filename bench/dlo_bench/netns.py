"""Simulated nodes on one machine: network namespaces joined by a shaped bridge.

Owns the creation and the removal of the namespaces, links and traffic shaping that the cluster
benchmark (`dlo_bench.cluster`) runs its object store and loaders in. Every member (the store
and each node) is a namespace with one interface, `eth0`, plugged into a bridge that lives in a
switch namespace of its own, so nothing is added to the host's own network stack. Each node has
two shaped paths, both directions:

    node <-> store   capped at `store_mbit` (an htb class matched on the store's address)
    node <-> nodes   capped at `peer_mbit`  (the htb default class)

Shaping sits on the node's `eth0` (what the node sends) and on the bridge port facing the node
(what the node receives), so the store's own port is never the limit. Addresses come from
198.18.0.0/15, the range set aside for benchmarking network devices (RFC 2544), and exist only
inside these namespaces.

Names are unique per run; `cluster()` removes everything it made when its block ends, when the
process exits (atexit) and on SIGTERM. It must not touch namespaces it did not create, and it
needs root and iproute2 (`ip`, `tc`): without them it raises `NetnsUnavailable` with the reason.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dlo_contract.errors import PermanentError

log = logging.getLogger(__name__)

NAME_PREFIX = "dlo-bench-"
INTERFACE = "eth0"
_SUBNET_PREFIX = "198.18.0"
_STORE_HOST = 1
_FIRST_NODE_HOST = 11


class NetnsUnavailable(PermanentError):
    """Namespaces or traffic shaping cannot be set up here (not root, no iproute2, no kernel)."""


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """Rates of the simulated links."""

    store_mbit: float
    """Each node's link to the object store, Mbit/s, both directions (R in the report)."""

    peer_mbit: float
    """Each node's link to the other nodes, Mbit/s, both directions; higher than `store_mbit`
    as in a cluster whose nodes share a fast fabric but reach storage through a slower path."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The namespaces of one run and the addresses inside them."""

    run_id: str
    switch_ns: str
    store_ns: str
    node_ns: tuple[str, ...]
    store_addr: str
    node_addrs: tuple[str, ...]
    links: LinkConfig

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.switch_ns, self.store_ns, *self.node_ns)

    def exec_argv(self, ns: str, argv: Sequence[str]) -> list[str]:
        """The command line that runs `argv` inside namespace `ns`."""
        return ["ip", "netns", "exec", ns, *argv]


@dataclass(frozen=True, kw_only=True)
class NodeTraffic:
    """Bytes on the wire (headers included) through one node's shaped classes, as counted by the
    kernel: an account of who read what that does not rely on the loaders' own claims."""

    from_store: int
    from_peers: int
    to_store: int
    to_peers: int

    def minus(self, before: NodeTraffic) -> NodeTraffic:
        return NodeTraffic(
            from_store=self.from_store - before.from_store,
            from_peers=self.from_peers - before.from_peers,
            to_store=self.to_store - before.to_store,
            to_peers=self.to_peers - before.to_peers,
        )


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when the prerequisites are present."""
    if os.geteuid() != 0:
        return "network namespaces need root (running as uid %d)" % os.geteuid()
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found; install iproute2 (apt-get install -y iproute2)"
    return None


def list_namespaces(prefix: str = NAME_PREFIX) -> list[str]:
    """Names of the existing namespaces that start with `prefix` (this module's by default)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    names = (line.split()[0] for line in out.stdout.splitlines() if line.strip())
    return sorted(name for name in names if name.startswith(prefix))


_CLASS_SENT = re.compile(r"^class htb (\S+) .*?\n\s*Sent (\d+) bytes", re.MULTILINE)


def _class_bytes(ns: str, dev: str) -> dict[str, int]:
    """Bytes sent per htb class of `dev` in `ns` (`tc -s class show`; its JSON form leaves the
    htb counters out in iproute2 6.1, hence the text)."""
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "class", "show", "dev", dev],
                         capture_output=True, text=True, check=True).stdout
    return {classid: int(sent) for classid, sent in _CLASS_SENT.findall(out)}


def node_traffic(cluster: Cluster, node: int) -> NodeTraffic:
    """The kernel's byte counters of node `node`'s links since the cluster was made."""
    received = _class_bytes(cluster.switch_ns, f"p-n{node}")
    sent = _class_bytes(cluster.node_ns[node], INTERFACE)
    return NodeTraffic(from_store=received["1:10"], from_peers=received["1:20"],
                       to_store=sent["1:10"], to_peers=sent["1:20"])


_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/var/run/netns"


def thread_in(ns: str, target: Callable[[], None], *, name: str) -> threading.Thread:
    """Start a daemon thread that enters namespace `ns` (setns(2) moves the calling thread
    alone: this process's other threads and sockets stay where they are) and runs `target`
    there: the benchmark reads a node's loopback services (its loader's /metrics) without a
    process per node and without crossing a shaped link, so no counted byte is the bench's."""
    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(os.path.join(_NETNS_DIR, ns)) as handle:
            if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {ns}")
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _tc(ns: str, *args: str) -> None:
    _run(["ip", "netns", "exec", ns, "tc", *args])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsUnavailable(
            f"`{' '.join(argv)}` failed with exit status {done.returncode}: "
            f"{done.stderr.strip() or done.stdout.strip()}",
            hint="run as root on a kernel with network namespaces, veth, bridge and htb",
        )


def _htb(ns: str, dev: str, match: str, addr: str, links: LinkConfig) -> None:
    """Two htb classes on `dev`: traffic whose `match` (src/dst) is `addr` gets the store rate,
    everything else the peer rate. rate == ceil, so neither class borrows from the other."""
    _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
    for classid, mbit in (("1:10", links.store_mbit), ("1:20", links.peer_mbit)):
        # A burst of ~2 ms at the rate (at least one 64 KiB GSO segment) keeps the achieved rate
        # close to the configured one without letting the first second run unshaped.
        burst = max(65536, int(mbit * 1e6 / 8 * 0.002))
        rate = f"{mbit:g}mbit"
        _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb",
            "rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst),
            "quantum", "60000")
    _tc(ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
        "u32", "match", "ip", match, f"{addr}/32", "flowid", "1:10")


def _plan(nodes: int, links: LinkConfig) -> Cluster:
    run_id = f"{os.getpid():x}{secrets.token_hex(2)}"
    base = f"{NAME_PREFIX}{run_id}"
    return Cluster(
        run_id=run_id,
        switch_ns=f"{base}-sw",
        store_ns=f"{base}-store",
        node_ns=tuple(f"{base}-n{i}" for i in range(nodes)),
        store_addr=f"{_SUBNET_PREFIX}.{_STORE_HOST}",
        node_addrs=tuple(f"{_SUBNET_PREFIX}.{_FIRST_NODE_HOST + i}" for i in range(nodes)),
        links=links,
    )


def _attach(cluster: Cluster, ns: str, port: str, addr: str) -> None:
    """A veth from the bridge (port `port`) to `ns` (`eth0` with `addr`)."""
    _ip("-n", cluster.switch_ns, "link", "add", port, "type", "veth",
        "peer", "name", INTERFACE, "netns", ns)
    _ip("-n", cluster.switch_ns, "link", "set", port, "master", "br0", "up")
    _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", INTERFACE)
    _ip("-n", ns, "link", "set", INTERFACE, "up")
    _ip("-n", ns, "link", "set", "lo", "up")


def _build(cluster: Cluster) -> None:
    for ns in cluster.namespaces:
        _ip("netns", "add", ns)
    _ip("-n", cluster.switch_ns, "link", "add", "br0", "type", "bridge")
    _ip("-n", cluster.switch_ns, "link", "set", "br0", "up")
    _attach(cluster, cluster.store_ns, "p-store", cluster.store_addr)
    for i, (ns, addr) in enumerate(zip(cluster.node_ns, cluster.node_addrs)):
        port = f"p-n{i}"
        _attach(cluster, ns, port, addr)
        _htb(ns, INTERFACE, "dst", cluster.store_addr, cluster.links)
        _htb(cluster.switch_ns, port, "src", cluster.store_addr, cluster.links)


def _teardown(names: Sequence[str]) -> None:
    """Delete the namespaces (their veths and qdiscs go with them). Never raises: it runs from
    finally blocks and atexit, where an error would hide the one that caused the teardown."""
    for ns in names:
        done = subprocess.run(["ip", "netns", "delete", ns], capture_output=True, text=True)
        if done.returncode != 0 and "No such file" not in done.stderr:
            log.warning("could not delete network namespace %s: %s", ns, done.stderr.strip())


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while the cluster exists, so finally blocks remove it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, _frame: Any) -> None:
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def cluster(nodes: int, links: LinkConfig) -> Iterator[Cluster]:
    """Create a store namespace and `nodes` node namespaces with shaped links; remove them all
    when the block ends (also on error, SIGTERM, or interpreter exit)."""
    reason = unavailable_reason()
    if reason is not None:
        raise NetnsUnavailable(reason)
    if nodes < 1:
        raise ValueError(f"nodes must be at least 1, got {nodes}")
    plan = _plan(nodes, links)
    names = list(plan.namespaces)

    def _cleanup() -> None:
        _teardown(names)

    atexit.register(_cleanup)
    started = time.perf_counter()
    try:
        with _sigterm_unwinds():
            _build(plan)
            log.info("cluster %s: %d nodes, store %s Mbit/s, peers %s Mbit/s (%.1f s to set up)",
                     plan.run_id, nodes, f"{links.store_mbit:g}", f"{links.peer_mbit:g}",
                     time.perf_counter() - started)
            yield plan
    finally:
        _cleanup()
        atexit.unregister(_cleanup)

