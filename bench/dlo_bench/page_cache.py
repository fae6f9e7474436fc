"""Making files cold (out of the page cache) and measuring how much of them is resident.

Owns the two ways a benchmark gets a cold page cache: `evict` (fsync, then
`posix_fadvise(POSIX_FADV_DONTNEED)` on each file: only the benchmark's own files leave the cache,
so other work on a shared machine keeps its pages) and `drop_system_caches` (`sync` and
`/proc/sys/vm/drop_caches`: every clean page of the machine, libraries included; needs root and
belongs on a quiet machine). `resident_bytes` counts resident pages with `mincore(2)`. Called by
`dlo_bench.coldstart` and its child processes; stdlib only; must not be imported by the planes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_PAGE = mmap.PAGESIZE


def files_under(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Every regular file at or under `paths` (missing paths contribute nothing)."""
    found: list[Path] = []
    for top in map(Path, paths):
        if top.is_file():
            found.append(top)
        elif top.is_dir():
            found.extend(sorted(p for p in top.rglob("*") if p.is_file() and not p.is_symlink()))
    return found


def evict(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Write back and drop the cached pages of every file under `paths`; returns the files'
    bytes. A dirty page cannot be dropped, hence the fsync first."""
    total = 0
    for path in files_under(paths):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def drop_caches_writable() -> bool:
    """Whether this process may write `/proc/sys/vm/drop_caches` (opening it writes nothing)."""
    try:
        fd = os.open(DROP_CACHES, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def drop_system_caches() -> None:
    """Drop every clean page cache page of the machine (after a sync)."""
    os.sync()
    DROP_CACHES.write_text("1\n")


def resident_bytes(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Bytes of the files under `paths` whose pages are in the page cache now."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    total = 0
    for path in files_under(paths):
        size = path.stat().st_size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap failed on {path}")
            try:
                vector = ctypes.create_string_buffer((size + _PAGE - 1) // _PAGE)
                if libc.mincore(address, size, vector) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
        total += min(sum(byte & 1 for byte in vector.raw) * _PAGE, size)
    return total
