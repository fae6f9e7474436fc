"""Checking an entry's files against its manifest: sizes always, digests on request.

Owns the rules that turn a directory plus a manifest into a list of `Problem`s, in manifest order,
so that the first one is the one a person should look at. Full checks hash every chunk on a small
thread pool (hashlib releases the GIL, so threads use several cores). Called by `entry` (readers,
`verify_entry`) and `publish` (joining an existing entry). Must not take locks, delete or repair
anything.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dlo_contract.cache.digest import HASH_WORKERS, chunk_count, chunk_digests, file_digest
from dlo_contract.cache.identity import entry_id as identity_entry_id
from dlo_contract.cache.layout import MANIFEST_NAME
from dlo_contract.cache.manifest import FileRecord, Manifest


@dataclass(frozen=True)
class Problem:
    """One way an entry differs from its manifest; `chunk` is set for chunked digests."""

    file: str
    chunk: int | None
    message: str

    def __str__(self) -> str:
        where = self.file if self.chunk is None else f"{self.file} chunk {self.chunk}"
        return f"{where}: {self.message}"


def check_manifest(manifest: Manifest, directory_name: str) -> list[Problem]:
    """The manifest must name its own directory and match its identity's id."""
    if manifest.entry_id != directory_name:
        return [Problem(MANIFEST_NAME, None,
                        f"names entry {manifest.entry_id}, but lives in {directory_name}")]
    derived = identity_entry_id(manifest.identity)
    if derived != manifest.entry_id:
        return [Problem(MANIFEST_NAME, None, f"identity hashes to {derived}, not to its entry id")]
    return []


def check_files(entry_dir: Path, manifest: Manifest, *, full: bool) -> list[Problem]:
    """Sizes and types of every listed file, unlisted files, then digests when `full`."""
    problems = [p for record in manifest.files if (p := _check_size(entry_dir, record))]
    problems.extend(_unlisted(entry_dir, manifest))
    if full and not problems:
        problems.extend(_check_digests(entry_dir, manifest.files))
    return problems


def _check_size(entry_dir: Path, record: FileRecord) -> Problem | None:
    try:
        info = os.lstat(entry_dir / record.name)
    except FileNotFoundError:
        return Problem(record.name, None, "missing")
    if not stat.S_ISREG(info.st_mode):
        return Problem(record.name, None, "not a regular file")
    if info.st_size != record.size:
        return Problem(
            record.name, None, f"size is {info.st_size} bytes, manifest says {record.size}"
        )
    return None


def _unlisted(entry_dir: Path, manifest: Manifest) -> list[Problem]:
    listed = {f.name for f in manifest.files} | {MANIFEST_NAME}
    found = []
    for dirpath, dirnames, filenames in os.walk(entry_dir):
        relative = Path(dirpath).relative_to(entry_dir)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = (relative / name).as_posix()
            if rel not in listed:
                found.append(Problem(rel, None, "not listed in the manifest"))
    return sorted(found, key=lambda p: p.file)


def _check_digests(entry_dir: Path, records: tuple[FileRecord, ...]) -> list[Problem]:
    """Hash every file (and every chunk) in parallel; report the first bad chunk per file."""
    tasks: list[tuple[FileRecord, int | None]] = []
    for record in records:
        if record.chunk_bytes is None:
            tasks.append((record, None))
        else:
            tasks.extend((record, i) for i in range(chunk_count(record.size, record.chunk_bytes)))
    with ThreadPoolExecutor(max_workers=HASH_WORKERS) as pool:
        digests = list(pool.map(lambda task: _digest(entry_dir, *task), tasks))
    problems: list[Problem] = []
    reported: set[str] = set()
    for (record, chunk), actual in zip(tasks, digests, strict=True):
        expected = record.digest if chunk is None else record.chunk_digests[chunk]
        if actual == expected or record.name in reported:
            continue
        reported.add(record.name)
        problems.append(Problem(record.name, chunk, _mismatch(record, chunk, actual, expected)))
    return problems


def _digest(entry_dir: Path, record: FileRecord, chunk: int | None) -> str:
    path = entry_dir / record.name
    if chunk is None or record.chunk_bytes is None:
        return file_digest(path, record.algorithm)
    digests = chunk_digests(path, record.chunk_bytes, chunk, chunk + 1, record.algorithm)
    return digests[0] if digests else ""


def _mismatch(record: FileRecord, chunk: int | None, actual: str, expected: str | None) -> str:
    if chunk is None or record.chunk_bytes is None:
        return f"{record.algorithm} {actual} does not match the manifest's {expected}"
    start = chunk * record.chunk_bytes
    stop = min(record.size, start + record.chunk_bytes)
    return (
        f"bytes {start}-{stop - 1}: {record.algorithm} {actual} does not match the manifest's "
        f"{expected}"
    )
