"""The listing file of an `https://` source: the names, sizes and digests of a directory's files.

A plain web server or CDN lists nothing, so the directory carries `LISTING_FILE`, a JSON
document `{"files": [{"name": "transformer/model.safetensors", "size": 123, "crc64nvme":
"<hex>", "sha256": "<hex>"}, ...]}`: `name` relative to the directory (`/`-separated), `size` in
bytes, and any of the digests `DIGESTS` in lowercase hex. A CRC (`crc64nvme`, `crc32c`,
`crc32`) becomes the file's chunk digest and is checked combined from the chunks; else a
`sha256` (or `md5`) is checked against the written file (`digest.FILE_HASHES`). Owns the
format: `parse` (what the loader reads, each problem named) and `listing_of` (what a publisher
writes, `python -m dlo_loader.sources.listing_file DIR > DIR/dlo-listing.json`). Pure but for
`listing_of`, which reads the files it lists.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlo_contract.cache import CRC_ALGORITHMS, crc_function, crc_hex
from dlo_contract.cache.manifest import DIGEST_HEX_DIGITS

LISTING_FILE = "dlo-listing.json"
"""The listing's name in the source's directory."""
DIGESTS = (*CRC_ALGORITHMS, "sha256", "md5")
"""The digests a listed file may carry, the first present of them checked."""
_HEX_DIGITS = {**DIGEST_HEX_DIGITS, "md5": 32}
_PIECE_BYTES = 8 << 20


@dataclass(frozen=True)
class ListedFile:
    """One file of a listing; `digests` by algorithm (hex)."""

    name: str
    size: int
    digests: dict[str, str]

    @property
    def checked(self) -> tuple[str, str] | None:
        """The digest the fill checks, `(algorithm, hex)`: the first of `DIGESTS` present."""
        return next(((a, self.digests[a]) for a in DIGESTS if a in self.digests), None)


def parse(text: bytes, where: str) -> list[ListedFile]:
    """The files of a listing document; a malformed one is a `ValueError` saying what and
    where (`where`: the listing's URL)."""
    try:
        document = json.loads(text)
        rows = document["files"]
        if not isinstance(rows, list):
            raise TypeError("files is not a list")
        return [_file(row) for row in rows]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where} is not a listing file ({type(exc).__name__}: {exc}); "
                         f"expected {{\"files\": [{{\"name\", \"size\", and any of "
                         f"{', '.join(DIGESTS)}}}]}}") from None


def _file(row: Any) -> ListedFile:
    name, size = row["name"], row["size"]
    if not isinstance(name, str) or not isinstance(size, int) or size < 0:
        raise TypeError(f"name {name!r} and size {size!r}: expected a string and bytes >= 0")
    digests = {a: str(row[a]).lower() for a in DIGESTS if a in row}
    for algorithm, value in digests.items():
        if len(value) != _HEX_DIGITS[algorithm] or set(value) - set("0123456789abcdef"):
            raise ValueError(f"{name}: {algorithm} {value!r} is not {_HEX_DIGITS[algorithm]} "
                             "hex digits")
    return ListedFile(name, size, digests)


def listing_of(directory: Path) -> dict[str, Any]:
    """The listing document of every file under `directory` (but the listing itself), each
    with its CRC64-NVME and SHA-256."""
    files = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if name == LISTING_FILE:
            continue
        crc, sha = 0, hashlib.sha256()
        extend = crc_function("crc64nvme")
        with open(path, "rb") as handle:
            while piece := handle.read(_PIECE_BYTES):
                crc, _ = extend(piece, crc), sha.update(piece)
        files.append({"name": name, "size": os.path.getsize(path),
                      "crc64nvme": crc_hex(crc, "crc64nvme"), "sha256": sha.hexdigest()})
    return {"files": files}


if __name__ == "__main__":
    print(json.dumps(listing_of(Path(sys.argv[1])), indent=1))
