"""The source seam's file, https and hf readers against their real local servers (a directory,
a threaded HTTP server with ranges and ETags, a Hub stand-in) with the loader's fault cases:
5xx, resets, short bodies, stalls, a file replaced mid-fill, wrong credentials, an empty
listing."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FAULT_KINDS, STALL, FaultPlan
from dlo_bench.s3server import free_port
from dlo_loader.digest import ALGORITHM, chunk_digest, file_hash
from dlo_loader.errors import SourceChanged, SourceError, SourceUnavailable
from dlo_loader.sources import Source, SourceOptions, open_source, parse_source
from dlo_contract.cache import ObjectIdentity
from dlo_contract.source_credentials import HF_TOKEN_ENV, HTTPS_TOKEN_ENV
from support.loader_fleet import PROCESS_TIMEOUT_S, Checkpoint, checkout_env
from support.range_server import replace_file
from support.scheme_servers import HUB_REPO, SCHEMES, TOKEN, Served, serving

SHARD = "transformer/model-00001-of-00002.safetensors"
SERVED = ("https", "hf")
"""The schemes read over HTTP, where the network's faults apply."""
TOKEN_ENV = {"https": HTTPS_TOKEN_ENV, "hf": HF_TOKEN_ENV}


def open_served(served: Served, **options: object) -> Source:
    settings = {"readers": 2, "attempts": 4, "endpoint_url": served.endpoint, **options}
    return open_source(parse_source(served.source), SourceOptions(**settings))


def shard_of(source: Source) -> ObjectIdentity:
    return next(o for o in source.list(["*.safetensors"]) if o.key == SHARD)


def test_a_scheme_without_a_reader_in_the_image_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each scheme's reader is the module `dlo_loader.sources.<scheme>`, imported on use."""
    import dlo_loader.sources as sources

    def missing(name: str) -> None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(sources.importlib, "import_module", missing)
    uri = parse_source("gs://models/flux/")
    with pytest.raises(SourceError) as caught:
        open_source(uri, SourceOptions(names=lambda path: f"spec.{path}"))
    assert str(caught.value) == ("spec.loader.source='gs://models/flux/': this loader does not "
                                 "read gs:// sources")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_listing_and_ranged_reads_give_the_exact_bytes(
        scheme: str, checkpoint: Checkpoint, tmp_path: Path) -> None:
    with serving(scheme, checkpoint.files, tmp_path) as served:
        source = open_served(served)
        objects = source.list(["*.safetensors", "transformer/*.json"])
        assert [(o.key, o.size) for o in objects] == [
            (key, len(checkpoint.files[key])) for key in (
                "transformer/config.json", SHARD,
                "transformer/model-00002-of-00002.safetensors")]
        obj = objects[1]
        data = bytearray(300_000)
        crc = source.read(obj, 1000, memoryview(data), ALGORITHM)
        source.close()
    assert data == checkpoint.files[SHARD][1000:301_000]
    assert f"{crc:016x}" == chunk_digest(checkpoint.files[SHARD][1000:301_000], ALGORITHM)


@pytest.mark.parametrize("scheme", SERVED)
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_each_fault_kind_is_retried_to_exact_bytes(
        scheme: str, kind: str, checkpoint: Checkpoint, tmp_path: Path) -> None:
    with serving(scheme, checkpoint.files, tmp_path,
                 plan=FaultPlan(kinds=(kind,), limit=2)) as served:
        source = open_served(served)
        obj = shard_of(source)
        data = bytearray(obj.size - 10)
        crc = source.read(obj, 10, memoryview(data), ALGORITHM)
    assert data == checkpoint.files[SHARD][10:]
    assert f"{crc:016x}" == chunk_digest(checkpoint.files[SHARD][10:], ALGORITHM)
    assert served.proxy.faults == {kind: 2} and served.proxy.object_requests == 3


@pytest.mark.parametrize("scheme", SERVED)
def test_persistent_5xx_gives_up_naming_the_range_and_the_last_error(
        scheme: str, checkpoint: Checkpoint, tmp_path: Path) -> None:
    with serving(scheme, checkpoint.files, tmp_path,
                 plan=FaultPlan(kinds=("slowdown",))) as served:
        source = open_served(served, attempts=3)
        obj = shard_of(source)
        with pytest.raises(SourceUnavailable) as caught:
            source.read(obj, 0, memoryview(bytearray(100)), ALGORITHM)
    assert str(caught.value) == (f"{served.source}{SHARD} bytes 0-99: gave up after 3 "
                                 "attempt(s); last error: HTTP (503)")


