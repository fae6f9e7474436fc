"""The object store seam against a real S3 server (moto) behind the fault-injecting proxy."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from botocore.response import StreamingBody
from dlo_bench.faultproxy import FAULT_KINDS, FaultPlan, FaultProxy
from dlo_bench.s3server import S3Server
from dlo_loader.errors import SourceError, SourceUnavailable
from dlo_loader.digest import ALGORITHM, chunk_digest
from dlo_loader.source import ObjectStore
from dlo_loader.sources import parse_source
from dlo_loader.source_body import Body
from dlo_contract.cache import ObjectIdentity
from support.loader_fleet import BUCKET, Checkpoint, upload_files

pytestmark = pytest.mark.usefixtures("aws_env")
CONFIG = "transformer/config.json"


def store_for(source: str, endpoint: str, *, attempts: int = 4) -> ObjectStore:
    return ObjectStore(parse_source(source), endpoint_url=endpoint, region="us-east-1",
                       path_style=True, readers=4, attempts=attempts)


def test_listing_applies_globs_and_reports_etags(s3: S3Server, checkpoint: Checkpoint) -> None:
    objects = store_for(checkpoint.source, s3.endpoint_url).list(["*.safetensors", "*.json"])
    assert [o.key for o in objects] == [
        "transformer/config.json",
        "transformer/model-00001-of-00002.safetensors",
        "transformer/model-00002-of-00002.safetensors",
    ]
    for obj in objects:
        data = checkpoint.files[obj.key]
        assert (obj.size, obj.etag) == (len(data), hashlib.md5(data).hexdigest())


def test_listing_without_matches_names_the_globs(s3: S3Server, checkpoint: Checkpoint) -> None:
    with pytest.raises(SourceError) as caught:
        store_for(checkpoint.source, s3.endpoint_url).list(["*.bin"])
    assert str(caught.value) == "no object under s3://models/tiny/ matches loader.include=['*.bin']"


@pytest.mark.parametrize("uri, expected", [
    ("models/tiny", "must be one of s3://bucket/prefix/, file:///path/"),
    ("ftp://models/tiny", "must be one of s3://bucket/prefix/, file:///path/"),
    ("s3:///tiny", "must be s3://bucket/prefix/"),
])
def test_source_must_be_a_uri_of_a_known_scheme(uri: str, expected: str) -> None:
    with pytest.raises(SourceError) as caught:
        parse_source(uri)
    assert str(caught.value).startswith(f"loader.source={uri!r} is not a source URI: it {expected}")


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_each_fault_kind_is_retried_to_exact_bytes(
    kind: str, s3: S3Server, checkpoint: Checkpoint
) -> None:
    name = "transformer/model-00001-of-00002.safetensors"
    with FaultProxy(s3.endpoint_url, FaultPlan(kinds=(kind,), limit=2)) as proxy:
        store = store_for(checkpoint.source, proxy.url)
        obj = next(o for o in store.list(["*.safetensors"]) if o.key == name)
        data = bytearray(300_000)
        crc = store.read(obj, 1000, memoryview(data), ALGORITHM)
    assert data == checkpoint.files[name][1000:301_000]
    # The running CRC covers the bytes delivered, not what failed attempts sent first.
    assert f"{crc:016x}" == chunk_digest(checkpoint.files[name][1000:301_000], ALGORITHM)
    assert proxy.faults == {kind: 2}
    assert proxy.object_requests == 3


def test_persistent_throttling_gives_up_with_the_last_error(
    s3: S3Server, checkpoint: Checkpoint
) -> None:
    with FaultProxy(s3.endpoint_url, FaultPlan(kinds=("slowdown",))) as proxy:
        store = store_for(checkpoint.source, proxy.url, attempts=3)
        obj = next(o for o in store.list(["*.json"]) if o.key == CONFIG)
        with pytest.raises(SourceUnavailable) as caught:
            store.read(obj, 0, memoryview(bytearray(obj.size)), ALGORITHM)
    assert str(caught.value) == (
        f"s3://models/tiny/{CONFIG} bytes 0-{obj.size - 1}: gave up after 3 attempt(s); "
        "last error: SlowDown (503)"
    )
    assert proxy.object_requests == 3


def test_object_replaced_after_listing_is_refused(s3: S3Server, tmp_path: Path) -> None:
    source = upload_files(s3, "replaced", {"model.safetensors": b"a" * 1000}, tmp_path / "one")
    store = store_for(source, s3.endpoint_url)
    (obj,) = store.list(["*"])
    s3.client().put_object(Bucket=BUCKET, Key="replaced/model.safetensors", Body=b"b" * 1000)
    with pytest.raises(SourceError) as caught:
        store.read(obj, 0, memoryview(bytearray(1000)), ALGORITHM)
    assert str(caught.value) == ("s3://models/replaced/model.safetensors bytes 0-999: the object "
                                 "changed since it was listed (ETag no longer matches)")


def test_missing_credentials_are_a_clear_error(
    s3: S3Server, checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(SourceError) as caught:
        store_for(checkpoint.source, s3.endpoint_url).list(["*"])
    assert str(caught.value) == "no S3 credentials for s3://models/tiny/"
    assert caught.value.hint.startswith("check the loader's S3 credentials (AWS_ACCESS_KEY_ID/"
                                        "AWS_SECRET_ACCESS_KEY from the source's Secret")


def test_secrets_never_reach_logs_or_errors(
    s3: S3Server, checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "s3cr3t-never-logged"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    caplog.set_level(logging.DEBUG, logger="dlo_loader")
    with FaultProxy(s3.endpoint_url, FaultPlan(kinds=FAULT_KINDS)) as proxy:
        store = store_for(checkpoint.source, proxy.url, attempts=len(FAULT_KINDS))
        obj = next(o for o in store.list(["*.json"]) if o.key == CONFIG)
        with pytest.raises(SourceUnavailable) as caught:
            store.read(obj, 0, memoryview(bytearray(obj.size)), ALGORITHM)
    assert len(caplog.records) == len(FAULT_KINDS) - 1
    assert secret not in caplog.text
    assert secret not in str(caught.value) and secret not in repr(caught.value.__cause__)


@contextlib.contextmanager
def keep_alive_server(data: bytes) -> Iterator[tuple[str, list[int]]]:
    """An HTTP/1.1 server that keeps connections open and answers ranged GETs of `data` (any
    key): its URL, and the number of requests on each connection it accepted."""
    connections: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.number = len(connections)
            connections.append(0)

        def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
            connections[self.number] += 1
            first, last = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)",
                                                self.headers["Range"]).groups())
            body = data[first:last + 1]
            self.send_response(206)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("ETag", '"e"')
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", connections
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.usefixtures("aws_env")
def test_ranged_reads_reuse_their_connection() -> None:
    data = bytes(range(256)) * 4000
    with keep_alive_server(data) as (url, connections):
        store = store_for("s3://models/any", url)
        piece = bytearray(100_000)
        for start in range(0, 500_000, 100_000):
            store.read(ObjectIdentity("model.safetensors", len(data), "e"), start,
                       memoryview(piece), ALGORITHM)
            assert piece == data[start:start + 100_000]
        store.close()
    assert connections == [5]  # one connection, kept open from one read to the next


@pytest.mark.parametrize(("sent", "expected"), [
    (b"0123456789", (10, False)), (b"0123", (4, False)), (b"0123456789ab", (10, True))])
def test_bodies_not_read_directly_take_botocore_path_with_the_same_checks(
    sent: bytes, expected: tuple[int, bool]
) -> None:
    into = bytearray(10)
    body = Body(StreamingBody(io.BytesIO(sent), len(sent)))
    got, crc = body.fill(memoryview(into), ALGORITHM)
    extra = got == len(into) and body.finish()
    assert (got, extra) == expected
    assert into[:got] == sent[:got]
    assert f"{crc:016x}" == chunk_digest(sent[:got], ALGORITHM)
