"""Fixtures for the loader tests: one moto S3 server per session and a tiny checkpoint in it; the
GCS and Azure Blob emulators, each started once per session by the first test that needs it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from dlo_bench.emulators import Emulator, start_azurite, start_fake_gcs
from dlo_bench.s3server import DUMMY_CREDENTIALS, S3Server, start_moto, upload_tree
from support.cloud_stores import CloudStore
from support.loader_fleet import BUCKET, Checkpoint, write_checkpoint

_CLOUD_PREFIXES = itertools.count()
"""Each `cloud_source` its own prefix: a test may replace or damage its objects."""


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    with start_moto() as server:
        yield server


@pytest.fixture(scope="session")
def checkpoint(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    local = tmp_path_factory.mktemp("checkpoint")
    files = write_checkpoint(local)
    upload_tree(s3, BUCKET, "tiny", local)
    return Checkpoint(source=f"s3://{BUCKET}/tiny", files=files)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy credentials for loaders running in the test process (the standard chain)."""
    for name, value in DUMMY_CREDENTIALS.items():
        monkeypatch.setenv(name, value)



@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[Emulator]:
    with start_fake_gcs() as server:
        yield server


@pytest.fixture(scope="session")
def azurite() -> Iterator[Emulator]:
    with start_azurite() as server:
        yield server


@pytest.fixture(params=["gs", "az"])
def cloud(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> CloudStore:
    """Each cloud scheme's emulator (started once per session), its credentials in the
    environment of the loaders this test runs."""
    return _cloud_store(request.param, request, monkeypatch)


@pytest.fixture
def gs_store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> CloudStore:
    return _cloud_store("gs", request, monkeypatch)


@pytest.fixture
def az_store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> CloudStore:
    return _cloud_store("az", request, monkeypatch)


def _cloud_store(scheme: str, request: pytest.FixtureRequest,
                 monkeypatch: pytest.MonkeyPatch) -> CloudStore:
    emulator = request.getfixturevalue("gcs_emulator" if scheme == "gs" else "azurite")
    store = CloudStore(scheme, emulator)
    for name, value in store.env().items():
        monkeypatch.setenv(name, value)
    return store


@pytest.fixture(scope="session")
def cloud_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The tiny checkpoint's files, as the `gs` and `az` tests write them to their store."""
    return write_checkpoint(tmp_path_factory.mktemp("cloud-checkpoint"))


@pytest.fixture
def cloud_source(cloud: CloudStore, cloud_files: dict[str, bytes]) -> str:
    """A fresh copy of the tiny checkpoint in the test's store, under a prefix of its own."""
    return cloud.put(f"tiny-{next(_CLOUD_PREFIXES)}", cloud_files)
