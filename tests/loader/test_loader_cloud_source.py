"""The `gs://` and `az://` readers against their emulators (fake-gcs-server, Azurite), each behind
the fault-injecting proxy: listing with version identity and store checksums, ranged reads into
the caller's buffer, the retried faults, a replaced object, wrong credentials, an empty prefix."""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import json
import logging
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import google_crc32c
import pytest
from dlo_bench.emulators import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    GCS_EMULATOR_ENV,
    azurite_connection_string,
)
from dlo_bench.faultproxy import CORRUPT, FAULT_KINDS, STALL, FaultPlan, FaultProxy
from dlo_loader import digest
from dlo_loader.errors import SourceChanged, SourceError, SourceUnavailable
from dlo_loader.sources import Source, SourceOptions, open_source, parse_source
from dlo_contract.cache import ObjectIdentity
from dlo_contract.source_credentials import (
    AZURE_ACCOUNT_KEY_ENV,
    AZURE_CONNECTION_STRING_ENV,
    AZURE_SAS_TOKEN_ENV,
    GOOGLE_APPLICATION_CREDENTIALS_ENV,
)
from support.cloud_stores import CONTAINER, CloudStore
from support.loader_fleet import included

INCLUDE = ("*.safetensors", "*.json")
SHARD = "transformer/model-00001-of-00002.safetensors"


def open_store(cloud: CloudStore, source: str, via: str | None = None,
               **options: object) -> Source:
    settings = {"readers": 4, "attempts": 4} | options
    return open_source(parse_source(source),
                       SourceOptions(endpoint_url=cloud.endpoint(via), **settings))


def read_whole(store: Source, obj: ObjectIdentity) -> tuple[bytes, str]:
    """The object's bytes read in one range, and their digest as the fill hashes them."""
    algorithm = store.chunk_algorithms.get(obj.key, digest.ALGORITHM)
    buffer = bytearray(obj.size)
    crc = store.read(obj, 0, memoryview(buffer), algorithm)
    return bytes(buffer), digest.of_running(crc, algorithm)


def listed(store: Source, key: str) -> ObjectIdentity:
    return next(o for o in store.list(INCLUDE) if o.key == key)


def test_listing_names_each_objects_version_and_the_stores_checksum(
        cloud: CloudStore, cloud_source: str, cloud_files: dict[str, bytes]) -> None:
    store = open_store(cloud, cloud_source)
    objects = store.list(INCLUDE)
    assert [(o.key, o.size) for o in objects] == [(k, len(v)) for k, v in
                                                   sorted(included(cloud_files).items())]
    checksums = store.checksums(objects)
    for obj in objects:
        data = cloud_files[obj.key]
        if cloud.scheme == "gs":  # the generation, and the CRC32C the chunks are hashed with
            assert obj.etag.isdigit()
            assert store.chunk_algorithms[obj.key] == "crc32c"
            assert checksums[obj.key] == digest.StoreChecksum(
                "crc32c", google_crc32c.Checksum(data).digest().hex())
        else:  # the ETag; Content-MD5, which Azure keeps for a blob written in one request
            assert obj.etag.startswith("0x")
            assert obj.key not in store.chunk_algorithms
            assert checksums[obj.key] == digest.StoreChecksum("md5", hashlib.md5(data).hexdigest())


def test_a_range_lands_in_the_callers_buffer_with_its_crc(
        cloud: CloudStore, cloud_source: str, cloud_files: dict[str, bytes]) -> None:
    store = open_store(cloud, cloud_source)
    obj = listed(store, SHARD)
    buffer = bytearray(b"\xee" * 1002)
    view = memoryview(buffer)[1:1001]
    crc = store.read(obj, 4096, view, "crc64nvme")
    assert bytes(buffer) == b"\xee" + cloud_files[SHARD][4096:5096] + b"\xee"
    assert digest.of_running(crc, "crc64nvme") == digest.chunk_digest(view, "crc64nvme")


def test_a_stream_delivers_every_piece_in_order(
        cloud: CloudStore, cloud_source: str, cloud_files: dict[str, bytes]) -> None:
    store = open_store(cloud, cloud_source)
    obj = listed(store, SHARD)
    got = bytearray()
    pieces = iter(lambda: memoryview(bytearray(100_000)), None)
    crc = store.stream(obj, 10, obj.size - 10, pieces,
                       lambda offset, view: got.extend(view), "crc32c")
    assert bytes(got) == cloud_files[SHARD][10:]
    assert crc == google_crc32c.value(cloud_files[SHARD][10:])


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_transient_faults_are_asked_again(
        kind: str, cloud: CloudStore, cloud_source: str,
        cloud_files: dict[str, bytes]) -> None:
    with FaultProxy(cloud.emulator.server_url, FaultPlan(kinds=(kind,), limit=2)) as proxy:
        store = open_store(cloud, cloud_source, proxy.url)
        obj = listed(store, SHARD)
        assert read_whole(store, obj)[0] == cloud_files[SHARD]
    assert proxy.faults[kind] == 2


