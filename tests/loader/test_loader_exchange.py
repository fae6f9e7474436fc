"""One exchange's data path: alone, chunks stream to disk through a piece buffer per reader,
each piece on disk before its buffer is read into again, and a failed write fails it; after a
loss, `settle` writes what this rank read."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from dlo_loader.digest import ALGORITHM, chunk_digest, extend
from dlo_loader.exchange import Exchange
from dlo_loader.plan import build_plan
from dlo_loader.progress import Progress
from dlo_loader.sink import FileSink
from dlo_contract.cache import ObjectIdentity
from dlo_contract.settings import LoaderConfig

KIB = 1 << 10
FILES = [ObjectIdentity("a.bin", 70 * KIB + 3, "e"), ObjectIdentity("b.bin", 40 * KIB, "e")]
CONTENT = {index: bytes((index * 7 + n) % 251 for n in range(obj.size))
           for index, obj in enumerate(FILES)}


class CountingReader:
    """Serves `CONTENT` and records every span it is asked for."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()

    def __call__(self, file: int, offset: int, into: memoryview) -> int:
        with self._lock:
            self.spans.append((file, offset, len(into)))
        into[:] = CONTENT[file][offset:offset + len(into)]
        return extend(0, into, ALGORITHM)


def exchange(plan, read, tmp_path: Path, *, grouped: bool) -> Exchange:
    config = LoaderConfig(source="s3://b/p/", readers=2, chunk_bytes=plan.chunk_bytes,
                          memory_limit_bytes=64 * plan.chunk_bytes)
    sink = FileSink(tmp_path, plan.files) if not grouped else None
    return Exchange(plan, rank=1, grouped=grouped, read=read, sink=sink,
                    progress=Progress(total_bytes=plan.total_bytes, emit=None, prefix=""),
                    config=config,
                    deadline=time.monotonic() + 60, stop=threading.Event())