@pytest.mark.parametrize("scheme", SERVED)
def test_a_stalled_body_is_asked_again_at_once_and_reported(
        scheme: str, checkpoint: Checkpoint, tmp_path: Path) -> None:
    stalls: list[str] = []
    with serving(scheme, checkpoint.files, tmp_path,
                 plan=FaultPlan(kinds=(STALL,), limit=1, stall_s=20.0)) as served:
        source = open_served(served, stall_timeout_s=0.5, on_stall=stalls.append)
        obj = shard_of(source)
        data = bytearray(obj.size)
        source.read(obj, 0, memoryview(data), ALGORITHM)
    assert data == checkpoint.files[SHARD]
    assert served.proxy.faults == {STALL: 1} and served.proxy.object_requests == 2
    assert len(stalls) == 1 and stalls[0].startswith(f"{served.source}{SHARD} bytes 0-")


@pytest.mark.parametrize("scheme, if_match", [
    ("file", "none"), ("https", "kept"), ("https", "ignored")])
def test_a_file_replaced_after_listing_is_refused(
        scheme: str, if_match: str, checkpoint: Checkpoint, tmp_path: Path) -> None:
    """`If-Match` makes the server refuse (412); a server that ignores it is caught by the
    answer's own ETag; a directory by the file's identity."""
    plan = FaultPlan(ignore_if_match=if_match == "ignored")
    with serving(scheme, checkpoint.files, tmp_path, plan=plan) as served:
        source = open_served(served)
        obj = shard_of(source)
        replace_file(served.directory / SHARD, bytes(obj.size))
        with pytest.raises(SourceChanged) as caught:
            source.read(obj, 0, memoryview(bytearray(100)), ALGORITHM)
    assert str(caught.value).startswith(f"{served.source}{SHARD} bytes 0-99: the ") or \
        str(caught.value).startswith(f"{served.source}{SHARD}: the file changed")
    assert "changed since it was listed" in str(caught.value)


def test_a_hub_branch_moved_mid_fill_changes_nothing_read(
        checkpoint: Checkpoint, tmp_path: Path) -> None:
    """Every read names the commit the listing found: a push to `main` after it is not read."""
    with serving("hf", checkpoint.files, tmp_path) as served:
        source = open_served(served)
        obj = shard_of(source)
        served.hub.push({SHARD: bytes(obj.size)})
        data = bytearray(obj.size)
        source.read(obj, 0, memoryview(data), ALGORITHM)
    assert data == checkpoint.files[SHARD] and obj.version_id in served.hub.commits


def test_a_hub_folder_at_a_pinned_revision_reads_that_commit(
        checkpoint: Checkpoint, tmp_path: Path) -> None:
    with serving("hf", checkpoint.files, tmp_path) as served:
        first = served.hub.branches["main"]
        served.hub.push({name: data[::-1] for name, data in checkpoint.files.items()})
        pinned = Served("hf", f"hf://{HUB_REPO}@{first}/transformer/", served.endpoint, None)
        source = open_served(pinned)
        objects = source.list(["*.safetensors"])
        key = SHARD.removeprefix("transformer/")
        obj = next(o for o in objects if o.key == key)
        data = bytearray(obj.size)
        source.read(obj, 0, memoryview(data), ALGORITHM)
    assert [o.key for o in objects] == [key, "model-00002-of-00002.safetensors"]
    assert {o.version_id for o in objects} == {first} and data == checkpoint.files[SHARD]


