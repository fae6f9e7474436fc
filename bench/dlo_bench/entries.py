"""Publish a model written in the diffusers layout as a node-cache checkpoint entry, as the
loader would, and the documents a pod's server reads (the entry document and the settings).

Owns the stand-in for `dlo cache fill` and the operator used by the example server, the
host-storage tests and the runtime benchmarks: they need an entry without an object store.
Must not be imported by the planes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from dlo_contract.cache import (
    FileRecord, ObjectIdentity, checkpoint_identity, entry_id, publish_entry, sha256_file,
)
from dlo_contract.documents import EntryDocument
from dlo_contract.settings import Settings, replace_path


def publish_layout(root: Path, layout: Path, source: str, *, link: bool = False
                   ) -> EntryDocument:
    """Publish every file under `layout` (a directory holding `transformer/`) as the checkpoint
    entry of `source` under the cache `root`. `link` hard-links the files instead of copying
    them (same filesystem: one copy in the page cache), for layouts nothing writes again."""
    files = sorted(p for p in layout.rglob("*") if p.is_file())
    relative = [str(p.relative_to(layout)) for p in files]
    identity = checkpoint_identity(source, [
        ObjectIdentity(n, p.stat().st_size, sha256_file(p)) for n, p in zip(relative, files)])
    eid = entry_id(identity)

    def write(tmp: Path) -> list[FileRecord]:
        for name, path in zip(relative, files):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (os.link if link else shutil.copyfile)(path, tmp / name)
        return [FileRecord(n, p.stat().st_size) for n, p in zip(relative, files)]

    path = publish_entry(root, eid, "checkpoint", identity, write,
                         expected_bytes=sum(p.stat().st_size for p in files), lock_timeout_s=30)
    return EntryDocument(entry_id=eid, kind="checkpoint", root=str(root), path=str(path),
                         source=source)


def rank_local_settings(root: Path, **fields: Any) -> Settings:
    """Rank-local offload over the cache at `root`, with dotted fields replaced."""
    settings = replace_path(replace_path(Settings(), "offload.use_allgather", False),
                            "cache.root", str(root))
    for dotted, value in fields.items():
        settings = replace_path(settings, dotted, value)
    return settings
