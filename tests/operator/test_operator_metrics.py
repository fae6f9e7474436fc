"""Operator metrics and live progress against the Kubernetes API emulator: a real loader metrics
endpoint on loopback stands in for a running init container (the emulated pod's `podIP`)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from dlo_loader import metrics as loader_metrics
from dlo_loader.progress import Progress
from dlo_operator import metrics, progress
from dlo_bench.s3server import free_port
from dlo_operator.kube import _api_error
from kubernetes.client.exceptions import ApiException
from support.operator_harness import (
    DOD_PATH,
    DOD_RESOURCE,
    NAMESPACE,
    PODS_PATH,
    ClusterEmulator,
    Operator,
    eventually,
    fill_secret,
    live,
    request,
    workload_pod,
)
from support.scrape import scrape, value

from dlo_contract.fill_proof import summary_proof

GIB = 1 << 30


SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def loader_fill() -> Progress:
    """The fill a loader's real `/metrics` endpoint serves: 1 GiB of 4 GiB written."""
    fill = Progress(total_bytes=4 * GIB, prefix="")
    fill.add(written=GIB, from_store=GIB)
    fill.phase = "transferring"
    loader_metrics.FILL.attach(fill)
    return fill


@pytest.fixture
def loader_endpoint(loader_fill: Progress) -> Iterator[tuple[loader_metrics.Endpoint, Progress]]:
    """A loader's real endpoint, keyed by `SECRET`."""
    endpoint = loader_metrics.Endpoint(0, addr="127.0.0.1", secret=SECRET)
    try:
        yield endpoint, loader_fill
    finally:
        endpoint.close()


@pytest.fixture(scope="module")
def operator_port() -> int:
    return metrics.serve(0, addr="127.0.0.1")


async def test_live_progress_from_the_loader_endpoint_and_operator_metrics(
        cluster: ClusterEmulator, operator: Operator, loader_fill: Progress,
        operator_port: int) -> None:
    port = free_port()
    before = scrape(operator_port)
    await request(cluster, "POST", DOD_PATH, {
        "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
        "metadata": {"name": "flux", "namespace": NAMESPACE},
        "spec": {"replicas": 1, "model": {"source": "s3://models/flux/"},
                 "inference": {"image": "server:1"}, "loader": {"metricsPort": port}}})

    def reconciled() -> bool:
        """the create reconcile is counted"""
        return value(scrape(operator_port), "dlo_operator_reconciles_total",
                     outcome="applied") > value(before, "dlo_operator_reconciles_total",
                                                outcome="applied")

    await eventually(reconciled)  # pods come after the create handler, as in a cluster
    # The pod's loader holds the DOD's fill secret, which the operator made first.
    endpoint = loader_metrics.Endpoint(port, addr="127.0.0.1", secret=fill_secret(cluster, "flux"))
    await request(cluster, "POST", PODS_PATH, workload_pod(cluster, "flux", 0, "gpu-0"))
    await request(cluster, "PATCH", f"{PODS_PATH}/flux-0/status", {"status": {
        "podIP": "127.0.0.1", "initContainerStatuses": [
            {"name": "loader", "restartCount": 0, "state": {"running": {}}}]}})

    def progress_shown() -> dict:
        """the loader's progress appears in the DOD status"""
        return live(cluster, DOD_RESOURCE, "flux")["status"]["progress"]

    shown = await eventually(progress_shown)
    node = shown["nodes"][0]
    assert (node["pod"], node["node"], node["bytesDone"], node["bytesTotal"], node["phase"],
            node["stalled"]) == ("flux-0", "gpu-0", GIB, 4 * GIB, "transferring", False)
    assert node["bytesPerSecond"] > 0 and node["etaSeconds"] >= 0
    assert shown["summary"].startswith("25% 1.0 GiB/4.0 GiB, ")
    assert "ETA" in shown["summary"]

    during = scrape(operator_port)
    assert value(during, "dlo_operator_deployments", phase="Loading") == 1
    assert value(during, "dlo_operator_progress_reads_total", outcome="ok") >= 1

    # The fill ends: the sidecar publishes and stays up, ready; the progress goes and the
    # operator keeps the summary its endpoint serves on the pod, so the node row has the figures.
    summary = {"status": "ok", "entry_id": "e" * 64, "mode": "independent", "rank": 0,
               "world_size": 1, "bytes_from_store": 4 * GIB, "bytes_from_peers": 0,
               "bytes_to_peers": 0, "seconds": 9.5, "cached": False}
    endpoint.publish_summary(json.dumps(summary))
    await request(cluster, "PATCH", f"{PODS_PATH}/flux-0/status", {"status": {
        "initContainerStatuses": [{"name": "loader", "restartCount": 0, "ready": True,
                                   "state": {"running": {}}}]}})

    def progress_gone() -> bool:
        """the progress is removed once no loader fills, and the node row has the figures"""
        status = live(cluster, DOD_RESOURCE, "flux")["status"]
        node = status["nodes"][0]
        return ("progress" not in status and node["loader"] == "Cached"
                and node.get("bytesFromStore") == 4 * GIB)

    await eventually(progress_gone)
    pod = live(cluster, "v1/pods", "flux-0")
    assert json.loads(pod["metadata"]["annotations"]["dlo.dev/fill-summary"]) == summary

    def fill_counted() -> bool:
        """the reconcile counts the fill right after it writes the status the test saw"""
        return value(scrape(operator_port), "dlo_operator_fills_total", outcome="ok") == value(
            before, "dlo_operator_fills_total", outcome="ok") + 1

    await eventually(fill_counted)
    endpoint.close()


