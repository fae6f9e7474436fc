"""`dlo bench loader --schemes s3,file,gs,az,https,hf`: one checkpoint through each scheme's
local server in one run, the fill against that server's own parallel-GET ceiling.

Owns the per-scheme rows of the loader benchmark. Every scheme serves the same synthetic
checkpoint (`loader_runs.write_checkpoint`) from the server its tests use: ministack for `s3`, the
directory itself for `file` (the page cache: the ceiling is `pread`), fake-gcs-server for `gs`
and Azurite for `az` (`emulators`), and for `https` and `hf` the loopback servers of the source
tests (`tests/support`: `range_server.DirectoryServer` with a listing file, `hub_server.HubServer`),
run in a child process of their own so that they share no interpreter lock with the fill. The
ceiling is what this process pulls from the same server with the same number of concurrent ranged
GETs of the same chunk size, discarding the bytes (urllib3; S3's through botocore, as
`loader.measure` does; hf's at the storage URL each file's resolve URL redirects to, as the hf
reader reads after its first range); the fill is `dlo cache fill`'s code path (one rank); both
are timed by `loader_runs`, as the S3 report's are. Correctness first (the published files equal
the source), one warm-up, then ceiling and fill runs interleaved. A Python server (https, hf)
caps both at what it sends: its ratio says how much of that the fill gets, not what the scheme
reaches against a real server. Must not be imported by the planes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlo_contract.cache import sha256_file
from dlo_contract.settings import CacheConfig, LoaderConfig, Settings
from dlo_loader.fill import FillRequest, fill

from dlo_bench import provenance
from dlo_bench.emulators import AZURITE_ACCOUNT, AZURITE_KEY, start_azurite, start_fake_gcs
from dlo_bench.loader import s3_get
from dlo_bench.loader_runs import (MIB, Clock, Get, ceiling_run, measure_disk, timed_fill,
                                     write_checkpoint)
from dlo_bench.s3server import DUMMY_CREDENTIALS, start_ministack, upload_tree

SCHEMES = ("s3", "file", "gs", "az", "https", "hf")
BUCKET, PREFIX, HUB_REPO = "bench", "ckpt", "bench/ckpt"
TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"
"""Where `support.range_server` and `support.hub_server` live (the https and hf servers)."""


@dataclass
class Stand:
    """One scheme's server holding the checkpoint: the fill's source and endpoint, the
    environment its reader reads, and the ceiling's ranged GET of (file, start, length)."""

    scheme: str
    server: str
    source: str
    get: Get
    endpoint_url: str | None = None
    path_style: bool = False
    env: dict[str, str] = field(default_factory=dict)


def run_schemes(args: argparse.Namespace, schemes: list[str], work: Path) -> dict[str, Any]:
    source = work / "source"
    digests = write_checkpoint(source, args.size_mib * MIB, args.files)
    sizes = {name: (source / name).stat().st_size for name in digests}
    total = sum(sizes.values())
    disk = total / statistics.median(
        measure_disk(work / "disk", total, args.chunk_bytes, Clock())
        for _ in range(args.repeats))
    rows = []
    for scheme in schemes:
        with _stand(scheme, args, source) as stand, _environment(stand.env):
            row = _measure(args, stand, work / f"cache-{scheme}", digests, sizes)
        bound = min(row["ceiling_bytes_per_s"], disk)
        rows.append(row | {"fill_to_bound_ratio": round(row["fill_bytes_per_s"] / bound, 4)})
    entries = {row["entry_id"] for row in rows}
    return {
        "benchmark": "loader-schemes",
        "commit": provenance.commit(),
        "machine": provenance.machine(),
        "parameters": {"bytes": total, "files": args.files,
                       "chunk_bytes": args.chunk_bytes, "readers": args.readers,
                       "repeats": args.repeats, "world_size": 1},
        "correct": all(row["correct"] for row in rows),
        "same_entry_id": len(entries) == 1,
        "same_entry_id_note": "whether every scheme's fill of the same bytes published the same "
                              "cache entry id (each row's files are checked against the "
                              "source's digests in `correct`)",
        "disk_write_bytes_per_s": round(disk),
        "fill_to_bound_ratio_note": "each row's fill over the slower of its ceiling and the disk "
                                    "(writing and fsyncing the same bytes where the cache goes)",
        "schemes": rows,
    }


