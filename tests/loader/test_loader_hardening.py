"""What real stores and real checkpoints do to a fill: many objects under a low open-file limit,
local errors, objects replaced under a store that ignores If-Match, stalled bodies, a loader
waiting for another's publication, listing errors, store checksums."""

from __future__ import annotations

import errno
import itertools
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import botocore.exceptions as bexc
import pytest
from dlo_bench.faultproxy import CORRUPT, STALL, FaultPlan, FaultProxy
from dlo_bench.s3server import DUMMY_CREDENTIALS, S3Server
from dlo_loader import claim as claim_module
from dlo_loader.digest import ALGORITHM, chunk_digest
from dlo_loader.errors import LocalResourceError, SourceChanged, SourceError, SourceUnavailable
from dlo_loader.fill import FillRequest, fill
from dlo_loader.progress import Progress
from dlo_loader.source import ObjectStore
from dlo_loader.sources import parse_source
from dlo_contract.cache import checkpoint_identity, entry_id
from dlo_contract.cache import open_entry, verify_entry
from dlo_contract.settings import CacheConfig, LoaderConfig, Settings
from support.loader_fleet import BUCKET, LOADER_SETTINGS, Checkpoint, upload_files

pytestmark = pytest.mark.usefixtures("aws_env")
KEY = "transformer/model-00001-of-00002.safetensors"


def store_for(source: str, endpoint: str, **options: object) -> ObjectStore:
    fields = {"readers": 4, "attempts": 3, **options}
    return ObjectStore(parse_source(source), endpoint_url=endpoint, region="us-east-1",
                       path_style=True, **fields)


def settings_for(source: str, endpoint: str, root: Path, **loader: object) -> Settings:
    fields = {**LOADER_SETTINGS, "source": source, "endpoint_url": endpoint, **loader}
    return Settings(loader=LoaderConfig(**fields), cache=CacheConfig(root=str(root)))


def _client(s3: S3Server):  # noqa: ANN202 (boto3 client type)
    return boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1")