def test_a_stall_is_abandoned_and_asked_again(
        cloud: CloudStore, cloud_source: str, cloud_files: dict[str, bytes]) -> None:
    stalls: list[str] = []
    plan = FaultPlan(kinds=(STALL,), limit=1, stall_s=5.0)
    with FaultProxy(cloud.emulator.server_url, plan) as proxy:
        store = open_store(cloud, cloud_source, proxy.url, stall_timeout_s=0.5,
                           on_stall=stalls.append)
        obj = listed(store, SHARD)
        assert read_whole(store, obj)[0] == cloud_files[SHARD]
    assert proxy.faults[STALL] == 1
    assert stalls and f"{cloud_source}{SHARD}" in stalls[0]  # (a slow machine may add one)


def test_faults_that_persist_give_up_as_unavailable(cloud: CloudStore, cloud_source: str) -> None:
    with FaultProxy(cloud.emulator.server_url, FaultPlan(kinds=("slowdown",))) as proxy:
        store = open_store(cloud, cloud_source, proxy.url, attempts=2)
        obj = listed(store, SHARD)
        with pytest.raises(SourceUnavailable) as caught:
            read_whole(store, obj)
    assert str(caught.value).startswith(f"{cloud_source}{SHARD} bytes 0-")
    assert "gave up after 2 attempt(s)" in str(caught.value)


def test_damaged_bytes_differ_from_the_stores_checksum(
        cloud: CloudStore, cloud_source: str, cloud_files: dict[str, bytes]) -> None:
    """Nothing in the answer tells a flipped byte; the store's checksum of the object does."""
    with FaultProxy(cloud.emulator.server_url, FaultPlan(kinds=(CORRUPT,), limit=1)) as proxy:
        store = open_store(cloud, cloud_source, proxy.url)
        obj = listed(store, SHARD)
        data, ours = read_whole(store, obj)
    published = store.checksums([obj])[obj.key]
    assert data != cloud_files[SHARD]
    mine = ours if cloud.scheme == "gs" else hashlib.md5(data).hexdigest()
    assert published.value != mine


def container_sas(cloud: CloudStore) -> str:
    """A read-and-list SAS of the test container (it signs no header, unlike the shared key)."""
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    return generate_container_sas(AZURITE_ACCOUNT, CONTAINER, account_key=AZURITE_KEY,
                                  permission=ContainerSasPermissions(read=True, list=True),
                                  expiry=datetime.datetime.now(datetime.UTC)
                                  + datetime.timedelta(hours=1))


