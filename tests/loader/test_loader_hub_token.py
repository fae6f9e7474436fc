"""The Hub token stays with the Hub: an `hf://` source whose files redirect to a storage host on
another port reads every piece of a file, with 1 to 8 readers at once, and the storage host never
sees an `Authorization` header (neither behind the redirect nor at the signed URL the reader
saved and asks directly for the file's next pieces)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from dlo_loader.digest import ALGORITHM
from dlo_loader.sources import SourceOptions, open_source, parse_source
from dlo_contract.source_credentials import HF_TOKEN_ENV
from support.scheme_servers import TOKEN, serving

NAME = "transformer/weights.safetensors"
PIECES = 16
PIECE_BYTES = 4096


@pytest.mark.parametrize("readers", (1, 3, 8))
def test_no_request_past_the_hub_carries_its_token(
        readers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HF_TOKEN_ENV, TOKEN)
    files = {NAME: os.urandom(PIECES * PIECE_BYTES)}
    with serving("hf", files, tmp_path, token=TOKEN) as served:
        assert served.hub is not None
        source = open_source(parse_source(served.source), SourceOptions(
            readers=readers, attempts=1, endpoint_url=served.endpoint))
        obj, = source.list(["*.safetensors"])
        data = bytearray(obj.size)

        def read(piece: int) -> None:
            start = piece * PIECE_BYTES
            source.read(obj, start, memoryview(data)[start:start + PIECE_BYTES], ALGORITHM)

        with ThreadPoolExecutor(max_workers=readers) as pool:
            list(pool.map(read, range(PIECES)))
        source.close()
        stored, leaked = served.hub.stored.requests["GET"], served.hub.leaked_authorization
    assert data == files[NAME]
    assert stored == PIECES  # every piece came from the storage host
    assert leaked == 0
