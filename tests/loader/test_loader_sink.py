"""The sink: every chunk lands at its offset, whether the write can go direct (aligned chunk,
aligned buffer) or must go through the page cache (a file's tail, unaligned chunk sizes, or a
buffer the device cannot read from)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from dlo_loader.errors import LoaderError
from dlo_loader.plan import build_plan
from dlo_loader.digest import ALGORITHM, chunk_digest
from dlo_loader.sink import ALIGN, EntryChunks, FileSink
from dlo_contract.cache import ObjectIdentity


def content(size: int, seed: int) -> bytes:
    return bytes((seed + i * 7) % 251 for i in range(size))


FILES = {"big.safetensors": 6 * ALIGN + 123, "small.json": ALIGN - 1, "empty.json": 0}


def aligned_buffer(data: bytes) -> memoryview:
    buffer = mmap.mmap(-1, max(len(data), 1))
    buffer[:len(data)] = data
    return memoryview(buffer)[:len(data)]


def unaligned_buffer(data: bytes) -> memoryview:
    return memoryview(bytearray(b"\0" + data))[1:]  # one byte off any alignment


@pytest.mark.parametrize("chunk_bytes", [2 * ALIGN, 5000])
@pytest.mark.parametrize("make_buffer", [aligned_buffer, unaligned_buffer])
def test_every_chunk_lands_at_its_offset(
    chunk_bytes: int, make_buffer: Callable[[bytes], memoryview], tmp_path: Path
) -> None:
    objects = [ObjectIdentity(name, size, "e") for name, size in FILES.items()]
    expected = {name: content(size, seed) for seed, (name, size) in enumerate(FILES.items())}
    plan = build_plan(objects, mode="independent", world_size=1, chunk_bytes=chunk_bytes)
    sink = FileSink(tmp_path, plan.files)
    for chunk in reversed(plan.chunks):  # any order: writes are positioned
        data = expected[plan.files[chunk.file].key]
        sink.write(chunk, make_buffer(data[chunk.offset:chunk.offset + chunk.length]))
    assert {name: (tmp_path / name).read_bytes() for name in FILES} == expected
    assert set(os.listdir(tmp_path)) == set(FILES)


def test_entry_chunks_read_ranges_and_name_a_short_file(tmp_path: Path) -> None:
    data = content(10_000, 3)
    (tmp_path / "big.safetensors").write_bytes(data)
    entry = EntryChunks(tmp_path, [ObjectIdentity("big.safetensors", 20_000, "e")], [ALGORITHM])
    into = bytearray(4000)
    crc = entry.read(0, 5000, memoryview(into))
    assert into == data[5000:9000]
    assert f"{crc:016x}" == chunk_digest(data[5000:9000], ALGORITHM)
    with pytest.raises(LoaderError) as caught:
        entry.read(0, 8000, memoryview(into))
    assert str(caught.value) == (
        f"cached file {tmp_path / 'big.safetensors'} is shorter than its manifest says (read "
        "2000 of 4000 bytes at offset 8000)")
