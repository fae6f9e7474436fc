"""Refilling a wiped node from the nodes that hold its entry: real `dlo cache fill` processes on
loopback. "Node A" fills from the store and stays up as a sidecar serving its entry; "node B"
(another cache root) fills alone, told of A by the fill-group document, with its store reads
counted by a proxy outside the loader."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from dlo_bench.faultproxy import CORRUPT, STALL, FaultPlan, FaultProxy
from dlo_bench.s3server import S3Server, free_port
from support.loader_fleet import (
    LOADER_SETTINGS,
    Checkpoint,
    Outcome,
    checkout_env,
    entry_files,
    finish,
    included,
    wait_until,
)

from dlo_contract.fill_group import FillGroup, Holder
from dlo_contract.cache import canonical_json, read_manifest
from dlo_contract.fill_proof import summary_proof
from dlo_contract.names import LOADER_PROOF_HEADER, LOADER_SUMMARY_PATH
from dlo_loader.peer_serve import ACCESS_HEADER, ENTRY_PATH, access_key

SECRET = b"fill secret of the DOD flux, 32B"


@dataclass
class Node:
    """One node's loader: its cache root and files, and where its endpoint listens."""

    tmp: Path
    name: str
    port: int
    secret: bytes = SECRET
    """The fill secret of the node's DOD (the operator mounts one per DOD)."""

    @property
    def root(self) -> Path:
        return self.tmp / self.name / "cache"

    @property
    def entry_file(self) -> Path:
        return self.tmp / self.name / "entry.json"

    def command(self, source: str, endpoint: str, *extra: str, **settings: object) -> list[str]:
        (self.tmp / self.name).mkdir(parents=True, exist_ok=True)
        config = self.tmp / self.name / "settings.json"
        config.write_text(json.dumps({"loader": {**LOADER_SETTINGS, "metrics_port": self.port,
                                                 **settings}}))
        return [sys.executable, "-m", "dlo_cli.main", "cache", "fill", "--config", str(config),
                "--source", source, "--endpoint-url", endpoint,
                "--cache-root", str(self.root), "--entry-file", str(self.entry_file),
                "--summary-file", str(self.tmp / self.name / "termination-log"), *extra]

    def start(self, source: str, endpoint: str, *extra: str, holders: tuple[Holder, ...] = (),
              **settings: object) -> subprocess.Popen[str]:
        command = self.command(source, endpoint, *extra, **settings)
        secret_file = self.tmp / self.name / "fill-secret"
        secret_file.write_bytes(self.secret)
        env = checkout_env(DLO_NODE_NAME=self.name,
                           DLO_FILL_GROUP=FillGroup(holders=holders).to_json(),
                           DLO_FILL_SECRET_FILE=str(secret_file))
        return subprocess.Popen(command, env=env,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def entry_id(self) -> str:
        return str(json.loads(self.entry_file.read_text())["entry_id"])

    def holder(self, port: int | None = None) -> Holder:
        return Holder(node=self.name, address="127.0.0.1", port=port or self.port)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith(name + " "))


@pytest.fixture
def node_a(s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
           ) -> Iterator[tuple[Node, subprocess.Popen[str]]]:
    """Node A: filled from the store, staying up as the pod's sidecar, serving its entry."""
    node = Node(tmp_path, "nodeA", free_port())
    process = node.start(checkpoint.source, s3.endpoint_url, "--keep-running")
    try:
        wait_until(lambda: node.entry_file.exists() or process.poll() is not None, 120)
        assert node.entry_file.exists(), process.communicate(timeout=10)
        entry = f"http://127.0.0.1:{node.port}{ENTRY_PATH}/{node.entry_id()}/manifest"
        wait_until(lambda: _get(entry, {})[0] != 404)  # it serves the entry (to a keyed reader)
        yield node, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=30)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _refill(node: Node, checkpoint: Checkpoint, store: FaultProxy,
            holders: tuple[Holder, ...]) -> Outcome:
    return finish(0, node.start(checkpoint.source, store.url, holders=holders))


