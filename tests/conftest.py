"""Suite-wide fixtures: every test runs with the project's packages importable from the tree."""

from __future__ import annotations

import os

import pytest

from dlo_contract import names


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A settings document or AWS profile on the test machine must not leak into a test."""
    for name in (names.CONFIG_ENV, names.ENTRY_FILE_ENV, "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
