"""Damaged entries: `dlo cache verify` finds them, readers refuse them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from support.cache_helpers import dlo, publish_files
from dlo_cli import main as cli
from dlo_contract.cache import (
    CacheCorruptError,
    CacheRoot,
    FileRecord,
    Problem,
    chunk_digests,
    find_entry,
    hexdigest,
    open_entry,
    sha256_file,
    verify_entry,
)

CHUNK = 1 << 20
BIG = bytes(range(256)) * (3 * CHUNK // 256 + 100)  # three full chunks and a short fourth


def _publish_big(root: CacheRoot) -> str:
    files = {"config.json": b'{"layers": 2}', "weights/w.safetensors": BIG}
    big = FileRecord(
        "weights/w.safetensors",
        len(BIG),
        chunk_bytes=CHUNK,
        chunk_digests=tuple(_chunks(BIG)),
    )
    return publish_files(root, "s3://b/m/", files, **{"weights/w.safetensors": big})


def _chunks(data: bytes) -> list[str]:
    return [hashlib.sha256(data[i : i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK)]


def _flip(path: Path, offset: int) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))


def test_full_verify_names_the_first_bad_file_and_chunk(root: CacheRoot) -> None:
    entry = _publish_big(root)
    target = root.entry_dir(entry) / "weights" / "w.safetensors"
    assert dlo("cache", "verify", "--root", str(root.path), "--full", entry).returncode == 0
    _flip(target, 2 * CHUNK + 5)
    bad = chunk_digests(target, CHUNK, 2, 3)[0]
    plain = dlo("cache", "verify", "--root", str(root.path), entry)
    assert (plain.returncode, plain.stdout) == (0, f"ok {entry} (sizes)\n")
    full = dlo("cache", "verify", "--root", str(root.path), "--full", entry[:12])
    assert full.returncode == 1
    assert full.stdout == (
        f"corrupt {entry} (full): weights/w.safetensors chunk 2: bytes 2097152-3145727: "
        f"sha256 {bad} does not match the manifest's {_chunks(BIG)[2]}\n"
    )
    with pytest.raises(CacheCorruptError) as info:
        open_entry(root, entry, verify="full")
    assert (
        str(info.value)
        == f"cache entry {entry} is corrupt: " + full.stdout.split(": ", 1)[1].strip()
    )


def test_full_verify_of_a_small_file_names_the_file(root: CacheRoot) -> None:
    entry = _publish_big(root)
    target = root.entry_dir(entry) / "config.json"
    expected = sha256_file(target)
    _flip(target, 0)
    assert verify_entry(root, entry, full=True) == [
        Problem(
            "config.json",
            None,
            f"sha256 {sha256_file(target)} does not match the manifest's {expected}",
        )
    ]


def test_plain_verify_reports_a_truncated_file(
    root: CacheRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = _publish_big(root)
    os.truncate(root.entry_dir(entry) / "weights" / "w.safetensors", CHUNK)
    (root.entry_dir(entry) / "stray.bin").write_bytes(b"?")
    assert cli.main(["cache", "verify", "--root", str(root.path), entry]) == 1
    assert capsys.readouterr().out == (
        f"corrupt {entry} (sizes): weights/w.safetensors: size is {CHUNK} bytes, manifest says "
        f"{len(BIG)}\n1 more problem(s):\n  stray.bin: not listed in the manifest\n"
    )
    assert find_entry(root, entry) is None
    with pytest.raises(CacheCorruptError) as info:
        open_entry(root, entry)
    assert str(info.value) == (
        f"cache entry {entry} is corrupt: weights/w.safetensors: size is {CHUNK} bytes, "
        f"manifest says {len(BIG)}"
    )


def test_verify_of_an_unknown_entry_is_a_one_line_error(root: CacheRoot) -> None:
    root.ensure()
    done = dlo("cache", "verify", "--root", str(root.path), "0" * 64)
    assert done.returncode == 1
    assert done.stderr == (
        f"dlo: error: cache entry {'0' * 64} not found in {root.path} "
        f"(hint: list entries with: dlo cache ls --root {root.path})\n"
    )


def test_a_missing_manifest_means_no_entry(root: CacheRoot) -> None:
    entry = _publish_big(root)
    os.unlink(root.manifest_path(entry))
    assert find_entry(root, entry) is None
    assert verify_entry(root, entry) == [
        Problem("manifest.json", None, "missing (the entry is incomplete or absent)")
    ]


@pytest.mark.parametrize("algorithm", ["crc64nvme", "crc32c", "crc32", "xxh3-128"])
def test_full_verify_checks_chunks_of_every_named_algorithm(root: CacheRoot,
                                                            algorithm: str) -> None:
    """The loader names the digest of each file (the CRC its store keeps, when it keeps one);
    `verify` checks each, and a flipped byte is found in the chunk that holds it."""
    digests = [hexdigest(BIG[i:i + CHUNK], algorithm) for i in range(0, len(BIG), CHUNK)]
    big = FileRecord("weights/w.safetensors", len(BIG), chunk_bytes=CHUNK,
                     chunk_digests=tuple(digests), algorithm=algorithm)
    entry = publish_files(root, "s3://b/m/", {"weights/w.safetensors": BIG},
                          **{"weights/w.safetensors": big})
    assert verify_entry(root, entry, full=True) == []
    _flip(root.entry_dir(entry) / "weights" / "w.safetensors", CHUNK + 7)
    [problem] = verify_entry(root, entry, full=True)
    assert (problem.file, problem.chunk) == ("weights/w.safetensors", 1)
    assert problem.message.startswith(f"bytes {CHUNK}-{2 * CHUNK - 1}: {algorithm} ")
    assert problem.message.endswith(f"does not match the manifest's {digests[1]}")