@pytest.mark.usefixtures("aws_env")
def test_a_wiped_node_refills_from_the_holders_without_a_store_read(
        s3: S3Server, checkpoint: Checkpoint, node_a: tuple[Node, subprocess.Popen[str]],
        tmp_path: Path) -> None:
    """Every chunk comes from a holder, checked against its manifest, spread over both holders
    (A, and A again behind a second address standing for another node; a third, whose loader is
    gone, is skipped); the store is listed, never read; B's entry is A's, byte for byte, and A
    counts what it served."""
    a, _ = node_a
    b = Node(tmp_path, "nodeB", free_port())
    with FaultProxy(s3.endpoint_url) as store, \
            FaultProxy(f"http://127.0.0.1:{a.port}") as first, \
            FaultProxy(f"http://127.0.0.1:{a.port}") as second:
        outcome = _refill(b, checkpoint, store, (
            a.holder(_port(first.url)), Holder("nodeC", "127.0.0.1", _port(second.url)),
            Holder("nodeD", "127.0.0.1", free_port()), b.holder()))  # itself: left out
    assert outcome.returncode == 0, outcome.stderr
    total = sum(len(v) for v in included(checkpoint.files).values())
    assert store.object_requests == 0 and store.object_bytes == 0
    assert first.object_bytes > 0 and second.object_bytes > 0
    assert first.object_bytes + second.object_bytes == total
    assert outcome.summary["bytes_from_peers"] == total
    assert outcome.summary["bytes_from_store"] == 0
    assert sorted((p["node"], p["bytes"]) for p in outcome.summary["bytes_by_peer"]) == [
        ("nodeA", first.object_bytes), ("nodeC", second.object_bytes)]
    assert entry_files(b.root) == entry_files(a.root) == included(checkpoint.files)
    assert json.loads(b.entry_file.read_text())["entry_id"] == json.loads(
        a.entry_file.read_text())["entry_id"]
    assert a.metric("dlo_loader_bytes_served_total") == total
    assert "refilling entry" in outcome.stderr and "from 2 peer(s)" in outcome.stderr
    assert "peer nodeD (127.0.0.1:" in outcome.stderr


@pytest.mark.usefixtures("aws_env")
def test_a_holder_that_serves_a_corrupted_chunk_is_dropped_and_the_store_fills_the_rest(
        s3: S3Server, checkpoint: Checkpoint, node_a: tuple[Node, subprocess.Popen[str]],
        tmp_path: Path) -> None:
    """A's second chunk arrives with one byte flipped: its digest differs from the manifest's,
    so B reads that chunk and every later one from the store; the entry is still exact."""
    a, _ = node_a
    b = Node(tmp_path, "nodeB", free_port())
    with FaultProxy(f"http://127.0.0.1:{a.port}",
                    FaultPlan(kinds=(CORRUPT,), every=2, limit=1)) as bad, \
            FaultProxy(s3.endpoint_url) as store:
        outcome = _refill(b, checkpoint, store, (a.holder(_port(bad.url)),))
    assert outcome.returncode == 0, outcome.stderr
    total = sum(len(v) for v in included(checkpoint.files).values())
    assert bad.faults[CORRUPT] == 1
    assert 0 < outcome.summary["bytes_from_peers"] < total
    assert outcome.summary["bytes_from_peers"] + outcome.summary["bytes_from_store"] == total
    assert store.object_bytes == outcome.summary["bytes_from_store"]
    assert entry_files(b.root) == included(checkpoint.files)
    assert "differ from the entry's digest" in outcome.stderr


@pytest.mark.usefixtures("aws_env")
def test_a_holder_that_goes_silent_is_dropped_after_the_stall_timeout(
        s3: S3Server, checkpoint: Checkpoint, node_a: tuple[Node, subprocess.Popen[str]],
        tmp_path: Path) -> None:
    """A's first chunk stops halfway and nothing follows: after `stallTimeoutSeconds` B drops
    A and reads that chunk and the rest from the store."""
    a, _ = node_a
    b = Node(tmp_path, "nodeB", free_port())
    with FaultProxy(f"http://127.0.0.1:{a.port}",
                    FaultPlan(kinds=(STALL,), limit=1, stall_s=30.0)) as silent, \
            FaultProxy(s3.endpoint_url) as store:
        outcome = finish(0, b.start(checkpoint.source, store.url, holders=(
            a.holder(_port(silent.url)),), readers=1, stall_timeout_s=1.0))
    assert outcome.returncode == 0, outcome.stderr
    total = sum(len(v) for v in included(checkpoint.files).values())
    assert silent.faults[STALL] == 1
    assert outcome.summary["bytes_from_peers"] == 0
    assert outcome.summary["bytes_from_store"] == total == store.object_bytes
    assert entry_files(b.root) == included(checkpoint.files)
    assert "timed out" in outcome.stderr