def _measure(args: argparse.Namespace, stand: Stand, root: Path, digests: dict[str, str],
             sizes: dict[str, int]) -> dict[str, Any]:
    settings = Settings(loader=LoaderConfig(
        source=stand.source, endpoint_url=stand.endpoint_url, path_style=stand.path_style,
        chunk_bytes=args.chunk_bytes, readers=args.readers), cache=CacheConfig(root=str(root)))
    result = fill(FillRequest(settings=settings))
    published = {name: sha256_file(Path(result.path) / name) for name in digests}
    shutil.rmtree(root)
    ranges = [(name, start, min(args.chunk_bytes, size - start))
              for name, size in sizes.items() for start in range(0, size, args.chunk_bytes)]
    total = sum(sizes.values())
    _ceiling(stand, ranges, args.readers)  # warm-up: connections, server caches
    ceiling_s, fill_s = [], []
    clock = Clock()
    for _ in range(args.repeats):
        ceiling_s.append(_ceiling(stand, ranges, args.readers))
        timed_fill(settings, clock)
        fill_s.append(clock.seconds)
    ceiling, filled = total / statistics.median(ceiling_s), total / statistics.median(fill_s)
    return {"scheme": stand.scheme, "server": stand.server, "correct": published == digests,
            "store_checksums": result.summary().store_checksums, "entry_id": result.entry_id,
            "ceiling_seconds": [round(s, 4) for s in ceiling_s],
            "fill_seconds": [round(s, 4) for s in fill_s],
            "ceiling_bytes_per_s": round(ceiling), "fill_bytes_per_s": round(filled),
            "fill_to_ceiling_ratio": round(filled / ceiling, 4)}


def _ceiling(stand: Stand, ranges: list[tuple[str, int, int]], readers: int) -> float:
    return ceiling_run(lambda: stand.get, ranges, readers, Clock(), f"{stand.scheme} ceiling")


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """The fill runs in this process: its reader reads `env` from it, for this scheme only."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _http_get(readers: int, url_of: Callable[[str], str],
              headers: dict[str, str] | None = None) -> Get:
    """A ranged GET of `url_of(name)` through one pool of `readers` connections, each body
    read a MiB at a time and dropped (redirects followed, as the hf reader does)."""
    import urllib3

    pool = urllib3.PoolManager(maxsize=readers, block=True)

    def get(name: str, start: int, length: int) -> int:
        response = pool.request("GET", url_of(name), preload_content=False, headers={
            **(headers or {}), "Range": f"bytes={start}-{start + length - 1}"})
        got = 0
        try:
            while piece := response.read(MIB):
                got += len(piece)
        finally:
            response.release_conn()
        return got

    return get


def _pread_get(directory: Path) -> Get:
    def get(name: str, start: int, length: int) -> int:
        with open(directory / name, "rb", buffering=0) as handle:
            return len(os.pread(handle.fileno(), length, start))

    return get


@contextlib.contextmanager
def _stand(scheme: str, args: argparse.Namespace, source: Path) -> Iterator[Stand]:
    files = {path.name: path.read_bytes() for path in sorted(source.iterdir())}
    quoted: Callable[[str], str] = lambda name: urllib.parse.quote(f"{PREFIX}/{name}", safe="")
    if scheme == "file":
        yield Stand(scheme, "directory", f"file://{source}/", _pread_get(source))
    elif scheme == "s3":
        with start_ministack(args.ministack) as server:
            upload_tree(server, BUCKET, PREFIX, source)
            get = s3_get(server, args.readers)
            yield Stand(scheme, server.name, f"s3://{BUCKET}/{PREFIX}/",
                        lambda name, start, length: get(f"{PREFIX}/{name}", start, length),
                        server.endpoint_url, path_style=True, env=dict(DUMMY_CREDENTIALS))
    elif scheme == "gs":
        with start_fake_gcs() as server:
            server.put(BUCKET, files, f"{PREFIX}/")
            get = _http_get(args.readers, lambda name: (
                f"{server.server_url}/download/storage/v1/b/{BUCKET}/o/{quoted(name)}"
                "?alt=media"))
            yield Stand(scheme, server.name, f"gs://{BUCKET}/{PREFIX}/", get,
                        server.endpoint_url, env=server.loader_env())
    elif scheme == "az":
        with start_azurite() as server:
            server.put(BUCKET, files, f"{PREFIX}/")
            get = _http_get(args.readers, lambda name: (
                f"{server.endpoint_url}/{BUCKET}/{PREFIX}/{name}?{_azurite_sas()}"))
            yield Stand(scheme, server.name, f"az://{AZURITE_ACCOUNT}/{BUCKET}/{PREFIX}/", get,
                        server.endpoint_url, env=server.loader_env())
    else:
        with _child_server(scheme, source) as urls:
            if scheme == "https":
                get = _http_get(args.readers, lambda name: f"{urls['url']}/{name}")
                yield Stand(scheme, "range_server (Python)", f"{urls['url']}/", get)
            else:
                stored = _redirects(urls["url"], {
                    name: f"{HUB_REPO}/resolve/main/{name}" for name in files})
                get = _http_get(args.readers, stored.__getitem__)
                yield Stand(scheme, "hub_server (Python)", f"hf://{HUB_REPO}/", get, urls["url"])


def _redirects(server: str, paths: dict[str, str]) -> dict[str, str]:
    """By file, where its resolve URL redirects (the Hub's storage): the ceiling's GETs go
    there, as the hf reader's do after its first read of a file."""
    import urllib3

    pool = urllib3.PoolManager()
    located = {}
    for name, path in paths.items():
        answer = pool.request("HEAD", f"{server}/{path}", redirect=False)
        located[name] = urllib.parse.urljoin(f"{server}/{path}", answer.headers["Location"])
    return located


def _azurite_sas() -> str:
    """A read SAS for the bench container, signed with Azurite's published key."""
    import datetime

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    return generate_container_sas(
        AZURITE_ACCOUNT, BUCKET, account_key=AZURITE_KEY,
        permission=ContainerSasPermissions(read=True),
        expiry=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=2))


