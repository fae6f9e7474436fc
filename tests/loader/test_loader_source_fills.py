"""`dlo cache fill --source <scheme>` from each scheme's real local server (a directory, an HTTP
server with a listing file, a Hub stand-in), alone and as a group of real loader processes;
what the entry holds and checks for identical bytes from different schemes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FAULT_KINDS, FaultPlan
from dlo_loader.errors import SourceChanged, SourceError
from dlo_loader.fill import FillRequest, fill
from dlo_contract.cache import open_entry
from dlo_contract.settings import CacheConfig, LoaderConfig, Settings
from support.loader_fleet import (
    LOADER_SETTINGS,
    Checkpoint,
    Fleet,
    entry_files,
    included,
    no_entry,
)
from support.scheme_servers import SCHEMES, TOKEN, serving

pytestmark = pytest.mark.slow
STORE_CHECKSUMS = {"file": "none", "https": "all", "hf": "all"}
"""A share publishes no checksum; the listing file's CRC64-NVME and the Hub's sha256 and git
blob ids are checked."""


def fill_in_process(source: str, endpoint: str | None, root: Path, **loader: object):
    settings = Settings(
        loader=LoaderConfig(**{**LOADER_SETTINGS, "source": source, "endpoint_url": endpoint,
                               "metrics_port": 0, **loader}),
        cache=CacheConfig(root=str(root)))
    return fill(FillRequest(settings=settings))


def manifest_files(root: Path, entry_id: str) -> list[dict]:
    with open_entry(root, entry_id) as handle:
        return [vars(record) for record in handle.manifest.files]


# Alone (streamed to disk) and a group of three (an odd ring); a group of two runs the same
# scheme-independent exchange, which the S3 group tests cover.
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cache_fill_gives_every_node_the_bytes(
        scheme: str, world: int, checkpoint: Checkpoint, tmp_path: Path) -> None:
    with serving(scheme, checkpoint.files, tmp_path) as served:
        fleet = Fleet(tmp_path, served.source, world, [served.endpoint or ""] * world)
        outcomes = fleet.run()
    total = sum(map(len, included(checkpoint.files).values()))
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr
        summary = outcome.summary
        assert entry_files(fleet.root(outcome.rank)) == included(checkpoint.files)
        assert summary["store_checksums"] == STORE_CHECKSUMS[scheme]
        assert summary["bytes_from_peers"] == total - summary["bytes_from_store"]
    assert len({o.summary["entry_id"] for o in outcomes}) == 1
    assert sum(o.summary["bytes_from_store"] for o in outcomes) == total  # each byte read once
    if served.object_bytes is not None:
        assert served.object_bytes == total  # as the servers counted them
    if world > 1:
        assert all(o.summary["bytes_from_store"] > 0 for o in outcomes)  # the reads were split


@pytest.mark.parametrize("scheme", ("https", "hf"))
def test_a_group_recovers_from_injected_faults(
        scheme: str, checkpoint: Checkpoint, tmp_path: Path) -> None:
    plan = FaultPlan(kinds=FAULT_KINDS, every=2, limit=6)
    with serving(scheme, checkpoint.files, tmp_path, plan=plan) as served:
        fleet = Fleet(tmp_path, served.source, 2, [served.endpoint or ""] * 2,
                      settings={"max_retries": 8})
        outcomes = fleet.run()
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr
        assert entry_files(fleet.root(outcome.rank)) == included(checkpoint.files)
    assert set(served.proxy.faults) == set(FAULT_KINDS)


def test_identical_bytes_make_identical_files_in_entries_of_each_scheme(
        checkpoint: Checkpoint, tmp_path: Path) -> None:
    """The entry's id is of its source and the listing's version identities (known before a
    byte is read), so each scheme's entry has its own id; the files and their chunk digests
    (CRC64-NVME, where the store publishes no CRC of its own) are the same."""
    manifests, ids = {}, {}
    for scheme in SCHEMES:
        with serving(scheme, checkpoint.files, tmp_path / scheme) as served:
            root = tmp_path / scheme / "cache"
            result = fill_in_process(served.source, served.endpoint, root)
        assert entry_files(root) == included(checkpoint.files)
        manifests[scheme], ids[scheme] = manifest_files(root, result.entry_id), result.entry_id
    assert manifests["https"] == manifests["file"] == manifests["hf"]
    assert {record["algorithm"] for record in manifests["file"]} == {"crc64nvme"}
    assert len(set(ids.values())) == len(SCHEMES)


def test_a_hub_mirror_serving_corrupt_bytes_fails_the_sha256_check(
        checkpoint: Checkpoint, tmp_path: Path) -> None:
    """Bytes that pass every answer's checks (the Hub names the right sha256 and size) but are
    not the file's are caught end to end: the written file's sha256 is the LFS one."""
    shard = "transformer/model-00001-of-00002.safetensors"
    with serving("hf", checkpoint.files, tmp_path) as served:
        served.hub.corrupt_blob(checkpoint.files[shard])
        with pytest.raises(SourceError) as caught:
            fill_in_process(served.source, served.endpoint, tmp_path / "cache")
    assert str(caught.value).startswith(f"{served.source}{shard}: the bytes read have sha256 ")
    assert no_entry(tmp_path / "cache")


@pytest.mark.parametrize("scheme", ("https-sha256", "hf"))
def test_a_fill_alone_hashes_each_file_while_writing_it(
        scheme: str, checkpoint: Checkpoint, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No file is read back after the transfer for its sha256 (or git blob id): each was hashed
    behind its written bytes (`file_hashes`)."""
    from dlo_loader import digest, file_hashes

    def read_back(path: Path, algorithm: str) -> str:
        raise AssertionError(f"{path.name} was read back for its {algorithm} after the transfer")

    monkeypatch.setattr(digest, "file_hash", read_back)
    monkeypatch.setattr(file_hashes, "file_hash", read_back)
    with serving(scheme.partition("-")[0], checkpoint.files, tmp_path,
                 digests=("sha256",)) as served:
        result = fill_in_process(served.source, served.endpoint, tmp_path / "cache")
    assert result.store_checksums == "all"
    assert entry_files(tmp_path / "cache") == included(checkpoint.files)