def test_the_hub_stand_in_answers_huggingface_hub_as_the_hub_does(
        checkpoint: Checkpoint, tmp_path: Path) -> None:
    """The stand-in is checked against the Hub's own client: its model info (files, sizes,
    LFS sha256 at a commit) and a download through the resolve URL and its redirect."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    with serving("hf", checkpoint.files, tmp_path) as served:
        api = huggingface_hub.HfApi(endpoint=served.endpoint)
        commit = served.hub.branches["main"]
        info = api.model_info(HUB_REPO, revision=commit, files_metadata=True)
        shard = next(s for s in info.siblings if s.rfilename == SHARD)
        path = huggingface_hub.hf_hub_download(HUB_REPO, SHARD, revision=commit,
                                               endpoint=served.endpoint,
                                               cache_dir=tmp_path / "hf-cache")
        source = open_served(served)
        listed = shard_of(source)
    assert info.sha == commit == listed.version_id
    assert (shard.size, shard.lfs.sha256) == (listed.size, listed.etag)
    assert Path(path).read_bytes() == checkpoint.files[SHARD]


def test_hub_reads_go_to_where_the_resolve_url_redirected_until_it_expires(
        checkpoint: Checkpoint, tmp_path: Path) -> None:
    """One resolve per file, not per read: its storage URL serves the next reads, and a refused
    one (its signature expired) is resolved again."""
    with serving("hf", checkpoint.files, tmp_path) as served:
        source = open_served(served)
        obj = shard_of(source)
        requests_before = served.hub.served.requests["GET"]
        data = bytearray(obj.size)
        quarter = obj.size // 4
        for start in range(0, obj.size, quarter):
            view = memoryview(data)[start:start + quarter]
            source.read(obj, start, view, ALGORITHM)
            if start == quarter:
                served.hub.expire_signatures()
    assert data == checkpoint.files[SHARD]
    assert served.hub.served.requests["GET"] - requests_before == 2  # the first, and after expiry
    assert served.hub.stored.requests["GET"] == len(range(0, obj.size, quarter)) + 1  # one 403


def test_a_hub_file_not_the_listed_one_is_refused(
        checkpoint: Checkpoint, tmp_path: Path) -> None:
    """The resolve answer names the file's sha256 (`X-Linked-Etag`): another is refused."""
    with serving("hf", checkpoint.files, tmp_path) as served:
        source = open_served(served)
        obj = shard_of(source)
        served.hub.rewrite(obj.version_id, SHARD, b"x" * obj.size)
        with pytest.raises(SourceChanged) as caught:
            source.read(obj, 0, memoryview(bytearray(100)), ALGORITHM)
    assert str(caught.value).startswith(f"{served.source}{SHARD} at commit {obj.version_id}: "
                                        "the file changed since it was listed (ETag ")


