"""The `gs://` and `az://` sources of the loader tests: an emulator per scheme (started once per
session by the fixtures in `tests/loader/conftest.py`) and how a loader reaches it.

A `CloudStore` says a source URI of its emulator, the loader's endpoint through a proxy (each
rank's own counting, fault-injecting `FaultProxy`), and the credentials environment: the GCS
emulator variable (the client then sends no credentials) or Azurite's published account key.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo_bench.emulators import AZURITE_ACCOUNT, AZURITE_KEY, GCS_EMULATOR_ENV, Emulator
from dlo_contract.source_credentials import AZURE_ACCOUNT_KEY_ENV

CONTAINER = "models"
"""The bucket (GCS) or container (Azure) of every test checkpoint."""


@dataclass(frozen=True)
class CloudStore:
    scheme: str
    """`gs` or `az`."""
    emulator: Emulator

    def source(self, prefix: str) -> str:
        """The source URI of `prefix` (no slashes around it) in the test container."""
        if self.scheme == "az":
            return f"az://{AZURITE_ACCOUNT}/{CONTAINER}/{prefix}/"
        return f"gs://{CONTAINER}/{prefix}/"

    def endpoint(self, via: str | None = None) -> str:
        """The loader's `endpoint_url` for this store, through `via` (a proxy's URL) if given."""
        server = via or self.emulator.server_url
        return f"{server}/{AZURITE_ACCOUNT}" if self.scheme == "az" else server

    def env(self) -> dict[str, str]:
        """The credentials environment of a loader reading this store."""
        if self.scheme == "az":
            return {AZURE_ACCOUNT_KEY_ENV: AZURITE_KEY}
        return {GCS_EMULATOR_ENV: self.emulator.server_url}

    def put(self, prefix: str, files: dict[str, bytes]) -> str:
        """Write `files` (relative key -> bytes) under `prefix`; returns the source URI."""
        self.emulator.put(CONTAINER, files, f"{prefix}/")
        return self.source(prefix)