def test_filling_loaders_are_read_and_a_published_sidecar_summary_once(
        loader_endpoint: tuple[loader_metrics.Endpoint, Progress]) -> None:
    endpoint, _fill = loader_endpoint
    sidecar = {"name": "loader", "ready": True, "state": {"running": {}}}
    filling = {"name": "loader", "ready": False, "state": {"running": {}}}
    pods = [{"metadata": {"name": f"p-{i}", **meta}, "status": {"podIP": "127.0.0.1",
             "initContainerStatuses": [loader]}}
            for i, (loader, meta) in enumerate([
                (sidecar, {}), (filling, {}),
                (sidecar, {"annotations": {"dlo.dev/fill-summary": "{}"}})])]
    prefill = {"metadata": {"name": "p-prefill-0"}, "status": {"podIP": "127.0.0.1",
               "containerStatuses": [sidecar]}}  # no readiness probe: ready while it fills
    assert [p["metadata"]["name"] for p in progress.running_loaders([*pods, prefill])] == [
        "p-1", "p-prefill-0"]
    assert [p["metadata"]["name"] for p in progress.published_without_summary(pods)] == ["p-0"]
    proof = summary_proof(SECRET)
    assert progress.read_summary("127.0.0.1", endpoint.port, proof) is None  # 404 before the end
    line = json.dumps({"status": "ok", "entry_id": "e" * 64, "cached": True})
    endpoint.publish_summary(line)
    assert progress.read_summary("127.0.0.1", endpoint.port, proof) == line
    assert progress.read_summary("127.0.0.1", endpoint.port, summary_proof(b"x" * 32)) is None


def test_api_errors_are_counted_by_kind(operator_port: int) -> None:
    before = scrape(operator_port)
    _api_error("statefulsets inference/flux", ApiException(status=409, reason="Conflict"))
    _api_error("statefulsets inference/flux", ApiException(status=403, reason="Forbidden"))
    after = scrape(operator_port)
    for kind in ("conflict", "forbidden"):
        assert value(after, "dlo_operator_api_errors_total", kind=kind) == value(
            before, "dlo_operator_api_errors_total", kind=kind, default=0) + 1


def test_stalled_loader_shows_stalled_and_no_eta() -> None:
    reading = progress.LoaderReading(bytes_done=10, bytes_total=100, bytes_per_second=0.0,
                                     stalled=True, phase="transferring")
    status = progress.progress_status([({"metadata": {"name": "p-0"}}, reading)])
    assert status is not None
    assert "etaSeconds" not in status["nodes"][0]
    assert status["summary"] == "10% 10 B/100 B, 0 B/s, stalled (1 of 1 loaders)"
    assert progress.progress_status([]) is None


def test_a_trickling_loaders_eta_is_bounded_and_spelled_as_the_loader_does() -> None:
    """1 KiB/s with 4 GiB left: the summary said `ETA 4194303 s`."""
    reading = progress.LoaderReading(bytes_done=1024, bytes_total=4 << 30,
                                     bytes_per_second=1024.0, stalled=False,
                                     phase="transferring")
    status = progress.progress_status([({"metadata": {"name": "p-0"}}, reading)])
    assert status is not None
    assert status["summary"] == "0% 1.0 KiB/4.0 GiB, 1.0 KiB/s, ETA over 24 h"
