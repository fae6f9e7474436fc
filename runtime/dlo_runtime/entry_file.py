"""The loader's entry document as the main container reads it (`DLO_ENTRY_FILE`).

Owns the entry file's location (argument, else `names.ENTRY_FILE_ENV`, else the default) and
reading `documents.EntryDocument` from it into an `EntryRef`. torch-free, so `prefetch` can read it before a server's heavy imports. Called by
`pod` and `prefetch`; must not open the entry itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dlo_contract.documents import DocumentError, EntryDocument
from dlo_contract.errors import PermanentError
from dlo_contract.names import DEFAULT_ENTRY_FILE, ENTRY_FILE_ENV


class PodError(PermanentError):
    """The process cannot start offloading as configured."""


@dataclass(frozen=True)
class EntryRef:
    """The checkpoint entry the loader filled, as `entry.json` names it."""

    entry_id: str
    root: str
    path: Path


def read_entry_file(path: str | os.PathLike[str] | None = None) -> EntryRef | None:
    """The entry named by `path` (else `$DLO_ENTRY_FILE`, else the default), or None when no
    loader ran for this pod (no file)."""
    where = entry_file_path(path)
    try:
        document = EntryDocument.from_json(where.read_text())
        return EntryRef(document.entry_id, document.root, Path(document.path))
    except FileNotFoundError:
        return None
    except (OSError, DocumentError) as exc:
        raise PodError(f"entry file {where} is unreadable: {exc}",
                       hint="it is written by `dlo cache fill --entry-file`") from exc


def entry_file_path(path: str | os.PathLike[str] | None) -> Path:
    return Path(path or os.environ.get(ENTRY_FILE_ENV) or DEFAULT_ENTRY_FILE)
