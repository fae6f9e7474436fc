"""Where things live under a cache root, and which names may live there.

Owns the on-disk layout of format v1 (`<root>/v1/{entries,tmp,locks,reservations}`), the
entry-id syntax and `safe_relpath`, the one check that keeps file names inside an entry. Every
other cache module builds paths through `CacheRoot`; the loader calls `safe_relpath` on object
keys. Must not read or write entry contents, take locks or decide anything about validity.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dlo_contract.cache.errors import CacheError

FORMAT_DIR = "v1"
MANIFEST_NAME = "manifest.json"
_ENTRY_ID = re.compile(r"[0-9A-Za-z_-]{1,128}")
_DRIVE = re.compile(r"[A-Za-z]:")


@dataclass(frozen=True)
class CacheRoot:
    """One node's cache root. `path` is the directory that holds `v1/`."""

    path: Path

    def __init__(self, path: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "path", Path(path))

    @classmethod
    def of(cls, root: CacheRoot | str | os.PathLike[str]) -> CacheRoot:
        """Accept a `CacheRoot` or a plain path, so every public function takes either."""
        return root if isinstance(root, CacheRoot) else cls(root)

    @property
    def base(self) -> Path:
        return self.path / FORMAT_DIR

    @property
    def entries(self) -> Path:
        return self.base / "entries"

    @property
    def tmp(self) -> Path:
        return self.base / "tmp"

    @property
    def locks(self) -> Path:
        return self.base / "locks"

    @property
    def reservations(self) -> Path:
        """One file per publication in progress: the bytes it will add (see `reservation`)."""
        return self.base / "reservations"

    @property
    def room_lock(self) -> Path:
        """Held while a publication decides whether its entry fits and reserves its bytes (a
        dot name: never read as a reservation)."""
        return self.reservations / ".lock"

    def ensure(self) -> None:
        """Create the four directories (idempotent; racing creators are fine)."""
        for directory in (self.entries, self.tmp, self.locks, self.reservations):
            directory.mkdir(parents=True, exist_ok=True)

    def entry_dir(self, entry_id: str) -> Path:
        return self.entries / check_entry_id(entry_id)

    def manifest_path(self, entry_id: str) -> Path:
        return self.entry_dir(entry_id) / MANIFEST_NAME

    def publish_lock(self, entry_id: str) -> Path:
        return self.locks / f"{check_entry_id(entry_id)}.publish"

    def use_lock(self, entry_id: str) -> Path:
        return self.locks / f"{check_entry_id(entry_id)}.use"

    def new_tmp_dir_path(self, entry_id: str, tag: str = "") -> Path:
        """A fresh `tmp/<id>.<nonce>` path; the pid in the nonce tells who left it behind."""
        nonce = f"{tag}{os.getpid()}-{secrets.token_hex(4)}"
        return self.tmp / f"{check_entry_id(entry_id)}.{nonce}"

    def tmp_dirs(self, entry_id: str | None = None) -> list[Path]:
        """Temporary directories of one entry id (or of all ids), present right now."""
        pattern = f"{check_entry_id(entry_id)}.*" if entry_id else "*.*"
        try:
            return sorted(self.tmp.glob(pattern))
        except FileNotFoundError:
            return []

    def entry_ids(self) -> list[str]:
        """Names under `entries/` that are valid ids (anything else is not ours to touch)."""
        try:
            names = os.listdir(self.entries)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if _ENTRY_ID.fullmatch(n))


def is_entry_id(name: str) -> bool:
    return bool(_ENTRY_ID.fullmatch(name))


def check_entry_id(entry_id: str) -> str:
    """Entry ids become path components: letters, digits, `_` and `-` only (no dots, no slashes)."""
    if not isinstance(entry_id, str) or not _ENTRY_ID.fullmatch(entry_id):
        raise CacheError(
            f"invalid cache entry id {entry_id!r}: expected 1-128 letters, digits, '_' or '-'",
            hint="use dlo_contract.cache.entry_id(identity)",
        )
    return entry_id


def safe_relpath(name: str) -> str:
    """Return `name` if it is a plain relative POSIX path that stays inside an entry.

    Object keys become file names byte for byte, so a key like `../../etc/cron.d/x` or
    `/etc/passwd` must be refused before anything is written. Also refused: empty names and
    components (`a//b`), `.` components, backslashes (a Windows separator in disguise), drive
    letters, NUL, and the reserved top-level `manifest.json`.
    """
    problem = relpath_problem(name)
    if problem:
        raise CacheError(
            f"file name {name!r} is not allowed in a cache entry: {problem}",
            hint="file names must be relative POSIX paths inside the entry",
        )
    return name


def relpath_problem(name: object) -> str | None:
    """Why `name` may not be a file name in an entry, or None when it may."""
    if not isinstance(name, str) or not name:
        return "empty name"
    if "\x00" in name:
        return "contains NUL"
    if "\\" in name:
        return "contains a backslash"
    if name.startswith("/"):
        return "absolute path"
    if _DRIVE.match(name):
        return "starts with a drive letter"
    parts = name.split("/")
    if ".." in parts:
        return "'..' escapes the entry"
    if any(part in ("", ".") for part in parts):
        return "empty or '.' path component"
    if PurePosixPath(name) == PurePosixPath(MANIFEST_NAME):
        return f"{MANIFEST_NAME} is reserved for the entry's manifest"
    return None
