"""One checkpoint served by each scheme's real local server, for the source tests.

`serving(scheme, files, tmp)` writes `files` (relative name -> bytes) where the scheme reads
them and yields a `Served`: the source URI, the endpoint a loader is given (`--endpoint-url`),
the `FaultProxy` in front of the object bytes (a `FaultPlan` turns reads into failures) and the
bytes served. `file`: a directory (no server, no proxy). `https`: `range_server.DirectoryServer`
with a listing file, behind the proxy. `hf`: `hub_server.HubServer`, its LFS storage host
behind the proxy (files in git are answered by the Hub itself). Test support only.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dlo_bench.faultproxy import FaultPlan, FaultProxy
from dlo_loader.sources.listing_file import LISTING_FILE, listing_of
from support.hub_server import HubServer
from support.range_server import DirectoryServer

SCHEMES = ("file", "https", "hf")
"""The schemes served here (gs and az have their emulators' own fixtures)."""
HUB_REPO = "dlo-tests/tiny"
TOKEN = "t0ken-never-logged"


@dataclass
class Served:
    scheme: str
    source: str
    endpoint: str | None
    proxy: FaultProxy | None
    directory: Path | None = None
    """Where the files lie (file, https): a test may replace one."""
    hub: HubServer | None = None
    server: DirectoryServer | None = None

    @property
    def object_bytes(self) -> int | None:
        """Object bytes the scheme's servers sent (None for a directory: nothing counts)."""
        if self.proxy is None:
            return None
        return self.proxy.object_bytes + (self.hub.served.object_bytes if self.hub else 0)


def write_files(directory: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return directory


@contextlib.contextmanager
def serving(scheme: str, files: dict[str, bytes], tmp: Path, *,
            plan: FaultPlan | None = None, token: str | None = None,
            etags: bool = True, ranges: bool = True,
            digests: tuple[str, ...] | None = None) -> Iterator[Served]:
    """`files` served by `scheme`'s server (see the module docstring); `token`: the bearer
    token the server requires (https, hf); `etags`, `ranges`: off for an https server without
    ETags, or one that ignores `Range`; `digests`: the only digests its listing file names."""
    if scheme == "file":
        directory = write_files(tmp / "share", files)
        yield Served(scheme, f"file://{directory}/", None, None, directory)
    elif scheme == "https":
        directory = write_files(tmp / "www" / "models" / "tiny", files)
        listing = listing_of(directory)
        for row in listing["files"]:  # only the digests asked for (None: all listing_of writes)
            for algorithm in set(row) - {"name", "size", *(digests or row)}:
                del row[algorithm]
        (directory / LISTING_FILE).write_text(json.dumps(listing))
        with DirectoryServer(tmp / "www", token=token, etags=etags, ranges=ranges) as server, \
                FaultProxy(server.url, plan) as proxy:
            yield Served(scheme, f"{proxy.url}/models/tiny/", None, proxy, directory,
                         server=server)
    elif scheme == "hf":
        with HubServer(HUB_REPO, files, token=token) as hub, \
                FaultProxy(hub.storage_url, plan) as proxy:
            hub.cdn_url = proxy.url
            yield Served(scheme, f"hf://{HUB_REPO}/", hub.url, proxy, hub=hub)
    else:
        raise ValueError(f"no local server for scheme {scheme!r}")