def test_more_objects_than_the_open_file_limit_fill(s3: S3Server, tmp_path: Path) -> None:
    """More objects than the open-file limit: 600 objects of 1 KiB under a limit of 256 (the
    common 1024, scaled down with the object count to keep the test short), more than the
    limit even at one descriptor each (a fill that held two per object failed at ~505 objects
    under 1024)."""
    files = {f"tokenizer/part-{i:04d}.json": bytes([i % 251]) * 1024 for i in range(600)}
    source = upload_files(s3, "many", files, tmp_path / "src")
    env = {**os.environ, **DUMMY_CREDENTIALS}
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # noqa: E731
    done = subprocess.run(
        [sys.executable, "-m", "dlo_cli.main", "cache", "fill", "--source", source,
         "--endpoint-url", s3.endpoint_url, "--path-style", "--region", "us-east-1",
         "--include", "*.json", "--cache-root", str(tmp_path / "cache"),
         "--entry-file", str(tmp_path / "entry.json"),
         "--summary-file", str(tmp_path / "termination-log")],
        env=env, text=True, capture_output=True, preexec_fn=limit, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"status": "ok"' in done.stdout.splitlines()[-1]


def test_running_out_of_descriptors_is_a_local_error_not_retried() -> None:
    store = store_for("s3://models/tiny/", "http://127.0.0.1:9", attempts=8)
    calls = []

    def connect() -> None:
        calls.append(1)
        cause = OSError(errno.EMFILE, "Too many open files")
        raise bexc.EndpointConnectionError(endpoint_url="http://127.0.0.1:9", error=cause)

    with pytest.raises(LocalResourceError) as caught:
        store.retry.run("s3://models/tiny/a bytes 0-9", connect)
    assert len(calls) == 1
    assert "too many open files on this node (EMFILE); not an object store failure" in str(
        caught.value)
    assert "ulimit -n" in (caught.value.hint or "")


def test_an_object_replaced_under_a_store_ignoring_if_match_is_never_mixed_in(
    s3: S3Server, tmp_path: Path
) -> None:
    files = {"m/a.json": b"x" * 5000}
    source = upload_files(s3, "replaced-unguarded", files, tmp_path / "src")
    with FaultProxy(s3.endpoint_url, FaultPlan(ignore_if_match=True)) as proxy:
        store = store_for(source, proxy.url)
        [listed] = store.list(["*.json"])
        _client(s3).put_object(Bucket=BUCKET, Key="replaced-unguarded/m/a.json", Body=b"y" * 5000)
        with pytest.raises(SourceChanged) as caught:
            store.read(listed, 0, memoryview(bytearray(1000)), ALGORITHM)
        store.close()
    assert "the object changed since it was listed (ETag" in str(caught.value)


def test_a_stalled_body_is_asked_again_at_once_and_the_line_says_stalled(
    s3: S3Server, checkpoint: Checkpoint
) -> None:
    progress = Progress(total_bytes=100, prefix="[rank 0/1]")
    plan = FaultPlan(kinds=(STALL,), limit=1, stall_s=20.0)
    with FaultProxy(s3.endpoint_url, plan) as proxy:
        store = store_for(checkpoint.source, proxy.url, stall_timeout_s=0.5,
                          on_stall=progress.stall)
        obj = next(o for o in store.list(["*.safetensors"]) if o.key == KEY)
        into = memoryview(bytearray(obj.size))
        began = time.monotonic()
        store.read(obj, 0, into, ALGORITHM)
        took = time.monotonic() - began
        store.close()
    assert bytes(into) == checkpoint.files[KEY]
    assert took < 10.0  # abandoned after 0.5 s, not after the 20 s the body stays silent
    assert "stalled (s3://models/tiny/" in progress.line() and "ETA" not in progress.line()
    progress.add(from_store=1)
    assert "ETA" in progress.line()


def test_a_streamed_range_resumes_after_the_bytes_it_delivered(
    s3: S3Server, checkpoint: Checkpoint
) -> None:
    """A fill reading alone streams each chunk to disk; when the body stalls halfway, the retry
    asks only for the bytes not delivered yet, and the pieces and their CRC come out whole."""
    plan = FaultPlan(kinds=(STALL,), limit=1, stall_s=20.0)
    with FaultProxy(s3.endpoint_url, plan) as proxy:
        store = store_for(checkpoint.source, proxy.url, stall_timeout_s=0.5)
        obj = next(o for o in store.list(["*.safetensors"]) if o.key == KEY)
        got = bytearray(obj.size)
        offsets = []

        def deliver(at: int, view: memoryview) -> None:
            offsets.append(at)
            got[at:at + len(view)] = view

        crc = store.stream(obj, 0, obj.size, itertools.repeat(memoryview(bytearray(4096))),
                           deliver, ALGORITHM)
        store.close()
    assert bytes(got) == checkpoint.files[KEY]
    assert offsets == list(range(0, obj.size, 4096))  # each piece once, in order
    assert f"{crc:016x}" == chunk_digest(checkpoint.files[KEY], ALGORITHM)
    assert proxy.faults[STALL] == 1 and proxy.object_requests == 2
    assert proxy.object_bytes < obj.size + 4096  # not the stalled half again


def test_a_store_that_keeps_stalling_fails_without_suggesting_more_retries(
    s3: S3Server, checkpoint: Checkpoint
) -> None:
    plan = FaultPlan(kinds=(STALL,), stall_s=5.0)
    with FaultProxy(s3.endpoint_url, plan) as proxy:
        store = store_for(checkpoint.source, proxy.url, stall_timeout_s=0.3, attempts=2)
        obj = next(o for o in store.list(["*.safetensors"]) if o.key == KEY)
        with pytest.raises(SourceUnavailable) as caught:
            store.read(obj, 0, memoryview(bytearray(obj.size)), ALGORITHM)
        store.close()
    assert "last error: stalled: no bytes for 0.3 s" in str(caught.value)
    assert "max_retries" not in (caught.value.hint or "")


def test_listing_errors_name_the_bucket_and_prefix(s3: S3Server) -> None:
    store = store_for("s3://no-such-bucket/some/prefix", s3.endpoint_url)
    with pytest.raises(SourceError) as caught:
        store.list(["*"])
    store.close()
    assert str(caught.value).startswith("listing s3://no-such-bucket/some/prefix/: not found")


HOLD_PUBLICATION = """
import sys
from dlo_contract.cache import CacheRoot, begin_publication
with begin_publication(CacheRoot(sys.argv[1]), sys.argv[2], expected_bytes=0, lock_timeout_s=5):
    print("holding", flush=True)
    sys.stdin.read()
"""


def test_a_loader_waiting_for_another_publication_says_so(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(claim_module, "WAIT_LINE_INTERVAL_S", 0.2)
    root = tmp_path / "cache"
    store = store_for(checkpoint.source, s3.endpoint_url)
    files = store.list(LoaderConfig().include)
    store.close()
    eid = entry_id(checkpoint_identity(str(parse_source(checkpoint.source)), files))
    lines: list[str] = []
    settings = settings_for(checkpoint.source, s3.endpoint_url, root)
    holder = subprocess.Popen(  # another loader's publication, in a process of its own
        [sys.executable, "-c", HOLD_PUBLICATION, str(root), eid], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        worker = threading.Thread(target=lambda: lines.append(
            fill(FillRequest(settings=settings, emit=lines.append)).entry_id))
        worker.start()
        deadline = time.monotonic() + 30
        while not any("waiting" in str(line) for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        holder.communicate("", timeout=30)  # ends the publication without an entry
    worker.join(60)
    waits = [line for line in lines if "waiting" in line]
    assert waits and f"to publish entry {eid} (s3://models/tiny/)" in waits[0]
    assert lines[-1] == eid  # then filled it itself: the other publication ended without one


@pytest.mark.parametrize("algorithm", ["CRC64NVME", "CRC32C", "CRC32"])
def test_the_store_checksum_is_checked_and_said_in_the_summary(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path, algorithm: str
) -> None:
    """Each CRC S3 keeps for whole objects (the listing names it) is what the fill hashes that
    object's chunks with, so their digests combine into the store's figure; a checksum of
    another kind is said not checked."""
    data = os.urandom(300_000)
    client = _client(s3)
    prefix = f"crc-{algorithm.lower()}"
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/big.json", Body=data,
                      ChecksumAlgorithm=algorithm)
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/small.json", Body=b"{}",
                      ChecksumAlgorithm=algorithm)
    settings = settings_for(f"s3://models/{prefix}/", s3.endpoint_url, tmp_path / "cache",
                            include=("*.json",), chunk_bytes=64 * 1024)
    result = fill(FillRequest(settings=settings))
    assert result.summary().store_checksums == "all"  # the small one is a single chunk
    assert verify_entry(tmp_path / "cache", result.entry_id, full=True) == []
    with open_entry(tmp_path / "cache", result.entry_id) as handle:
        assert {f.algorithm for f in handle.manifest.files} == {algorithm.lower()}
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/big.json", Body=data[::-1],
                      ChecksumAlgorithm="SHA256")
    other = fill(FillRequest(settings=settings_for(
        f"s3://models/{prefix}/", s3.endpoint_url, tmp_path / "cache2", include=("*.json",),
        chunk_bytes=64 * 1024)))
    assert other.summary().store_checksums == "none"
    with open_entry(tmp_path / "cache2", other.entry_id) as handle:
        assert {f.name: f.algorithm for f in handle.manifest.files}["big.json"] == "crc64nvme"


def _upload_in_parts(s3: S3Server, key: str, parts: list[bytes]) -> bytes:
    """One object uploaded in `parts` with a CRC32 of each, as SDKs do (its store checksum is
    of the parts' CRCs); returns its bytes."""
    client = _client(s3)
    upload = client.create_multipart_upload(Bucket=BUCKET, Key=key, ChecksumAlgorithm="CRC32")
    done = []
    for number, part in enumerate(parts, 1):
        sent = client.upload_part(Bucket=BUCKET, Key=key, UploadId=upload["UploadId"],
                                  PartNumber=number, Body=part, ChecksumAlgorithm="CRC32")
        done.append({"PartNumber": number, "ETag": sent["ETag"],
                     "ChecksumCRC32": sent["ChecksumCRC32"]})
    client.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload["UploadId"],
                                     MultipartUpload={"Parts": done})
    return b"".join(parts)


