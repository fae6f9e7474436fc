"""The listing's HEADs go out together, however few readers the loader has."""

from __future__ import annotations

import threading
from typing import Any

from dlo_loader.source import LISTING_HEADS, ObjectStore
from dlo_loader.sources import parse_source

_OBJECTS = 10


class _HeadsTogether:
    """A client whose listing names `_OBJECTS` large objects without their checksums (as
    ministack does), and whose HEADs each wait until all of them have arrived."""

    def __init__(self) -> None:
        self.together = threading.Barrier(_OBJECTS, timeout=10)

    def get_paginator(self, _name: str) -> Any:
        contents = [{"Key": f"m/shard-{n}.safetensors", "Size": 4 << 20, "ETag": f'"{n:032x}"'}
                    for n in range(_OBJECTS)]
        return type("Pages", (), {"paginate": lambda self, **_: [{"Contents": contents}]})()

    def head_object(self, **_: Any) -> dict[str, Any]:
        self.together.wait()  # a HEAD sent in a later wave than the others breaks the barrier
        return {"ChecksumCRC32": "AAAAAA==", "ChecksumType": "FULL_OBJECT"}


def test_a_loader_of_one_reader_sends_the_listing_heads_at_once() -> None:
    assert LISTING_HEADS >= _OBJECTS
    store = ObjectStore(parse_source("s3://bucket/m/"), endpoint_url="http://127.0.0.1:9",
                        region="us-east-1", path_style=True, readers=1, attempts=1)
    client = _HeadsTogether()
    store._listing._client = client
    try:
        files = store.list(["*"], checked_bytes=1 << 20)
    finally:
        store.close()
    assert len(files) == _OBJECTS and not client.together.broken
    assert store.chunk_algorithms[files[0].key] == "crc32"
