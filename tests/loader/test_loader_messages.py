"""Messages a user reads when a fill cannot go on, each as it was misleading and as it is now: a
model larger than the volume is told to enlarge it (not to stop pods when none uses an entry); a
store that refuses connections is unreachable at its endpoint (not throttling); a fill that gets
no bytes shows no ETA, and a trickle of bytes no ETA of months; a fill group's memory bound set
in a CR is named by its CR path."""

from __future__ import annotations

from pathlib import Path

import pytest
from dlo_bench.s3server import S3Server, free_port
from dlo_loader.errors import SourceUnavailable
from dlo_loader.fill import FillRequest, fill
from dlo_loader.progress import Progress
from dlo_contract.cache import CacheSpaceError
from dlo_contract.errors import DloError
from dlo_contract.settings import CacheConfig, LoaderConfig, Settings
from support.field_names import CR_ORIGIN
from support.loader_fleet import CHUNK_BYTES, LOADER_SETTINGS, Checkpoint, Fleet, included

GIB = 1 << 30


def _failed_fill(settings: Settings) -> DloError:
    with pytest.raises(DloError) as caught:
        fill(FillRequest(settings=settings))
    return caught.value


def _settings(source: str, endpoint: str, root: Path, **cache: int) -> Settings:
    return Settings(loader=LoaderConfig(**{**LOADER_SETTINGS, "source": source,
                                           "endpoint_url": endpoint, "max_retries": 2}),
                    cache=CacheConfig(root=str(root), **cache))


@pytest.mark.usefixtures("aws_env")
def test_a_model_larger_than_the_volume_is_told_to_enlarge_it(
        s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    """No entry is in use and no fill is in progress: the hint said "stop the pods that map
    the entries in use" (with "in use: none") and "raise cache.max_bytes" (there is none)."""
    floor = 1 << 62  # free space no volume has: the entry cannot fit, whatever is evicted
    error = _failed_fill(_settings(checkpoint.source, s3.endpoint_url, tmp_path / "cache",
                                   min_free_bytes=floor))
    assert isinstance(error, CacheSpaceError)
    size = sum(map(len, included(checkpoint.files).values()))
    assert str(error).endswith("after evicting 0 unused entries; in use: none; fills in "
                               "progress: none")
    assert error.hint == (f"enlarge the volume (it has {error.free_bytes} bytes free with every "
                          f"unused entry evicted; the entry needs {size}) or lower "
                          "cache.min_free_bytes")


@pytest.mark.usefixtures("aws_env")
def test_a_refused_connection_names_the_unreachable_endpoint(tmp_path: Path) -> None:
    """Nothing listens at the endpoint: the hint said "the object store is throttling or
    failing; raise loader.max_retries or retry later"."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    error = _failed_fill(_settings("s3://models/tiny/", endpoint, tmp_path / "cache"))
    assert isinstance(error, SourceUnavailable)
    assert str(error).startswith("listing s3://models/tiny/: gave up after 2 attempt(s); last "
                                 "error: EndpointConnectionError: Could not connect to the "
                                 f'endpoint URL: "{endpoint}/models?')
    assert error.hint == (f"the object store at {endpoint} cannot be reached (no connection "
                          "could be made); check loader.endpoint_url, that the store is up, and "
                          "the loader's network path (and DNS) to it")


def test_a_fill_without_bytes_shows_no_eta_and_a_trickle_no_eta_of_months() -> None:
    """The line divided what is left by the average rate: a fill that had written 1 KiB of
    4 GiB in 10 s said `ETA 41943030 s`, and one silent since said the same, growing."""
    now = [100.0]
    progress = Progress(total_bytes=4 * GIB, prefix="[rank 0/1]", clock=lambda: now[0])
    progress.add(written=1024, from_store=1024)
    now[0] = 110.0
    assert progress.line() == "[rank 0/1] 1.0 KiB of 4.0 GiB (0%), 102 B/s, ETA over 24 h"
    now[0] = 170.0  # nothing written since the first KiB
    assert progress.line() == ("[rank 0/1] 1.0 KiB of 4.0 GiB (0%), 15 B/s, no bytes written "
                               "for 70 s, ETA unknown")
    progress.add(written=GIB)  # bytes again: an ETA, in units a person reads
    now[0] = 180.0
    assert progress.line() == "[rank 0/1] 1.0 GiB of 4.0 GiB (25%), 12.8 MiB/s, ETA 4 min"


@pytest.mark.slow
def test_a_fill_groups_memory_bound_set_in_a_cr_is_named_by_its_cr_path(
        s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    """Three loaders of a DOD whose spec.loader.memoryLimitBytes holds two chunks: every one
    says so by the CR's path (the bound it breaks is the group's, 2N + 1 chunks)."""
    fleet = Fleet(tmp_path, checkpoint.source, 3, [s3.endpoint_url] * 3, origin=CR_ORIGIN,
                  settings={"memory_limit_bytes": 2 * CHUNK_BYTES})
    for outcome in fleet.run():
        assert outcome.returncode == 1, outcome.stderr
        assert outcome.summary["error"] == (
            f"spec.loader.memoryLimitBytes={2 * CHUNK_BYTES} holds 2 chunks of {CHUNK_BYTES} "
            "bytes (and a page each); 3 loaders need at least 7 (hint: raise "
            "spec.loader.memoryLimitBytes or lower spec.loader.chunkBytes)")
