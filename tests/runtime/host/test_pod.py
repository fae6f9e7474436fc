"""The in-pod entry point: settings document and entry file in, offloaded DiT out, equal to the
resident model bit for bit, whatever backs its host weights."""

from __future__ import annotations

import copy
import gc
import json
import logging
import threading
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from support.host_helpers import publish_checkpoint, rank_local, write_entry_file
from torch import nn

from dlo_bench.models import example_inputs
from dlo_contract import names
from dlo_runtime import is_enabled, metrics, pod
from dlo_runtime.host_weight_plan import BackingKind
from dlo_runtime.run_stats import OffloadStats, TransferStats
from dlo_runtime.tensors import OffloadError


@pytest.fixture
def pod_files(tmp_path: Path, flux_layout: Path, monkeypatch: pytest.MonkeyPatch):
    """A published checkpoint entry, `entry.json` and a settings document, found through the
    pod's environment as the operator sets it."""
    root = tmp_path / "cache"
    entry = publish_checkpoint(root, flux_layout)
    monkeypatch.setenv(names.ENTRY_FILE_ENV, str(write_entry_file(tmp_path, entry)))

    def configure(**fields: object) -> None:
        document = tmp_path / "settings.json"
        document.write_text(rank_local(root, **fields).to_json())
        monkeypatch.setenv("DLO_CONFIG", str(document))

    configure()
    return configure