@contextlib.contextmanager
def _child_server(scheme: str, source: Path) -> Iterator[dict[str, str]]:
    """The https or hf test server over `source`, in a child process (`serve`): its URLs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, (str(TESTS_DIR), os.environ.get("PYTHONPATH"))))}
    with subprocess.Popen([sys.executable, "-m", "dlo_bench.loader_schemes", scheme, str(source)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"the {scheme} server did not start (exit {child.wait()})")
            yield json.loads(line)
        finally:
            child.stdin.close()  # the child serves until its stdin ends
            child.wait(timeout=30)


def serve(scheme: str, source: Path) -> None:
    """In the child: serve `source` until stdin ends, after printing its URL as a JSON line;
    https serves links to its files beside their listing file (`source` stays as written)."""
    from dlo_loader.sources.listing_file import LISTING_FILE, listing_of
    from support.hub_server import HubServer
    from support.range_server import DirectoryServer

    server: Any
    if scheme == "https":
        root = source.parent / "www"
        root.mkdir(exist_ok=True)
        for path in source.iterdir():
            os.link(path, root / path.name)
        (root / LISTING_FILE).write_text(json.dumps(listing_of(root)))
        server = DirectoryServer(root)
    else:
        server = HubServer(HUB_REPO, {path.name: path.read_bytes()
                                      for path in sorted(source.iterdir())})
    with server:
        print(json.dumps({"url": server.url}), flush=True)
        sys.stdin.read()


def print_report(report: dict[str, Any]) -> None:
    print(f"correct: {report['correct']}; the same entry id from every scheme: "
          f"{report['same_entry_id']}")
    for row in report["schemes"]:
        print(f"{row['scheme']:>6} ({row['server']}): ceiling "
              f"{row['ceiling_bytes_per_s'] / 1e9:.3f} GB/s, fill "
              f"{row['fill_bytes_per_s'] / 1e9:.3f} GB/s, fill/ceiling "
              f"{row['fill_to_ceiling_ratio']:.3f} (to the slower of it and the disk "
              f"{row['fill_to_bound_ratio']:.3f}); store checksums: {row['store_checksums']}")
    print(f"disk write+fsync where the cache goes: {report['disk_write_bytes_per_s'] / 1e9:.3f} "
          "GB/s")


if __name__ == "__main__":
    serve(sys.argv[1], Path(sys.argv[2]))
