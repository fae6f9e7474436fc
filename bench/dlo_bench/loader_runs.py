"""The measured runs both loader benchmarks make, whatever serves the checkpoint.

Owns the synthetic checkpoint (`write_checkpoint`: valid safetensors files of random bytes), the
ceiling run (`ceiling`: every range fetched by `readers` threads, the bytes dropped), the disk
probe (`measure_disk`: the same bytes written and fsynced where the cache goes, through the
loader's own sink), one timed fill (`timed_fill`) and `settle_disk` between runs. Each run is
timed by a meter (`Clock` for wall seconds; `loader` passes one that also counts CPU). Called by
`dlo_bench.loader` (the one S3 report) and `dlo_bench.loader_schemes` (a row per scheme); it
starts no server. Must not be imported by the planes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dlo_contract.cache import ObjectIdentity
from dlo_contract.settings import Settings
from dlo_loader.fetch import chunk_buffer
from dlo_loader.fill import FillRequest, FillResult, fill
from dlo_loader.plan import Chunk
from dlo_loader.sink import FileSink

MIB = 1 << 20

Get = Callable[[str, int, int], int]
"""A ranged GET of (name, start, length) whose body is read and dropped; returns its bytes."""


class Clock:
    """Wall seconds over a `with` block."""

    seconds = 0.0

    def __enter__(self) -> Clock:
        self._began = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._began


def write_checkpoint(directory: Path, total: int, files: int) -> dict[str, str]:
    """`files` valid safetensors files of one U8 tensor each, `total` bytes in all, random
    content; returns their SHA-256 digests."""
    directory.mkdir(parents=True, exist_ok=True)
    digests = {}
    for index in range(files):
        header, size = _header_for(total // files)
        name = f"model-{index:05d}-of-{files:05d}.safetensors"
        digest = hashlib.sha256()
        with (directory / name).open("wb") as handle:
            for piece in (struct.pack("<Q", len(header)) + header, *_random(size)):
                handle.write(piece)
                digest.update(piece)
        digests[name] = digest.hexdigest()
    return digests


def _header_for(file_bytes: int) -> tuple[bytes, int]:
    """A padded header and the tensor size that make a file of exactly `file_bytes`."""
    size = file_bytes
    while True:  # the header's length depends on the digits of the size: settle both
        header = json.dumps({"data": {"dtype": "U8", "shape": [size],
                                      "data_offsets": [0, size]}}).encode()
        header += b" " * (-len(header) % 8)  # the format pads headers to 8-byte alignment
        fitted = file_bytes - 8 - len(header)
        if fitted == size:
            return header, size
        size = fitted


def _random(size: int) -> list[bytes]:
    block = 4 * MIB
    noise = os.urandom(block)
    # Each block starts with its offset: a server or cache that deduplicates cannot flatter us.
    return [(struct.pack("<Q", offset) + noise[8:])[:min(block, size - offset)]
            for offset in range(0, size, block)]


def ceiling_run(new_get: Callable[[], Get], ranges: list[tuple[str, int, int]], readers: int,
            meter: Any, label: str) -> float:
    """Seconds to GET every range with `readers` threads, from `new_get()` on (a client made
    inside the run counts, as the fill's own client does); `label` names the run in the error
    when the bytes read fall short."""
    with meter:
        get = new_get()
        with ThreadPoolExecutor(max_workers=readers) as pool:
            got = sum(pool.map(lambda item: get(*item), ranges))
    if got != sum(r[2] for r in ranges):
        raise RuntimeError(f"{label} read {got} bytes, expected {sum(r[2] for r in ranges)}")
    return float(meter.seconds)


def measure_disk(directory: Path, total: int, chunk_bytes: int, meter: Any) -> float:
    """Seconds to write and fsync `total` bytes where the cache goes, chunk by chunk through the
    loader's own sink (direct writes where the filesystem allows): the node's other limit."""
    directory.mkdir(exist_ok=True)
    block = chunk_buffer(chunk_bytes)  # the loader's own kind of buffer
    block.write(os.urandom(chunk_bytes))
    with meter:
        sink = FileSink(directory, [ObjectIdentity("probe", total, "")])
        for number, offset in enumerate(range(0, total, chunk_bytes)):
            length = min(chunk_bytes, total - offset)
            chunk = Chunk(index=number, file=0, number=number, offset=offset, length=length,
                          owner=0)
            sink.write(chunk, memoryview(block)[:length])
        fd = os.open(directory / "probe", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    (directory / "probe").unlink()
    settle_disk()
    return float(meter.seconds)


def timed_fill(settings: Settings, meter: Any) -> FillResult:
    """One complete fill (list, read, hash, write, validate, publish) timed by `meter`; its
    cache root is removed and the removal settled before the next run."""
    with meter:
        result = fill(FillRequest(settings=settings))
    shutil.rmtree(settings.cache.root)
    settle_disk()
    return result


def settle_disk() -> None:
    """After a run deleted what it wrote: commit the deletion before the next run starts. On a
    filesystem mounted with online discard the freed blocks are trimmed at the next journal
    commit, which would otherwise land inside the next measured run (a write-heavy fill after a
    deleted disk probe, a disk probe after a deleted fill) and time the trim as well."""
    os.sync()
