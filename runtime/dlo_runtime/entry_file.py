"""The loader's entry document as the main container reads it (`DLO_ENTRY_FILE`).

Owns the entry file's location (argument, else `names.ENTRY_FILE_ENV`, else the default), reading
`documents.EntryDocument` from it into an `EntryRef`, and waiting for it while the pod's loader
sidecar fills (`names.ENTRY_WAIT_ENV` seconds, a line every `WAIT_LOG_S`). torch-free, so
`prefetch` can read it before a server's heavy imports. Called by
`pod` and `prefetch`; must not open the entry itself.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dlo_contract.documents import DocumentError, EntryDocument
from dlo_contract.field_names import Names, document_names
from dlo_contract.names import DEFAULT_ENTRY_FILE, ENTRY_FILE_ENV, ENTRY_WAIT_ENV
from dlo_runtime.errors import PodError

log = logging.getLogger(__name__)

WAIT_LOG_S = 10.0
"""How often a wait for the entry document says that it still waits."""
_POLL_S = 0.05


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


def wait_seconds() -> float:
    """How long to wait for the entry document (`names.ENTRY_WAIT_ENV`; 0 when unset)."""
    text = os.environ.get(ENTRY_WAIT_ENV, "").strip()
    try:
        seconds = float(text) if text else 0.0
    except ValueError:
        raise PodError(f"{ENTRY_WAIT_ENV}={text!r} is not a number of seconds",
                       hint="the operator writes it; unset it to wait for nothing") from None
    return max(seconds, 0.0)


def wait_for_entry_file(path: str | os.PathLike[str] | None = None, *,
                        timeout_s: float | None = None, quiet: bool = False,
                        names: Names = document_names) -> EntryRef | None:
    """`read_entry_file`, waiting up to `timeout_s` (default `wait_seconds()`) for the document
    to appear: the pod's loader sidecar writes it once the entry is published. None when nothing
    is to be waited for and there is no file; past the deadline, an error naming the file. A
    `quiet` wait (the read-ahead's, beside the server's own) logs nothing; `names` spells the
    settings in the error."""
    timeout_s = wait_seconds() if timeout_s is None else timeout_s
    entry = read_entry_file(path)
    if entry is not None or timeout_s <= 0:
        return entry
    where = entry_file_path(path)
    start = time.monotonic()
    next_line = start
    while entry is None:
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise PodError(
                f"no entry file at {where} after {waited:.0f} s: the loader has not published "
                "the checkpoint",
                hint="see the loader's log (`kubectl logs POD -c loader`) and the "
                     f"DiffusionOffloadDeployment's status; {names('loader.timeout_s')} bounds "
                     "the wait")
        if not quiet and time.monotonic() >= next_line:
            log.info("waiting for the loader to publish %s (%.0f s of %.0f s)", where, waited,
                     timeout_s)
            next_line += WAIT_LOG_S
        time.sleep(_POLL_S)
        entry = read_entry_file(path)
    if not quiet:
        log.info("entry %s published after %.1f s", entry.entry_id, time.monotonic() - start)
    return entry


def entry_file_path(path: str | os.PathLike[str] | None) -> Path:
    return Path(path or os.environ.get(ENTRY_FILE_ENV) or DEFAULT_ENTRY_FILE)
