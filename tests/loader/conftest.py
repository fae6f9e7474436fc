"""Fixtures for the loader tests: one moto S3 server per session and a tiny checkpoint in it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dlo_bench.s3server import DUMMY_CREDENTIALS, S3Server, start_moto, upload_tree
from support.loader_fleet import BUCKET, Checkpoint, write_checkpoint


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

