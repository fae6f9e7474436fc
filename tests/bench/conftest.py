"""What the benchmarks' real runs need: ministack (the S3 server of `make
.venv-ministack/.installed`), the cold start's peers (`make .venv-coldstart/.installed`) and, for
the cluster runs, network namespaces and shaped links (root, iproute2). Missing here, a test that needs them skips with the reason; in CI (`CI` set,
as `.ci/run` sets it) it fails instead, since CI installs both and a skipped benchmark run is
how a crash in one went unnoticed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MINISTACK = ROOT / ".venv-ministack" / "bin" / "ministack"
COLDSTART_PYTHON = ROOT / ".venv-coldstart" / "bin" / "python"


def needed(reason: str | None) -> None:
    """Skip with `reason` where something a test needs is missing (fail in CI)."""
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must provide it")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def ministack() -> Path:
    needed(None if MINISTACK.exists() else
           "ministack not installed (make .venv-ministack/.installed)")
    return MINISTACK


@pytest.fixture(scope="session")
def coldstart_python() -> Path:
    needed(None if COLDSTART_PYTHON.exists() else
           "the cold start's peers are not installed (make .venv-coldstart/.installed)")
    return COLDSTART_PYTHON


@pytest.fixture(scope="session")
def namespaces() -> None:
    missing = os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None
    needed("network namespaces need root and iproute2 (ip, tc)" if missing else None)