@pytest.mark.usefixtures("aws_env")
def test_a_holder_that_dies_mid_refill_is_dropped_and_the_store_fills_the_rest(
        s3: S3Server, checkpoint: Checkpoint, node_a: tuple[Node, subprocess.Popen[str]],
        tmp_path: Path) -> None:
    """B's first chunk read from A is held until A is SIGKILLed: B finds A gone, and the store
    serves the whole entry; nothing from A reached B."""
    a, a_process = node_a
    b = Node(tmp_path, "nodeB", free_port())
    with FaultProxy(f"http://127.0.0.1:{a.port}") as held, \
            FaultProxy(s3.endpoint_url) as store:
        held.reads_open.clear()
        process = b.start(checkpoint.source, store.url, holders=(
            a.holder(_port(held.url)),), readers=1)
        wait_until(lambda: held.object_requests >= 1 or process.poll() is not None)
        a_process.kill()
        a_process.communicate(timeout=30)
        held.reads_open.set()
        outcome = finish(0, process)
    assert outcome.returncode == 0, outcome.stderr
    total = sum(len(v) for v in included(checkpoint.files).values())
    assert outcome.summary["bytes_from_peers"] == 0
    assert outcome.summary["bytes_from_store"] == total == store.object_bytes
    assert entry_files(b.root) == included(checkpoint.files)
    assert "the store serves the rest" in outcome.stderr


@pytest.mark.usefixtures("aws_env")
def test_the_served_entry_answers_only_a_reader_that_listed_its_source(
        checkpoint: Checkpoint, node_a: tuple[Node, subprocess.Popen[str]]) -> None:
    """Without the entry's key (an HMAC of its source's listing with the DOD's fill secret),
    with another entry's id, a name outside the manifest, a range outside the file
    or a method other than GET, A serves nothing; with the key, the range asked for."""
    a, _ = node_a
    entry_id = json.loads(a.entry_file.read_text())["entry_id"]
    manifest = read_manifest(a.root / "v1" / "entries" / entry_id / "manifest.json")
    key = access_key(SECRET, manifest.identity)
    base = f"http://127.0.0.1:{a.port}{ENTRY_PATH}"
    name = "transformer/config.json"

    def answer(path: str, key: str | None = key, method: str = "GET",
               asked: str = "bytes=0-1") -> tuple[int, bytes]:
        request = urllib.request.Request(base + path, method=method, headers={
            "Range": asked, **({ACCESS_HEADER: key} if key else {})})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, b""

    assert answer(f"/{entry_id}/files/{name}") == (206, checkpoint.files[name][:2])
    assert answer(f"/{entry_id}/manifest", key=None)[0] == 403
    assert answer(f"/{entry_id}/files/{name}", key=entry_id)[0] == 403
    assert answer(f"/{'0' * 64}/files/{name}")[0] == 404
    assert answer(f"/{entry_id}/files/../../../../etc/passwd")[0] == 404
    assert answer(f"/{entry_id}/files/transformer/../transformer/config.json")[0] == 404
    assert answer(f"/{entry_id}/files/{name}", asked="bytes=0-999999")[0] == 416
    assert answer(f"/{entry_id}/manifest", method="PUT")[0] == 405


