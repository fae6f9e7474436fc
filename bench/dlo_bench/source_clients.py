"""How the official GCS and Azure Blob clients read a range into a caller's buffer, against
their emulators on loopback: the clients' own ranged downloads, and one ranged GET through the
client's own authorized session (or signing pipeline) read straight into the buffer, as the
loader's `gs` and `az` readers do (see [Note: client downloads] in
`dlo_loader.sources.sessions`).

`python -m dlo_bench.source_clients [--mib N] [--repeat R]` writes one object of N MiB to each
emulator, reads it whole R times each way, and prints per way the throughput and the reading
process's CPU-seconds per GiB, then one JSON line. Figures depend on the machine; the ratio of
CPU per GiB is what the choice rests on. Not imported by the loader.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import time
from collections.abc import Callable
from typing import Any

from dlo_bench.emulators import azurite_connection_string, gcs_client, start_azurite, start_fake_gcs

_PIECE_BYTES = 2 << 20


class _IntoBuffer(io.RawIOBase):
    """A file object writing into a memoryview, for the clients' `download_to_file`/`readinto`."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.at = view, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        count = len(data)
        self.view[self.at:self.at + count] = data
        self.at += count
        return count


def _read_raw(response: Any, view: memoryview) -> None:
    """A `requests` response's body straight into `view` (the loader's one-copy read)."""
    source, got = response.raw._fp, 0
    while got < len(view):
        count = source.readinto(view[got:got + _PIECE_BYTES])
        if not count:
            break
        got += count
    response.close()
    assert got == len(view), f"read {got} of {len(view)} bytes"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _gcs_ways(server: str, data: bytes) -> dict[str, Callable[[memoryview], None]]:
    client = gcs_client(server)
    client.create_bucket("bench")
    blob = client.bucket("bench").blob("object.bin")
    blob.upload_from_string(data)
    blob.reload()
    url = (f"{client.api_endpoint}/download/storage/v1/b/bench/o/object.bin?alt=media"
           f"&ifGenerationMatch={blob.generation}")
    end = len(data) - 1
    return {
        "gcs client download_to_file": lambda view: blob.download_to_file(
            _IntoBuffer(view), start=0, end=end, checksum=None, raw_download=True),
        "gcs session GET into buffer": lambda view: _read_raw(client._http.get(
            url, headers={"Range": f"bytes=0-{end}"}, stream=True), view),
    }


def _azure_ways(server: str, data: bytes) -> dict[str, Callable[[memoryview], None]]:
    from azure.core import MatchConditions
    from azure.core.rest import HttpRequest
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient.from_connection_string(azurite_connection_string(server))
    container = service.get_container_client("bench")
    container.create_container()
    blob = container.get_blob_client("object.bin")
    blob.upload_blob(data)
    etag, end = blob.get_blob_properties().etag, len(data) - 1

    def raw(view: memoryview) -> None:
        request = HttpRequest("GET", blob.url, headers={
            "x-ms-range": f"bytes=0-{end}", "If-Match": etag, "x-ms-version": blob.api_version})
        _read_raw(blob._pipeline.run(request, stream=True).http_response.internal_response,
                  view)

    return {
        "azure client download_blob readinto": lambda view: blob.download_blob(
            offset=0, length=len(data), etag=etag, match_condition=MatchConditions.IfNotModified,
            max_concurrency=1).readinto(_IntoBuffer(view)),
        "azure pipeline GET into buffer": raw,
    }


def measure(mib: int, repeat: int) -> dict[str, dict[str, float]]:
    """Per way: the best throughput (MB/s) and the least CPU-seconds per GiB of `repeat`."""
    data = os.urandom(mib << 20)
    view = memoryview(bytearray(len(data)))
    results: dict[str, dict[str, float]] = {}
    with start_fake_gcs() as gcs, start_azurite() as azurite:
        ways = _gcs_ways(gcs.server_url, data) | _azure_ways(azurite.server_url, data)
        for _ in range(repeat):
            for name, read in ways.items():
                view[:8] = b"\0" * 8
                wall, cpu = time.perf_counter(), _cpu_s()
                read(view)
                wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
                assert view[:1 << 20] == data[:1 << 20], f"{name} read other bytes"
                best = results.setdefault(name, {"mb_per_s": 0.0, "cpu_s_per_gib": 1e9})
                best["mb_per_s"] = round(max(best["mb_per_s"], len(data) / wall / 1e6))
                best["cpu_s_per_gib"] = round(min(best["cpu_s_per_gib"],
                                                  cpu / (len(data) / 2**30)), 2)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    results = measure(args.mib, args.repeat)
    for name, figures in results.items():
        print(f"{name:40s} {figures['mb_per_s']:6.0f} MB/s  "
              f"{figures['cpu_s_per_gib']:.2f} CPU-s/GiB")
    print(json.dumps({"object_mib": args.mib, "repeat": args.repeat, "ways": results}))


if __name__ == "__main__":
    main()