def test_a_multipart_objects_crc_of_its_parts_is_checked(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """An object uploaded in parts with CRC32 (boto3's transfer manager here, as for any large
    file) keeps a CRC of its parts' CRCs: the fill cuts it at its parts (5 MiB parts, 1 MiB
    chunks: five chunks a part), combines each part's CRC from its chunks' and checks the
    store's value. (Until now such an object was reported as not checked.)"""
    from boto3.s3.transfer import TransferConfig

    source = tmp_path / "parts.bin"
    source.write_bytes(os.urandom(12 << 20))
    _client(s3).upload_file(str(source), BUCKET, "multipart/big.bin", Config=TransferConfig(
        multipart_threshold=5 << 20, multipart_chunksize=5 << 20))
    settings = settings_for("s3://models/multipart/", s3.endpoint_url, tmp_path / "cache",
                            include=("*.bin",), chunk_bytes=1 << 20)
    result = fill(FillRequest(settings=settings))
    assert result.summary().store_checksums == "all"
    assert verify_entry(tmp_path / "cache", result.entry_id, full=True) == []
    with open_entry(tmp_path / "cache", result.entry_id) as handle:
        (record,) = handle.manifest.files
        assert (record.algorithm, record.chunk_bytes, len(record.chunk_digests)) == (
            "crc32", 1 << 20, 12)
        assert (handle.path / "big.bin").read_bytes() == source.read_bytes()


def test_a_byte_damaged_in_a_multipart_object_fails_the_check_of_its_parts(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Parts of 6 MiB cut into chunks of at most 4 MiB (two of 3 MiB each); one byte flipped on
    the way fails the fill before anything is published."""
    _upload_in_parts(s3, "damaged-parts/big.bin", [os.urandom(6 << 20), os.urandom(1 << 20)])
    _damaged_on_the_way(s3, tmp_path, "damaged-parts", "*.bin", 4 << 20,
                        "big.bin: the bytes read have crc32 [0-9a-f]{8} of their parts' CRCs, "
                        "the store publishes")


def _damaged_on_the_way(s3: S3Server, tmp_path: Path, prefix: str, include: str,
                        chunk_bytes: int, error: str, **store: bool) -> None:
    """A fill of `prefix` through a proxy that flips one byte of one GET (and acts as `store`
    says) fails with `error` and publishes nothing."""
    plan = FaultPlan(kinds=(CORRUPT,), limit=1, **store)
    with FaultProxy(s3.endpoint_url, plan) as proxy:
        settings = settings_for(f"s3://models/{prefix}/", proxy.url, tmp_path / "cache",
                                include=(include,), chunk_bytes=chunk_bytes)
        with pytest.raises(SourceError, match=error):
            fill(FillRequest(settings=settings))
    assert not list((tmp_path / "cache" / "entries").glob("*"))


def test_an_object_of_uneven_parts_is_not_blamed_for_them(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Parts of 5, 6 and 1 MiB look even from the first (5 MiB, three parts, 12 MiB): the fill
    cuts at 5 and 10 MiB, its parts' CRC cannot match, and it learns why from the parts' sizes:
    the object is published as read, its checksum reported as not checked."""
    data = _upload_in_parts(s3, "uneven/big.bin",
                            [os.urandom(5 << 20), os.urandom(6 << 20), os.urandom(1 << 20)])
    settings = settings_for("s3://models/uneven/", s3.endpoint_url, tmp_path / "cache",
                            include=("*.bin",), chunk_bytes=8 << 20)
    result = fill(FillRequest(settings=settings))
    assert result.summary().store_checksums == "none"
    with open_entry(tmp_path / "cache", result.entry_id) as handle:
        assert (handle.path / "big.bin").read_bytes() == data


def test_a_store_that_does_not_list_its_checksums_has_them_checked(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """A store that keeps each object's checksum but names none in its listing (a proxy drops
    them from moto's): a HEAD before the plan says which CRC each large object has, whole
    (CRC32C, one part) or of its parts (CRC32, 5 + 1 MiB), and both are checked. (Until now
    their chunks were hashed with CRC64-NVME and nothing was checked.)"""
    whole = os.urandom(3 << 20)
    _client(s3).put_object(Bucket=BUCKET, Key="unlisted/whole.bin", Body=whole,
                           ChecksumAlgorithm="CRC32C")
    parts = _upload_in_parts(s3, "unlisted/parts.bin", [os.urandom(5 << 20), os.urandom(1 << 20)])
    with FaultProxy(s3.endpoint_url, FaultPlan(unlisted_checksums=True)) as proxy:
        settings = settings_for("s3://models/unlisted/", proxy.url, tmp_path / "cache",
                                include=("*.bin",), chunk_bytes=1 << 20)
        result = fill(FillRequest(settings=settings))
    assert result.summary().store_checksums == "all"
    with open_entry(tmp_path / "cache", result.entry_id) as handle:
        assert [(r.name, r.algorithm) for r in handle.manifest.files] == [
            ("parts.bin", "crc32"), ("whole.bin", "crc32c")]
        assert (handle.path / "parts.bin").read_bytes() == parts
        assert (handle.path / "whole.bin").read_bytes() == whole
    assert verify_entry(tmp_path / "cache", result.entry_id, full=True) == []


def test_a_byte_damaged_from_a_store_that_does_not_list_its_checksums_fails_the_fill(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    _client(s3).put_object(Bucket=BUCKET, Key="unlisted-damaged/big.bin",
                           Body=os.urandom(2 << 20), ChecksumAlgorithm="CRC32")
    _damaged_on_the_way(s3, tmp_path, "unlisted-damaged", "*.bin", 1 << 20,
                        "big.bin: the bytes read have crc32 [0-9a-f]{8}, the store publishes",
                        unlisted_checksums=True)


@pytest.mark.parametrize("algorithm", ["CRC64NVME", "CRC32C", "CRC32"])
def test_bytes_damaged_on_the_way_fail_the_store_check_and_publish_nothing(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path, algorithm: str
) -> None:
    """A byte flipped between the store and the loader (no error, no retry: the body's length
    and headers are right) is caught by the store's own CRC before publication, whichever of
    the three the object carries."""
    client = _client(s3)
    prefix = f"damaged-{algorithm.lower()}"
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/big.json", Body=os.urandom(300_000),
                      ChecksumAlgorithm=algorithm)
    _damaged_on_the_way(s3, tmp_path, prefix, "*.json", 64 * 1024,
                        f"the bytes read have {algorithm.lower()} [0-9a-f]+, the store publishes")
