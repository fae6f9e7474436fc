"""`dlo cache fill --source gs://... / az://...` as real processes against the emulators, each rank
behind its own counting, fault-injecting proxy: alone and in groups of two and three, the store's
checksum compared end to end, faults retried, damaged bytes and a replaced object never
published, wrong credentials a clear error without the secret."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from dlo_bench.emulators import AZURITE_KEY
from dlo_bench.faultproxy import CORRUPT, FAULT_KINDS, FaultPlan, FaultProxy
from dlo_contract.source_credentials import AZURE_ACCOUNT_KEY_ENV
from support.cloud_stores import CONTAINER, CloudStore
from support.loader_fleet import (
    Fleet,
    entry_files,
    finish,
    included,
    no_entry,
    wait_until,
)

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def proxies(cloud: CloudStore, *plans: FaultPlan) -> Iterator[list[FaultProxy]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(FaultProxy(cloud.emulator.server_url, plan))
               for plan in plans]


def fleet_of(cloud: CloudStore, source: str, tmp: Path, counting: list[FaultProxy]) -> Fleet:
    return Fleet(tmp, source, len(counting), [cloud.endpoint(p.url) for p in counting])


# Alone (streamed to disk) and a group of three (an odd ring); a group of two runs the same
# scheme-independent exchange, which the S3 group tests cover.
@pytest.mark.parametrize("world", [1, 3])
def test_fill_publishes_the_checkpoint_on_every_node(
        world: int, cloud: CloudStore, cloud_source: str, cloud_files: dict[str, bytes],
        tmp_path: Path) -> None:
    with proxies(cloud, *[FaultPlan()] * world) as counting:
        fleet = fleet_of(cloud, cloud_source, tmp_path, counting)
        outcomes = fleet.run()
    total = sum(map(len, included(cloud_files).values()))
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr
        summary = outcome.summary
        assert entry_files(fleet.root(outcome.rank)) == included(cloud_files)
        assert summary["bytes_from_store"] == counting[outcome.rank].object_bytes > 0
        assert summary["bytes_from_peers"] == total - summary["bytes_from_store"]
        # GCS: every file's CRC32C combined from its chunks'; Azure: each blob's Content-MD5
        # against the file as written.
        assert summary["store_checksums"] == "all"
    assert sum(p.object_bytes for p in counting) == total  # each byte read from the store once
    assert len({o.summary["entry_id"] for o in outcomes}) == 1


def test_a_group_retries_every_transient_fault(
        cloud: CloudStore, cloud_source: str, cloud_files: dict[str, bytes],
        tmp_path: Path) -> None:
    plans = [FaultPlan(kinds=FAULT_KINDS, every=2, limit=len(FAULT_KINDS))] * 2
    with proxies(cloud, *plans) as counting:
        fleet = fleet_of(cloud, cloud_source, tmp_path, counting)
        outcomes = fleet.run()
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr
        assert entry_files(fleet.root(outcome.rank)) == included(cloud_files)
    assert sum(sum(p.faults.values()) for p in counting) > 0


def test_damaged_bytes_fail_the_store_check_and_publish_nothing(
        cloud: CloudStore, cloud_source: str, tmp_path: Path) -> None:
    with proxies(cloud, FaultPlan(kinds=(CORRUPT,), limit=1)) as counting:
        fleet = fleet_of(cloud, cloud_source, tmp_path, counting)
        [outcome] = fleet.run()
    assert outcome.returncode != 0
    assert outcome.summary["status"] == "error"
    assert "the store publishes" in outcome.summary["error"]
    assert no_entry(fleet.root(0))


def test_an_object_replaced_mid_fill_publishes_nothing(
        cloud: CloudStore, cloud_source: str, cloud_files: dict[str, bytes],
        tmp_path: Path) -> None:
    shard = "transformer/model-00001-of-00002.safetensors"
    with proxies(cloud, FaultPlan()) as [proxy]:
        proxy.reads_open.clear()  # the fill has listed and waits for its first bytes
        fleet = fleet_of(cloud, cloud_source, tmp_path, [proxy])
        process = fleet.start(0)
        wait_until(lambda: proxy.object_requests > 0)
        prefix = cloud_source.rstrip("/").rsplit("/", 1)[1]
        cloud.emulator.put(CONTAINER, {shard: cloud_files[shard][::-1]}, f"{prefix}/")
        proxy.reads_open.set()
        outcome = finish(0, process)
    assert outcome.returncode != 0
    assert outcome.summary["error"].startswith(f"{cloud_source}{shard}")
    assert "changed since it was listed" in outcome.summary["error"]
    assert no_entry(fleet.root(0))


def test_wrong_credentials_fail_the_fill_naming_the_source_not_the_secret(
        az_store: CloudStore, cloud_files: dict[str, bytes], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    source = az_store.put("wrong-key", cloud_files)
    wrong = base64.b64encode(b"a key of another account" * 2).decode()
    monkeypatch.setenv(AZURE_ACCOUNT_KEY_ENV, wrong)
    with proxies(az_store, FaultPlan()) as counting:
        [outcome] = fleet_of(az_store, source, tmp_path, counting).run()
    assert outcome.returncode != 0
    assert outcome.summary["error"].startswith(f"listing {source}: access denied")
    assert AZURE_ACCOUNT_KEY_ENV in outcome.summary["error"]  # the hint: where keys come from
    assert wrong not in outcome.stdout + outcome.stderr
    assert AZURITE_KEY not in outcome.stdout + outcome.stderr
