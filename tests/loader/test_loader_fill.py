"""One loader in this process against moto: publication, the cached fast path, bad objects."""

from __future__ import annotations

import gc
import json
import os
import struct
import threading
import time
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultProxy
from dlo_bench.s3server import S3Server, free_port
from dlo_loader.errors import RendezvousTimeout
from dlo_loader.fetch import BufferPool
from dlo_loader.fill import FillRequest, fill
from dlo_contract.cache import open_entry, verify_entry
from dlo_contract.safetensors_header import HeaderError
from dlo_contract.settings import CacheConfig, LoaderConfig, Settings
from support.loader_fleet import (
    LOADER_SETTINGS,
    Checkpoint,
    entry_files,
    included,
    no_entry,
    upload_files,
)

pytestmark = pytest.mark.usefixtures("aws_env")


def settings_for(source: str, endpoint: str, root: Path, **loader: object) -> Settings:
    fields = {**LOADER_SETTINGS, "source": source, "endpoint_url": endpoint, **loader}
    return Settings(loader=LoaderConfig(**fields), cache=CacheConfig(root=str(root)))


def test_single_loader_publishes_a_verified_copy(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    lines: list[str] = []
    settings = settings_for(checkpoint.source, s3.endpoint_url, tmp_path / "cache")
    result = fill(FillRequest(settings=settings, emit=lines.append))
    assert entry_files(tmp_path / "cache") == included(checkpoint.files)
    assert verify_entry(tmp_path / "cache", result.entry_id, full=True) == []
    with open_entry(tmp_path / "cache", result.entry_id) as handle:
        assert handle.manifest.tensor_count == 11
        assert handle.manifest.producer == "dlo-loader"
    summary = result.summary().to_dict()
    assert summary["bytes_from_store"] == sum(map(len, included(checkpoint.files).values()))
    assert (summary["cached"], summary["bytes_from_peers"], summary["mode"]) == (
        False, 0, "multi-reader")
    assert result.entry_document().to_dict() == {
        "entry_id": result.entry_id, "kind": "checkpoint", "root": str(tmp_path / "cache"),
        "path": str(tmp_path / "cache" / "v1" / "entries" / result.entry_id),
        "source": "s3://models/tiny/",
    }


def test_a_fill_leaves_no_thread_and_no_chunk_buffer_behind(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """The pod's loader stays up after its fill (a sidecar): a writer thread waiting for work
    would hold its last buffer and pool, and so every chunk buffer of the fill, for the pod's
    life."""
    before = set(threading.enumerate())
    fill(FillRequest(settings=settings_for(checkpoint.source, s3.endpoint_url, tmp_path / "c")))

    def left() -> list[str]:
        return [t.name for t in set(threading.enumerate()) - before]

    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert left() == []
    gc.collect()
    assert [o for o in gc.get_objects() if type(o) is BufferPool] == []  # type(): no __class__


def test_a_fill_sets_the_processs_objects_aside_from_the_garbage_collector_from_its_start(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Creating the S3 client and listing make tens of thousands of objects: a full collection
    they set off must not walk everything imported before the fill (the GIL held for a tenth of
    a second and more, the readers stopped). Everything is put back afterwards."""
    from dlo_loader.source import ObjectStore

    frozen_while_listing: list[int] = []
    listing = ObjectStore.list

    def spy(self: ObjectStore, *args: object, **kwargs: object):
        frozen_while_listing.append(gc.get_freeze_count())
        return listing(self, *args, **kwargs)

    monkeypatch.setattr(ObjectStore, "list", spy)
    assert gc.get_freeze_count() == 0
    fill(FillRequest(settings=settings_for(checkpoint.source, s3.endpoint_url, tmp_path / "c")))
    assert len(frozen_while_listing) == 1 and frozen_while_listing[0] > 10_000
    assert gc.get_freeze_count() == 0


def test_cached_entry_means_no_object_reads_and_no_rendezvous(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """A loader the operator placed in no group (a pod restarted after a prefill, a pod whose
    group has closed) finds the entry and exits: no object read, no rendezvous. A holder that
    *is* placed in a group joins it to serve its share from disk (test_loader_group.py)."""
    root = tmp_path / "cache"
    first = fill(FillRequest(settings=settings_for(checkpoint.source, s3.endpoint_url, root)))
    with FaultProxy(s3.endpoint_url) as proxy:
        settings = settings_for(checkpoint.source, proxy.url, root)
        again = fill(FillRequest(settings=settings))
    assert proxy.object_requests == 0
    assert (again.cached, again.entry_id, again.path) == (True, first.entry_id, first.path)
    assert again.summary().bytes_from_store == 0


@pytest.mark.parametrize(("policy", "then"), [
    ("independent", "this loader reads everything itself"), ("fail", "this loader fails")])
def test_waiting_for_the_group_says_what_happens_after_the_timeout(
    policy: str, then: str, s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    lines: list[str] = []
    settings = settings_for(checkpoint.source, s3.endpoint_url, tmp_path / "cache",
                            rendezvous_timeout_s=1.0, on_rendezvous_timeout=policy)
    port = free_port()  # nobody listens there: the group never forms
    request = FillRequest(settings=settings, rank=1, world_size=3, master_addr="127.0.0.1",
                          master_port=port, emit=lines.append)
    if policy == "fail":
        with pytest.raises(RendezvousTimeout):
            fill(request)
        # It held nothing while it waited (see [Note: node order] in `claim`): no publication,
        # no reads, and no progress lines after the summary the CLI prints next.
        assert "dlo-progress" not in {thread.name for thread in threading.enumerate()}
        assert os.listdir(tmp_path / "cache" / "v1" / "tmp") == []
    else:
        result = fill(request)
        total = sum(map(len, included(checkpoint.files).values()))
        assert result.mode == "independent"
        assert result.bytes_from_store == total  # it read nothing for the group
        assert verify_entry(tmp_path / "cache", result.entry_id, full=True) == []
    assert lines[0] == (
        f"[rank 1/3] waiting for 3 loaders at 127.0.0.1:{port}; after 1 s {then} "
        f"(loader.on_rendezvous_timeout={policy}); this loader holds nothing meanwhile; a "
        "loader that has not joined has not started (check the group's pods)")


def _header(tensors: dict) -> bytes:
    raw = json.dumps(tensors).encode()
    return struct.pack("<Q", len(raw)) + raw


GOOD = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
OVERLAP = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
           "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
BAD_OBJECTS = {
    "huge-header": (struct.pack("<Q", 1 << 50) + b"{}" * 100_000,
                    "header length field is 1125899906842624; expected 2 to 100000000"),
    "not-json": (struct.pack("<Q", 9) + b'{"w": 1,]' + b"x" * 300_000,
                 "header is not valid JSON: Expecting property name enclosed in double quotes at "
                 "byte 8"),
    "overlap": (_header(OVERLAP) + b"x" * 24, "tensors 'a' and 'b' overlap at data bytes 8-15"),
    "truncated": (_header(GOOD) + b"x" * 10,
                  "tensor 'w' ends at data byte 16 but the data area holds 10 bytes"),
    "trailing": (_header(GOOD) + b"x" * 300_000,
                 "tensors end at data byte 16 but the data area holds 300000 bytes (file size "
                 "disagrees with the header)"),
}


@pytest.mark.parametrize("kind", sorted(BAD_OBJECTS))
def test_malformed_safetensors_object_fails_with_its_name(
    kind: str, s3: S3Server, tmp_path: Path
) -> None:
    data, problem = BAD_OBJECTS[kind]
    files = {"transformer/config.json": b"{}", "transformer/model.safetensors": data}
    source = upload_files(s3, f"bad-{kind}", files, tmp_path / "src")
    root = tmp_path / "cache"
    with pytest.raises(HeaderError) as caught:
        fill(FillRequest(settings=settings_for(source, s3.endpoint_url, root)))
    assert str(caught.value) == (
        f"s3://models/bad-{kind}/transformer/model.safetensors: invalid safetensors header: "
        f"{problem}")
    assert no_entry(root)
