"""The operator's reads of the loaders' endpoints, which answer from pods a tenant runs: a reply
trickled a few bytes at a time is cut at the read's deadline, a redirect is not followed, a reply
past the size cap is dropped; and 32 DODs whose pods trickle do not hold up another DOD's
reconcile (against the Kubernetes API emulator). Loopback servers stand in for the pods; they
trickle until the test releases them (an event), so a read that is not cut never ends."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from support.operator_harness import (
    DOD_PATH,
    NAMESPACE,
    PODS_PATH,
    ClusterEmulator,
    Operator,
    eventually,
    live,
    request,
    workload_pod,
)

from dlo_operator import progress

HANG_GUARD_S = 60.0
"""How long a test waits for a read that must end (a hang guard, not a timing assertion)."""
STOP_GUARD_S = 300.0
METRICS = (b"dlo_loader_bytes_done_bytes 1.0\n"
           b"dlo_loader_bytes_total_bytes 4.0\n")
SLOW_DODS = 32


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class PodServer:
    """A loopback server standing for a pod's loader endpoint: `answer(handler)` writes each
    reply; `connections` counts the requests, `release` ends every trickle."""

    def __init__(self, answer: str) -> None:
        self.release = threading.Event()
        self.connections = 0
        self.trickled = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # the request's head
                with outer._lock:
                    outer.connections += 1
                try:
                    getattr(outer, answer)(self.wfile)
                except OSError:
                    pass  # the reader went away

        self._server = _Server(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def trickle(self, out: socketserver._SocketWriter) -> None:  # type: ignore[name-defined]
        """200 and the metrics, then a comment line 10 bytes at a time until released."""
        out.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + METRICS)
        while not self.release.wait(0.05):
            out.write(b"# 12345678")
            with self._lock:
                self.trickled += 1
        out.write(b"\n")

    def redirect(self, out: socketserver._SocketWriter) -> None:  # type: ignore[name-defined]
        out.write(b"HTTP/1.0 302 Found\r\nLocation: http://127.0.0.1:%d/metrics\r\n"
                  b"Content-Length: 0\r\n\r\n" % self.target)

    def metrics(self, out: socketserver._SocketWriter) -> None:  # type: ignore[name-defined]
        out.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + METRICS)

    def too_large(self, out: socketserver._SocketWriter) -> None:  # type: ignore[name-defined]
        out.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + METRICS)
        out.write(b"# padding padding padding padding padding padding padding\n" * 40_000)

    target = 0
    """Where `redirect` sends the reader."""

    def close(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()


@pytest_asyncio.fixture()
async def busy_operator(cluster: ClusterEmulator) -> AsyncIterator[Operator]:
    """The operator, given time to stop: the reconciles of 33 DODs queued on kopf's pool end
    first."""
    operator = Operator(stop_timeout_s=STOP_GUARD_S)
    await operator.start()
    try:
        yield operator
    finally:
        await operator.stop()


@pytest.fixture
def pods() -> Iterator[dict[str, PodServer]]:
    made: dict[str, PodServer] = {}

    class Servers(dict):  # type: ignore[type-arg]
        def __missing__(self, answer: str) -> PodServer:
            made[answer] = self[answer] = PodServer(answer)
            return self[answer]

    yield Servers()
    for server in made.values():
        server.close()


def _read_in_thread(port: int, deadline_s: float) -> list[object]:
    """`read_loader` of a pod on `port`, in a thread joined up to the hang guard: [its result],
    or [] when it had not ended."""
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(
        progress.read_loader("127.0.0.1", port, deadline_s)), daemon=True)
    reader.start()
    reader.join(HANG_GUARD_S)
    return result


def test_a_trickling_reply_is_cut_at_the_reads_deadline(pods: dict[str, PodServer]) -> None:
    """10 bytes every 50 ms keep each socket read alive; the read still ends at its deadline,
    with no reading, while the pod is still trickling."""
    slow = pods["trickle"]
    assert _read_in_thread(slow.port, 0.5) == [None]
    assert not slow.release.is_set() and slow.trickled > 0


def test_a_redirect_is_not_followed(pods: dict[str, PodServer]) -> None:
    target = pods["metrics"]
    assert progress.read_loader("127.0.0.1", target.port) is not None  # a reading, asked directly
    pods["redirect"].target = target.port
    assert progress.read_loader("127.0.0.1", pods["redirect"].port) is None
    assert target.connections == 1  # the redirect's target was never asked


def test_a_reply_past_the_size_cap_is_dropped(pods: dict[str, PodServer]) -> None:
    assert progress.read_loader("127.0.0.1", pods["too_large"].port) is None


@pytest.mark.slow
async def test_slow_pods_of_32_dods_do_not_hold_up_another_dods_reconcile(
        cluster: ClusterEmulator, busy_operator: Operator, pods: dict[str, PodServer]) -> None:
    """32 DODs each have a filling pod whose endpoint trickles until released: their progress
    reads run off kopf's pool and end at their deadline, so a new DOD's create reconcile
    applies its StatefulSet while every one of them still trickles."""
    slow = pods["trickle"]
    for number in range(SLOW_DODS):
        name = f"slow-{number}"
        await request(cluster, "POST", DOD_PATH, _dod(name, slow.port))
        await request(cluster, "POST", PODS_PATH, workload_pod(cluster, name, 0, "gpu-0"))
        await request(cluster, "PATCH", f"{PODS_PATH}/{name}-0/status", {"status": {
            "podIP": "127.0.0.1", "initContainerStatuses": [
                {"name": "loader", "restartCount": 0, "ready": False,
                 "state": {"running": {}}}]}})

    def reading() -> bool:
        """the operator reads the slow pods"""
        return slow.trickled > 0

    await eventually(reading, timeout=HANG_GUARD_S)
    await request(cluster, "POST", DOD_PATH, _dod("late", slow.port))

    def applied() -> bool:
        """the late DOD's StatefulSet is applied"""
        return live(cluster, "apps/v1/statefulsets", "late") is not None

    await eventually(applied, timeout=HANG_GUARD_S)
    assert not slow.release.is_set()  # every slow pod trickled throughout


def _dod(name: str, port: int) -> dict[str, object]:
    return {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": 1, "model": {"source": "s3://models/flux/"},
                     "inference": {"image": "server:1"}, "loader": {"metricsPort": port}}}