def _get(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_client_that_knows_the_listing_but_not_the_secret_gets_nothing(
        node_a: tuple[Node, subprocess.Popen[str]]) -> None:
    """Another namespace rebuilds the entry's identity from the public listing (here read from
    A's own manifest) and guesses its id: with a digest of the listing, or an HMAC with another
    DOD's secret, A serves no manifest and no byte, and its summary (the entry id, the pods and
    nodes) goes only to a reader that shows A's DOD's secret."""
    a, _ = node_a
    entry_id = json.loads(a.entry_file.read_text())["entry_id"]
    manifest = read_manifest(a.root / "v1" / "entries" / entry_id / "manifest.json")
    listing = canonical_json(dict(manifest.identity)).encode("ascii")
    guesses = (hashlib.sha256(b"dlo-peer-entry\n" + listing).hexdigest(),
               access_key(b"fill secret of another DOD, 32 B", manifest.identity))
    base = f"http://127.0.0.1:{a.port}"
    name = "transformer/config.json"
    for guess in guesses:
        for path in (f"/{entry_id}/manifest", f"/{entry_id}/files/{name}",
                     f"/{'0' * 64}/manifest"):  # nor is a wrong guess of the id told apart
            status, body = _get(base + ENTRY_PATH + path, {ACCESS_HEADER: guess,
                                                           "Range": "bytes=0-1"})
            assert (status, body) == (403, b"no key of this entry\n")
    refused = (403, f"no proof of the DOD's fill secret in {LOADER_PROOF_HEADER}\n".encode())
    assert _get(base + LOADER_SUMMARY_PATH, {}) == refused
    assert _get(base + LOADER_SUMMARY_PATH, {
        LOADER_PROOF_HEADER: summary_proof(b"fill secret of another DOD, 32 B")}) == refused
    status, body = _get(base + LOADER_SUMMARY_PATH, {LOADER_PROOF_HEADER: summary_proof(SECRET)})
    assert status == 200 and json.loads(body)["entry_id"] == entry_id


@pytest.mark.usefixtures("aws_env")
def test_a_loader_of_another_dod_reads_nothing_from_the_holder(
        s3: S3Server, checkpoint: Checkpoint, node_a: tuple[Node, subprocess.Popen[str]],
        tmp_path: Path) -> None:
    """B lists the same public source as A but holds another DOD's fill secret: A refuses it,
    and B fills from the store alone."""
    a, _ = node_a
    b = Node(tmp_path, "nodeB", free_port(), secret=b"fill secret of another DOD, 32 B")
    with FaultProxy(s3.endpoint_url) as store:
        outcome = _refill(b, checkpoint, store, (a.holder(),))
    assert outcome.returncode == 0, outcome.stderr
    total = sum(len(v) for v in included(checkpoint.files).values())
    assert outcome.summary["bytes_from_peers"] == 0
    assert outcome.summary["bytes_from_store"] == total == store.object_bytes
    assert a.metric("dlo_loader_bytes_served_total") == 0
    assert "answered 403 no key of this entry" in outcome.stderr


SLOW_CLIENTS = 300


def test_slow_clients_leave_the_endpoint_serving_its_peers_and_scrapes(
        node_a: tuple[Node, subprocess.Popen[str]]) -> None:
    """300 connections each send half a request and hold. A still answers a scrape and a peer
    read, holds a bounded number of threads (not one per connection), and closes the oldest
    half-sent requests itself once more than it keeps are waiting."""
    a, process = node_a
    entry_id = json.loads(a.entry_file.read_text())["entry_id"]
    manifest = read_manifest(a.root / "v1" / "entries" / entry_id / "manifest.json")
    name = "transformer/config.json"
    slow = []
    try:
        for _ in range(SLOW_CLIENTS):
            sock = socket.create_connection(("127.0.0.1", a.port), timeout=30)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: loader\r\n")
            slow.append(sock)
        status, text = _get(f"http://127.0.0.1:{a.port}/metrics", {})
        assert status == 200 and b"dlo_loader_bytes_done_bytes" in text
        status, body = _get(f"http://127.0.0.1:{a.port}{ENTRY_PATH}/{entry_id}/files/{name}", {
            ACCESS_HEADER: access_key(SECRET, manifest.identity), "Range": "bytes=0-9"})
        assert (status, body) == (206, checkpoint_bytes(a, entry_id, name)[:10])
        threads = len(os.listdir(f"/proc/{process.pid}/task"))
        assert threads < SLOW_CLIENTS // 3
        closed = sum(_closed_by_server(sock) for sock in slow[:SLOW_CLIENTS // 2])
        assert closed == SLOW_CLIENTS // 2  # the oldest went first
    finally:
        for sock in slow:
            sock.close()


def checkpoint_bytes(node: Node, entry_id: str, name: str) -> bytes:
    return (node.root / "v1" / "entries" / entry_id / name).read_bytes()


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (its end of file, or a reset, reaches the client)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