@pytest.mark.parametrize("ignore_if_match", [False, True], ids=["precondition", "answer"])
def test_an_object_replaced_after_listing_is_a_changed_source(
        ignore_if_match: bool, cloud: CloudStore, cloud_source: str,
        cloud_files: dict[str, bytes],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the precondition (412) or, where a store ignores it, by the answer's version
    (Azure then reads with a SAS: the proxy drops `If-Match`, which a shared key signs)."""
    if ignore_if_match and cloud.scheme == "az":
        monkeypatch.delenv(AZURE_ACCOUNT_KEY_ENV)
        monkeypatch.setenv(AZURE_SAS_TOKEN_ENV, container_sas(cloud))
    plan = FaultPlan(ignore_if_match=ignore_if_match)
    with FaultProxy(cloud.emulator.server_url, plan) as proxy:
        store = open_store(cloud, cloud_source, proxy.url)
        obj = listed(store, SHARD)
        prefix = cloud_source.rstrip("/").rsplit("/", 1)[1]
        cloud.emulator.put(CONTAINER, {SHARD: cloud_files[SHARD][::-1]}, f"{prefix}/")
        with pytest.raises(SourceChanged) as caught:
            read_whole(store, obj)
    assert str(caught.value).startswith(f"{cloud_source}{SHARD}")
    assert "changed since it was listed" in str(caught.value)


def test_an_empty_prefix_names_the_source_and_the_globs(cloud: CloudStore) -> None:
    empty = cloud.source("nothing-here")
    with pytest.raises(SourceError) as caught:
        open_store(cloud, empty).list(INCLUDE)
    assert str(caught.value) == (f"no object under {empty} matches "
                                 f"loader.include={list(INCLUDE)}")


def test_a_missing_container_is_not_found(cloud: CloudStore) -> None:
    absent = cloud.source("tiny").replace("/models/", "/absent/")
    with pytest.raises(SourceError) as caught:
        open_store(cloud, absent).list(INCLUDE)
    assert str(caught.value).startswith(f"listing {absent}: not found")


def test_a_wrong_azure_key_is_denied_without_the_key(
        az_store: CloudStore, cloud_files: dict[str, bytes],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(Azurite checks shared-key signatures; fake-gcs-server checks no credential.)"""
    source = az_store.put("denied", cloud_files)
    wrong = base64.b64encode(b"not the account key" * 3).decode()
    monkeypatch.setenv(AZURE_ACCOUNT_KEY_ENV, wrong)
    with pytest.raises(SourceError) as caught:
        open_store(az_store, source).list(INCLUDE)
    text = f"{caught.value} {caught.value.hint}"
    assert str(caught.value) == f"listing {source}: access denied (AuthorizationFailure)"
    assert AZURE_ACCOUNT_KEY_ENV in caught.value.hint
    assert wrong not in text and AZURITE_KEY not in text
    monkeypatch.setenv(AZURE_ACCOUNT_KEY_ENV, "not base64!")  # cannot even sign a request
    with pytest.raises(SourceError) as caught:
        open_store(az_store, source).list(INCLUDE)
    assert str(caught.value) == f"listing {source}: access denied (AzureSigningError)"
    assert "not base64!" not in f"{caught.value} {caught.value.hint}"


def test_an_azure_connection_string_names_the_account_and_an_endpoint(
        az_store: CloudStore, cloud_files: dict[str, bytes],
        monkeypatch: pytest.MonkeyPatch) -> None:
    source = az_store.put("connection-string", cloud_files)
    monkeypatch.delenv(AZURE_ACCOUNT_KEY_ENV)
    monkeypatch.setenv(AZURE_CONNECTION_STRING_ENV,
                       azurite_connection_string(az_store.emulator.server_url))
    store = open_source(parse_source(source), SourceOptions(readers=2))
    assert [o.key for o in store.list(["*.json"])] == ["transformer/config.json"]
    with FaultProxy(az_store.emulator.server_url) as proxy:  # the endpoint setting wins
        monkeypatch.setenv(AZURE_CONNECTION_STRING_ENV,
                           azurite_connection_string("http://127.0.0.1:9"))
        store = open_store(az_store, source, proxy.url)
        read_whole(store, listed(store, SHARD))
    assert proxy.object_bytes == len(cloud_files[SHARD])
    other = source.replace("az://devstoreaccount1/", "az://otheraccount/")
    with pytest.raises(SourceError) as caught:
        open_source(parse_source(other), SourceOptions(readers=2))
    assert str(caught.value) == (
        f"{AZURE_CONNECTION_STRING_ENV} is for account 'devstoreaccount1', the source {other} "
        "is in account 'otheraccount'")
    assert AZURITE_KEY not in str(caught.value)


@contextlib.contextmanager
def answering(status: int, document: dict[str, object]) -> Iterator[str]:
    """An HTTP server on loopback answering every GET and POST with `status` and `document`
    (JSON); yields its URL."""

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            """Silent."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def denying_server() -> Iterator[str]:
    """Answers every request as GCS answers a caller without access."""
    with answering(403, {"error": {"code": 403, "message": "caller has no access",
                                   "errors": [{"reason": "forbidden"}]}}) as url:
        yield url


def test_gcs_access_denied_names_the_source_and_where_credentials_come_from(
        gs_store: CloudStore, denying_server: str) -> None:
    source = gs_store.source("tiny")
    with pytest.raises(SourceError) as caught:
        open_store(gs_store, source, denying_server).list(INCLUDE)
    assert str(caught.value) == f"listing {source}: access denied (forbidden)"
    assert GOOGLE_APPLICATION_CREDENTIALS_ENV in caught.value.hint


def test_gcs_without_usable_credentials_says_so(
        gs_store: CloudStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(GCS_EMULATOR_ENV)
    monkeypatch.setenv(GOOGLE_APPLICATION_CREDENTIALS_ENV, str(tmp_path / "absent.json"))
    source = gs_store.source("tiny")
    with pytest.raises(SourceError) as caught:
        open_source(parse_source(source), SourceOptions())
    assert str(caught.value).startswith(f"no GCS credentials for {source}: ")
    assert GOOGLE_APPLICATION_CREDENTIALS_ENV in caught.value.hint


def test_reads_log_no_request_and_no_credential(
        cloud: CloudStore, cloud_source: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The clients' own request logs stay quiet at the loader's level (INFO); a SAS, which
    rides in every URL's query, reaches no record even when a read fails."""
    secret = container_sas(cloud) if cloud.scheme == "az" else ""
    if secret:
        monkeypatch.delenv(AZURE_ACCOUNT_KEY_ENV)
        monkeypatch.setenv(AZURE_SAS_TOKEN_ENV, secret)
    caplog.set_level(logging.INFO)
    with FaultProxy(cloud.emulator.server_url, FaultPlan(kinds=("reset",), limit=1)) as proxy:
        store = open_store(cloud, cloud_source, proxy.url)
        read_whole(store, listed(store, SHARD))
    logged = [(r.name, r.getMessage()) for r in caplog.records]
    quiet = ("azure", "google", "dlo_loader.sources")
    assert not [name for name, _ in logged if name.startswith(quiet)]
    assert any("retry 1/3" in message for _, message in logged)  # the reset, asked again
    assert not secret or not [m for _, m in logged if secret in m or "sig=" in m]


def test_a_store_that_cannot_be_reached_is_named_by_its_endpoint(
        cloud: CloudStore, cloud_source: str) -> None:
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(SourceUnavailable) as caught:
            open_store(cloud, cloud_source, endpoint, attempts=2).list(INCLUDE)
    assert str(caught.value).startswith(f"listing {cloud_source}: gave up after 2 attempt(s)")
    assert f"at {endpoint} cannot be reached" in caught.value.hint


def test_an_azure_blob_url_is_the_same_source_as_its_az_uri(
        az_store: CloudStore, cloud_files: dict[str, bytes]) -> None:
    source = az_store.put("blob-url", cloud_files)
    uri = parse_source(f"https://{AZURITE_ACCOUNT}.blob.core.windows.net/{CONTAINER}/blob-url/")
    assert str(uri) == source  # one spelling in messages and in the entry's identity
    store = open_source(uri, SourceOptions(endpoint_url=az_store.endpoint()))
    assert read_whole(store, listed(store, SHARD))[0] == cloud_files[SHARD]


def test_a_blob_written_in_blocks_has_no_checksum_and_counts_as_unchecked(
        az_store: CloudStore, cloud_files: dict[str, bytes]) -> None:
    """Azure computes Content-MD5 only for a blob written in one request."""
    from azure.storage.blob import BlobServiceClient

    source = az_store.put("blocks", cloud_files)
    service = BlobServiceClient.from_connection_string(
        azurite_connection_string(az_store.emulator.server_url), max_single_put_size=64 << 10,
        max_block_size=64 << 10)
    service.get_container_client(CONTAINER).upload_blob(
        f"blocks/{SHARD}", cloud_files[SHARD], overwrite=True)
    store = open_store(az_store, source)
    objects = store.list(INCLUDE)
    checksums = store.checksums(objects)
    assert checksums[SHARD] == digest.StoreChecksum(None)
    assert all(checksums[o.key].algorithm == "md5" for o in objects if o.key != SHARD)


@pytest.fixture
def refusing_token_server() -> Iterator[str]:
    """An OAuth token endpoint refusing every grant, as Google's refuses a revoked key."""
    with answering(400, {"error": "invalid_grant",
                         "error_description": "Invalid JWT Signature."}) as url:
        yield f"{url}/token"


def test_a_gcs_key_the_token_service_refuses_is_denied_without_the_key(
        gs_store: CloudStore, cloud_files: dict[str, bytes], refusing_token_server: str,
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    source = gs_store.put("revoked", cloud_files)
    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()).decode()
    key_file = tmp_path / "key.json"
    key_file.write_text(json.dumps({
        "type": "service_account", "project_id": "test", "private_key_id": "1",
        "private_key": pem, "client_email": "loader@test.iam.gserviceaccount.com",
        "client_id": "1", "token_uri": refusing_token_server}))
    monkeypatch.delenv(GCS_EMULATOR_ENV)  # the key file, not the emulator's anonymity
    monkeypatch.setenv(GOOGLE_APPLICATION_CREDENTIALS_ENV, str(key_file))
    with pytest.raises(SourceError) as caught:
        open_store(gs_store, source).list(INCLUDE)
    assert str(caught.value) == f"listing {source}: access denied (credentials refresh failed)"
    assert GOOGLE_APPLICATION_CREDENTIALS_ENV in caught.value.hint
    assert "PRIVATE KEY" not in f"{caught.value} {caught.value.hint}"