def test_hashes_follow_written_bytes_and_a_span_written_twice_is_hashed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dlo_loader import file_hashes

    data = bytes(range(256)) * (4 << 12)  # 4 MiB
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    read_back = []
    whole = file_hashes.file_hash
    monkeypatch.setattr(file_hashes, "file_hash",
                        lambda p, a: read_back.append(a) or whole(p, a))
    hashes = file_hashes.FollowingHashes({0: (path, "sha256"), 1: (path, "md5")},
                                         [len(data), len(data)])
    try:
        hashes.written(1, 0, 1 << 20)
        hashes.written(1, 0, 4096)  # again: the bytes followed may have changed
        for start in (2 << 20, 0, 1 << 20, 3 << 20):  # out of order, as parallel readers write
            hashes.written(0, start, 1 << 20)
            if start:
                hashes.written(1, start, 1 << 20)
        assert hashes.hash_of(0, "sha256") == hashlib.sha256(data).hexdigest()
        assert hashes.hash_of(1, "md5") == hashlib.md5(data).hexdigest()
        assert hashes.hash_of(0, "md5") is None  # not followed for another algorithm
    finally:
        hashes.close()
    assert read_back == ["md5"]  # only the file written twice was read back whole
    partly = file_hashes.FollowingHashes({0: (path, "sha256")}, [len(data)])
    partly.written(0, 0, 1 << 20)  # the rest never told written: asked, it is hashed whole
    try:
        assert partly.hash_of(0, "sha256") == hashlib.sha256(data).hexdigest()
    finally:
        partly.close()
    assert read_back == ["md5", "sha256"]


def test_a_file_replaced_on_the_share_mid_fill_publishes_nothing(
        checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing's identity is checked at every read: a file rewritten between the listing
    and its read fails the fill."""
    from dlo_loader.sources.file import FileSource

    shard = "transformer/model-00002-of-00002.safetensors"
    listed = FileSource.list

    def list_then_rewrite(self: FileSource, *args: object, **kwargs: object) -> list:
        found = listed(self, *args, **kwargs)
        (served.directory / shard).write_bytes(bytes(len(checkpoint.files[shard])))
        return found

    monkeypatch.setattr(FileSource, "list", list_then_rewrite)
    with serving("file", checkpoint.files, tmp_path) as served:
        with pytest.raises(SourceChanged) as caught:
            fill_in_process(served.source, None, tmp_path / "cache")
    assert f"{served.source}{shard}: the file changed since it was listed" in str(caught.value)
    assert no_entry(tmp_path / "cache")


def test_the_summary_names_the_source_without_credentials(
        checkpoint: Checkpoint, tmp_path: Path) -> None:
    with serving("hf", checkpoint.files, tmp_path, token=TOKEN) as served:
        fleet = Fleet(tmp_path, served.source, 1, [served.endpoint])
        (outcome,) = fleet.run()  # no HF_TOKEN: the Hub answers 401
    assert outcome.returncode == 1
    assert outcome.summary["status"] == "error"
    assert f"listing {served.source}: access denied" in outcome.summary["error"]
    assert "HF_TOKEN" in outcome.summary["error"] and TOKEN not in outcome.stderr
    assert json.dumps(outcome.summary).count(TOKEN) == 0