def resident_output(flux: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return flux(**example_inputs("flux", flux))[0]


def offloaded_output(dit: nn.Module, flux: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return dit(**example_inputs("flux", flux))[0]


def test_checkpoint_plan_over_the_entry_matches_the_resident_model(
        pod_files, flux: nn.Module) -> None:
    dit = pod.build_dit(FluxTransformer2DModel)
    assert all(p.is_meta for p in dit.parameters())
    handle = pod.enable(dit, device="cpu")
    try:
        assert handle.backing() is BackingKind.CHECKPOINT
        assert torch.equal(offloaded_output(dit, flux), resident_output(flux))
        with open("/proc/self/maps") as maps:
            assert "/v1/entries/" in maps.read()
    finally:
        handle.close()


def test_enabling_an_offloaded_dit_again_is_refused_and_the_handle_reports(
        pod_files, flux: nn.Module) -> None:
    dit = copy.deepcopy(flux)
    handle = pod.enable(dit, device="cpu")
    try:
        with pytest.raises(OffloadError, match="^FluxTransformer2DModel is already offloaded "
                                               "by dlo$"):
            pod.enable(dit, device="cpu")
        for _ in range(2):
            assert torch.equal(offloaded_output(dit, flux), resident_output(flux))
        stats = handle.stats()
        assert (stats.total.forwards, stats.last_forward.forwards) == (2, 1)
        assert stats.last_forward.blocks_loaded == stats.streamed_blocks == 5
        assert stats.total.blocks_loaded == 11  # and the load primed at enable
        assert 0.5 < handle.streamed_share < 1
    finally:
        handle.close()


def test_a_closed_handle_leaves_the_servers_other_metrics_scrapable(
        pod_files, flux: nn.Module) -> None:
    """A server registers the collector in its own registry; after `close()` (a model swapped
    out, shutdown) its scrapes went on failing with the handle's KeyError, taking the server's
    own metrics down with them. Now the collector reports nothing."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    Counter("server_requests", "the server's own metric", registry=registry).inc()
    handle = pod.enable(copy.deepcopy(flux), device="cpu")
    registry.register(metrics.OffloadCollector(handle.stats))
    assert b"dlo_runtime_forwards_total" in generate_latest(registry)
    handle.close()
    scraped = generate_latest(registry)
    assert b"server_requests_total 1.0" in scraped and b"dlo_runtime_" not in scraped
    with pytest.raises(metrics.NoStatistics, match="^the offload handle is closed: transformer "):
        handle.stats()


def test_offload_disabled_keeps_the_dit_resident_behind_a_handle_with_nothing_to_undo(
        pod_files, flux: nn.Module, caplog: pytest.LogCaptureFixture) -> None:
    """The documented server sequence (build_dit, enable, serve, close) runs unchanged when
    `offload.enabled` is false: the DiT loads ordinarily, moves to the device whole, and the
    handle's backing, stats, metrics and close work with nothing streamed."""
    pod_files(**{"offload.enabled": False})
    dit = pod.build_dit(FluxTransformer2DModel)
    with caplog.at_level(logging.INFO, logger="dlo_runtime.pod"):
        handle = pod.enable(dit, device="cpu")
    try:
        assert [r.getMessage() for r in caplog.records if r.name == "dlo_runtime.pod"] == [
            "dlo: offload.enabled=false: transformer resident on cpu, nothing streams"]
        assert not is_enabled(dit) and not dit._forward_hooks
        assert torch.equal(offloaded_output(dit, flux), resident_output(flux))
        assert handle.backing() is BackingKind.ORDINARY
        assert (handle.slot_bytes, handle.streamed_share) == (0, 0.0)
        assert handle.stats() == OffloadStats(TransferStats(), TransferStats(),
                                              streamed_blocks=0, mode="resident")
        series = {s.name: s.value for family in metrics.OffloadCollector(handle.stats).collect()
                  for s in family.samples}
        assert series["dlo_runtime_forwards_total"] == series["dlo_runtime_streamed_blocks"] == 0
    finally:
        handle.close()
    handle.close()
    assert torch.equal(offloaded_output(dit, flux), resident_output(flux))
    moved = copy.deepcopy(flux)
    pod.enable(moved, device="meta").close()  # the one device a CPU-only test can move it to
    assert all(p.is_meta for p in moved.parameters())
    pod_files(**{"offload.enabled": False, "offload.model_cpu_offload": True})
    kept = copy.deepcopy(flux)
    pod.enable(kept, device="meta").close()  # the server's CPU offload places it
    assert not any(p.is_meta for p in kept.parameters())


def test_runtime_cache_plan_matches_the_resident_model(pod_files, flux: nn.Module) -> None:
    pod_files(**{"offload.enable_runtime_cache": True})
    dit = copy.deepcopy(flux)
    handle = pod.enable(dit, device="cpu")
    try:
        assert handle.backing() is BackingKind.RUNTIME_CACHE
        assert torch.equal(offloaded_output(dit, flux), resident_output(flux))
    finally:
        handle.close()


def test_pipeline_without_entry_keeps_ordinary_tensors(
        pod_files, flux: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(names.ENTRY_FILE_ENV, str(tmp_path / "absent.json"))

    class Pipeline:
        transformer = copy.deepcopy(flux)

    handle = pod.enable(Pipeline(), device="cpu")
    try:
        assert handle.backing("transformer") is BackingKind.ORDINARY
        assert torch.equal(offloaded_output(Pipeline.transformer, flux), resident_output(flux))
    finally:
        handle.close()


def test_rejected_preflight_loads_ordinarily(pod_files, flux: nn.Module) -> None:
    pod_files(**{"parallel.tp": 2})
    dit = pod.build_dit(FluxTransformer2DModel)
    assert not any(p.is_meta for p in dit.parameters())
    assert all(torch.equal(a, b) for a, b in zip(dit.state_dict().values(),
                                                 flux.state_dict().values()))


def test_weightless_dit_without_an_accepted_plan_is_a_startup_error(pod_files) -> None:
    dit = pod.build_dit(FluxTransformer2DModel)
    pod_files(**{"parallel.tp": 2})
    with pytest.raises(pod.PodError) as caught:
        pod.enable(dit, device="cpu")
    assert str(caught.value) == (
        "transformer was built without weights but its checkpoint plan was rejected: tensor "
        "parallelism is on (parallel.tp=2); each rank holds a slice, not the stored tensors")


def test_a_backend_that_cannot_be_built_leaves_its_plan_closed(
        pod_files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan (the entry held in use, its mapping, and on CUDA its registered pages) exists
    before the backend; a backend constructor that raises must not leave it open behind the
    error, or a server that carries on (resident, or after fixing its settings) keeps the entry
    pinned and in use until it exits."""
    from dlo_contract.cache import list_entries
    from dlo_runtime import backend, host_weight_plan

    def refuse(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("no device slots")

    closed: list[object] = []
    close = host_weight_plan.HostWeightPlan.close

    def spy(self: host_weight_plan.HostWeightPlan) -> None:
        closed.append(self)
        close(self)

    monkeypatch.setattr(backend.DistributedLayerwiseOffloadBackend, "__init__", refuse)
    monkeypatch.setattr(host_weight_plan.HostWeightPlan, "close", spy)
    dit = pod.build_dit(FluxTransformer2DModel)
    closed.clear()
    with pytest.raises(RuntimeError, match="no device slots"):
        pod.enable(dit, device="cpu")
    assert len(closed) == 1
    assert [e.in_use for e in list_entries(tmp_path / "cache")] == [False]


def test_unreadable_entry_file(tmp_path: Path) -> None:
    bad = tmp_path / "entry.json"
    bad.write_text(json.dumps({"entry_id": "x"}))
    with pytest.raises(pod.PodError) as caught:
        pod.read_entry_file(bad)
    assert str(caught.value) == (f"entry file {bad} is unreadable: entry document lacks 'kind', "
                                 "'root', 'path', 'source'")


def test_build_dit_waits_for_the_sidecar_to_publish_the_entry(
        pod_files, flux: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod's loader is a native sidecar: the server may reach `build_dit` before the entry
    document exists, and waits for it (`DLO_ENTRY_WAIT_SECONDS`) instead of failing."""
    published = tmp_path / "entry.json"
    document = published.read_text()
    published.unlink()
    monkeypatch.setenv(names.ENTRY_WAIT_ENV, "60")
    timer = threading.Timer(0.3, published.write_text, args=(document,))
    timer.start()
    try:
        dit = pod.build_dit(FluxTransformer2DModel)
    finally:
        timer.join()
    handle = pod.enable(dit, device="cpu")
    try:
        assert torch.equal(offloaded_output(dit, flux), resident_output(flux))
    finally:
        handle.close()


def test_a_wait_past_its_deadline_names_the_entry_file_and_where_to_look(
        pod_files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nowhere.json"
    monkeypatch.setenv(names.ENTRY_WAIT_ENV, "0.2")
    with pytest.raises(pod.PodError) as caught:
        pod.build_dit(FluxTransformer2DModel, entry_file=str(missing))
    assert str(caught.value).startswith(f"no entry file at {missing} after 0 s: the loader has "
                                        "not published the checkpoint")
    assert "kubectl logs POD -c loader" in caught.value.hint
    monkeypatch.setenv(names.ENTRY_WAIT_ENV, "soon")
    with pytest.raises(pod.PodError, match="DLO_ENTRY_WAIT_SECONDS='soon' is not a number"):
        pod.build_dit(FluxTransformer2DModel, entry_file=str(missing))


def test_enabling_a_weightless_dit_skips_the_full_collection(
        pod_files, flux: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weightless DiT frees nothing at enable, so no full garbage collection (~0.2 s with torch
    and diffusers loaded) is paid; a DiT that held its weights still gets one."""
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or 0)
    handle = pod.enable(pod.build_dit(FluxTransformer2DModel), device="cpu")
    try:
        assert collections == []
    finally:
        handle.close()
    collections.clear()
    resident = copy.deepcopy(flux)
    handle = pod.enable(resident, device="cpu")
    try:
        assert collections
    finally:
        handle.close()


def test_close_closes_every_backend_and_plan_when_one_raises_and_then_raises_the_first() -> None:
    """A backend whose DLO group drifted raises `OffloadError` from `disable` once it has torn
    down alone; the handle still disables the others and closes every plan (an entry left in
    use, or registered pages, would outlive the error)."""
    done: list[str] = []

    class Backend:
        def __init__(self, name: str, error: OffloadError | None) -> None:
            self.name, self.error = name, error

        def disable(self, *, restore: bool) -> None:
            done.append(f"disable {self.name} restore={restore}")
            if self.error is not None:
                raise self.error

    class Plan:
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> None:
            done.append(f"close {self.name}")

    first, second = OffloadError("drift in b"), OffloadError("drift in a")
    offloaded = [pod._Offloaded(name, Backend(name, error), Plan(name))  # type: ignore[arg-type]
                 for name, error in (("a", second), ("b", first), ("c", None))]
    handle = pod.OffloadHandle(torch.device("cpu"), offloaded)
    with pytest.raises(OffloadError) as caught:
        handle.close()
    assert caught.value is first
    assert done == ["disable c restore=False", "close c", "disable b restore=False", "close b",
                    "disable a restore=False", "close a"]


def test_a_failed_enable_reports_its_own_error_when_closing_what_it_enabled_raises(
        pod_files, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pod.enable` closes what it enabled before a failure; an `OffloadError` from that close (a
    drifted group) is logged, and the startup error is the one raised."""
    from dlo_runtime import backend

    def fail(self: backend.DistributedLayerwiseOffloadBackend) -> None:
        self.enabled = True  # as far as close() can tell
        raise RuntimeError("no device slots")

    def drifted(self: backend.DistributedLayerwiseOffloadBackend, *, restore: bool) -> None:
        raise OffloadError("drifted")

    monkeypatch.setattr(backend.DistributedLayerwiseOffloadBackend, "enable", fail)
    monkeypatch.setattr(backend.DistributedLayerwiseOffloadBackend, "disable", drifted)
    dit = pod.build_dit(FluxTransformer2DModel)
    with pytest.raises(RuntimeError, match="^no device slots$"):
        pod.enable(dit, device="cpu")