@pytest.mark.parametrize("scheme", SERVED)
@pytest.mark.parametrize("sent", ("none", "wrong"))
def test_wrong_credentials_are_a_clear_error_without_the_secret(
        scheme: str, sent: str, checkpoint: Checkpoint, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    wrong = "wr0ng-secret-never-logged"
    if sent == "wrong":
        monkeypatch.setenv(TOKEN_ENV[scheme], wrong)
    caplog.set_level(logging.DEBUG)
    with serving(scheme, checkpoint.files, tmp_path, token=TOKEN) as served:
        with pytest.raises(SourceError) as caught:
            open_served(served).list(["*"])
    text = f"{caught.value} {caught.value.hint}"
    assert ": access denied (" in str(caught.value)
    assert served.source.split("//")[1].split("/")[0] in str(caught.value)
    assert TOKEN_ENV[scheme] in caught.value.hint
    assert wrong not in text and wrong not in caplog.text and TOKEN not in text


@pytest.mark.parametrize("scheme", SERVED)
def test_the_right_token_is_sent_to_the_source_and_not_past_its_host(
        scheme: str, checkpoint: Checkpoint, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV[scheme], TOKEN)
    with serving(scheme, checkpoint.files, tmp_path, token=TOKEN) as served:
        source = open_served(served)
        obj = shard_of(source)
        data = bytearray(obj.size)
        source.read(obj, 0, memoryview(data), ALGORITHM)
    assert data == checkpoint.files[SHARD]
    if served.hub is not None:  # the LFS bytes came from the storage host, without the token
        assert served.hub.stored.requests["GET"] == 1 and served.hub.leaked_authorization == 0


def test_an_unreadable_share_is_a_clear_error(checkpoint: Checkpoint) -> None:
    """`dlo cache fill` by a process that may not read the share: root without the capabilities
    that let it pass file permissions (another uid could not reach a checkout that lives under a
    private directory); the summary names the source and what to change."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the capabilities that pass file permissions")
    place = Path(tempfile.mkdtemp(prefix="dlo-share-"))
    try:
        with serving("file", checkpoint.files, place) as served:
            (served.directory / "transformer").chmod(0o000)
            done = subprocess.run(
                ["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable,
                 "-m", "dlo_cli.main", "cache", "fill", "--source", served.source,
                 "--cache-root", str(place / "cache"), "--metrics-port", "0",
                 "--entry-file", str(place / "entry.json"), "--summary-file", ""],
                env=checkout_env(PYTHONDONTWRITEBYTECODE="1"), capture_output=True, text=True,
                timeout=PROCESS_TIMEOUT_S, cwd=place)
            (served.directory / "transformer").chmod(0o700)
    finally:
        shutil.rmtree(place)
    assert done.returncode == 1, done.stderr
    error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert error.startswith(f"listing {served.source}: access denied (PermissionDenied) (hint: ")
    assert "readable" in error


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_empty_listing_names_the_source_and_the_globs(
        scheme: str, checkpoint: Checkpoint, tmp_path: Path) -> None:
    with serving(scheme, checkpoint.files, tmp_path) as served:
        with pytest.raises(SourceError) as caught:
            open_served(served).list(["*.bin"])
    assert str(caught.value) == (f"no object under {served.source} matches "
                                 "loader.include=['*.bin']")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_missing_source_is_not_found(scheme: str, tmp_path: Path) -> None:
    with serving(scheme, {"x/a.json": b"{}"}, tmp_path) as served:
        missing = served.source.replace("tiny", "gone").replace("share", "gone")
        served = Served(scheme, missing, served.endpoint, served.proxy)
        with pytest.raises(SourceError) as caught:
            open_served(served).list(["*"])
    assert "not found" in str(caught.value) and "loader.source" in caught.value.hint


def test_an_https_source_that_cannot_be_reached_names_the_source_setting() -> None:
    """An https:// source has no endpoint setting: its address is the URI itself, so the hint
    names loader.source (it named loader.endpoint_url, which does not apply)."""
    source = f"https://127.0.0.1:{free_port()}/models/tiny/"
    with pytest.raises(SourceUnavailable) as caught:
        open_source(parse_source(source), SourceOptions(attempts=2)).list(["*"])
    assert "cannot be reached" in caught.value.hint
    assert "check loader.source," in caught.value.hint
    assert "endpoint_url" not in caught.value.hint


def test_https_without_etags_reads_by_the_listed_digest(
        checkpoint: Checkpoint, tmp_path: Path) -> None:
    with serving("https", checkpoint.files, tmp_path, etags=False) as served:
        source = open_served(served)
        obj = shard_of(source)
        data = bytearray(obj.size)
        source.read(obj, 0, memoryview(data), ALGORITHM)
    assert obj.etag.startswith("crc64nvme:") and data == checkpoint.files[SHARD]
    assert served.server.served.if_match == 0


def test_a_stale_listing_file_is_named(checkpoint: Checkpoint, tmp_path: Path) -> None:
    with serving("https", checkpoint.files, tmp_path) as served:
        (served.directory / SHARD).write_bytes(checkpoint.files[SHARD] + b"more")
        with pytest.raises(SourceError) as caught:
            open_served(served).list(["*.safetensors"])
    size = len(checkpoint.files[SHARD])
    assert str(caught.value) == (f"{served.source}{SHARD}: the server has {size + 4} bytes, "
                                 f"the listing says {size}")
    assert caught.value.hint == "write dlo-listing.json again"


def test_a_server_that_ignores_ranges_serves_whole_files_only(
        checkpoint: Checkpoint, tmp_path: Path) -> None:
    config = "transformer/config.json"
    with serving("https", checkpoint.files, tmp_path, ranges=False) as served:
        source = open_served(served)
        small = next(o for o in source.list(["*.json"]) if o.key == config)
        whole = bytearray(small.size)
        source.read(small, 0, memoryview(whole), ALGORITHM)  # a file in one read: taken
        obj = shard_of(source)
        with pytest.raises(SourceError) as caught:
            source.read(obj, 0, memoryview(bytearray(100)), ALGORITHM)
    assert whole == checkpoint.files[config]
    assert str(caught.value) == (f"{served.source}{SHARD}: the server answered a range with "
                                 "the whole file (status 200)")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_git_blob_id_is_the_one_git_gives(tmp_path: Path) -> None:
    """The Hub names a file stored in git by its blob id; the fill checks it as git computes
    it (not only as the Hub stand-in does)."""
    path = tmp_path / "config.json"
    path.write_bytes(b'{"num_layers": 10}\n')
    expected = subprocess.run(["git", "hash-object", str(path)], capture_output=True,
                              text=True, check=True).stdout.strip()
    assert file_hash(path, "git-sha1") == expected


def test_reads_stop_retrying_when_the_fill_stops(checkpoint: Checkpoint, tmp_path: Path) -> None:
    stop = threading.Event()
    with serving("https", checkpoint.files, tmp_path,
                 plan=FaultPlan(kinds=("internal",))) as served:
        source = open_served(served, attempts=50, stop=stop)
        obj = shard_of(source)
        stop.set()
        with pytest.raises(SourceUnavailable):
            source.read(obj, 0, memoryview(bytearray(100)), ALGORITHM)
    assert served.proxy.object_requests == 1