def test_alone_chunks_stream_to_disk_through_one_piece_buffer_per_reader(
        tmp_path: Path, monkeypatch) -> None:
    """Alone, no chunk is held whole: a buffer per chunk in flight (and per chunk queued for a
    slow disk) is fresh memory the kernel zeroes first. Each reader keeps one piece's buffer,
    read into again once the piece is written."""
    from dlo_loader import fetch, sink as sink_module, stream

    made = []

    def counted(size: int):
        made.append(size)
        return original_buffer(size)

    original_buffer, original_write = fetch.chunk_buffer, sink_module.FileSink.write_at

    def slow_write(self, file, offset, data):
        time.sleep(0.002)
        original_write(self, file, offset, data)

    monkeypatch.setattr(stream, "chunk_buffer", counted)
    monkeypatch.setattr(fetch, "chunk_buffer", counted)
    monkeypatch.setattr(sink_module.FileSink, "write_at", slow_write)
    monkeypatch.setattr(stream, "PIECE_BYTES", 4 * KIB)
    big = [ObjectIdentity("big.bin", 48 * 12 * KIB, "e")]
    plan = build_plan(big, mode="independent", world_size=1, chunk_bytes=12 * KIB)

    def read(file: int, offset: int, into: memoryview) -> int:
        into[:] = bytes([offset // KIB % 251]) * len(into)
        return extend(0, into, ALGORITHM)

    digests = exchange(plan, read, tmp_path, grouped=False).run()  # readers=2, 64 buffers allowed

    expected = b"".join(bytes([n % 251]) * 4 * KIB for n in range(0, 48 * 12, 4))
    assert (tmp_path / "big.bin").read_bytes() == expected
    assert digests == [chunk_digest(expected[c.offset:c.offset + c.length], ALGORITHM)
                       for c in plan.chunks]
    assert made == [4 * KIB, 4 * KIB]  # one piece per reader, no chunk buffer


def test_alone_a_piece_is_on_disk_before_its_buffer_is_read_into_again(
        tmp_path: Path, monkeypatch) -> None:
    """A reader has one piece's buffer: the next piece's read must not begin while the last
    piece's write still reads that buffer (the write would put the next piece's bytes on disk
    at the last one's offset). A slow first write shows it: the disk holds every piece."""
    from dlo_loader import sink as sink_module, stream

    monkeypatch.setattr(stream, "PIECE_BYTES", 4 * KIB)
    writing = threading.Event()
    read_during_a_write: list[int] = []
    original_write = sink_module.FileSink.write_at

    def slow_write(self, file, offset, data):
        writing.set()
        time.sleep(0.05 if offset == 0 else 0)
        original_write(self, file, offset, data)
        writing.clear()

    def read(file: int, offset: int, into: memoryview) -> int:
        if writing.is_set():
            read_during_a_write.append(offset)
        into[:] = bytes([offset // KIB]) * len(into)
        return extend(0, into, ALGORITHM)

    monkeypatch.setattr(sink_module.FileSink, "write_at", slow_write)
    one = [ObjectIdentity("one.bin", 16 * KIB, "e")]
    plan = build_plan(one, mode="independent", world_size=1, chunk_bytes=16 * KIB)  # 1 reader

    digests = exchange(plan, read, tmp_path, grouped=False).run()

    expected = b"".join(bytes([n]) * 4 * KIB for n in range(0, 16, 4))
    assert read_during_a_write == []
    assert (tmp_path / "one.bin").read_bytes() == expected
    assert digests == [chunk_digest(expected, ALGORITHM)]


def test_alone_a_failed_write_fails_the_exchange(tmp_path: Path, monkeypatch) -> None:
    """A write runs on the reader's thread, between its reads; its error (a full disk) ends
    the fill, raised as itself, and the reader reads nothing more."""
    import errno

    from dlo_loader import sink as sink_module, stream

    monkeypatch.setattr(stream, "PIECE_BYTES", 4 * KIB)
    original_write = sink_module.FileSink.write_at

    def full_at_the_third_piece(self, file, offset, data):
        if offset >= 8 * KIB:
            raise OSError(errno.ENOSPC, "No space left on device")
        original_write(self, file, offset, data)

    monkeypatch.setattr(sink_module.FileSink, "write_at", full_at_the_third_piece)
    reader = CountingReader()
    big = [ObjectIdentity("a.bin", 64 * KIB, "e")]
    plan = build_plan(big, mode="independent", world_size=1, chunk_bytes=64 * KIB)  # 1 reader

    try:
        exchange(plan, reader, tmp_path, grouped=False).run()
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    else:
        raise AssertionError("the exchange succeeded with a full disk")
    assert len(reader.spans) == 3  # the third piece's write failed: no fourth read


def test_settle_lets_a_read_in_flight_complete_its_chunk_and_writes_it(tmp_path: Path) -> None:
    """After a loss (`Exchange.settle`) the chunk being read is not dropped to be read again:
    no chunk opens any more, the open one completes and is written with those read before."""
    plan = build_plan(FILES, mode="multi-reader", world_size=3, chunk_bytes=16 * KIB)
    owned = plan.owned(1)
    gate, counting = threading.Event(), CountingReader()

    def read(file: int, offset: int, into: memoryview) -> int:
        if (file, offset) == (owned[0].file, owned[0].offset):
            assert gate.wait(30)  # its first chunk is in flight when the loss comes
        return counting(file, offset, into)

    config = LoaderConfig(source="s3://b/p/", readers=2, chunk_bytes=plan.chunk_bytes,
                          memory_limit_bytes=64 * plan.chunk_bytes)
    ended = Exchange(plan, rank=1, grouped=True, read=read, sink=FileSink(tmp_path, plan.files),
                     progress=Progress(total_bytes=plan.total_bytes, emit=None, prefix=""),
                     config=config, deadline=time.monotonic() + 60, stop=threading.Event())
    for position in range(1, len(owned)):
        assert ended._fetcher.wait_ready(30, position) and ended._fetcher.error is None
    held: dict[int, str] = {}
    settling = threading.Thread(target=lambda: held.update(ended.settle()))
    settling.start()
    deadline = time.monotonic() + 30
    while ended._fetcher._opening and time.monotonic() < deadline:  # settle has begun
        time.sleep(0.01)
    gate.set()
    settling.join(30)
    assert sorted(held) == sorted(c.index for c in owned)
    assert sorted(counting.spans) == sorted((c.file, c.offset, c.length) for c in owned)
    for chunk in owned:
        span = slice(chunk.offset, chunk.offset + chunk.length)
        data = (tmp_path / FILES[chunk.file].key).read_bytes()[span]
        assert data == CONTENT[chunk.file][span]
        assert held[chunk.index] == chunk_digest(data, ALGORITHM)
