"""Shared helpers of the host-storage tests: settings, published checkpoint entries, fakes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from dlo_contract.cache import (
    FileRecord, ObjectIdentity, checkpoint_identity, entry_id, publish_entry, sha256_file,
)
from dlo_contract.settings import Settings, replace_path


def settings_with(**fields: Any) -> Settings:
    """Default settings with dotted fields replaced, e.g. `settings_with(**{"parallel.tp": 2})`."""
    settings = Settings()
    for dotted, value in fields.items():
        settings = replace_path(settings, dotted, value)
    return settings


def rank_local(root: Path, **fields: Any) -> Settings:
    """Rank-local offload over the cache at `root`."""
    return settings_with(**{"offload.use_allgather": False, "cache.root": str(root), **fields})


def publish_checkpoint(root: Path, layout_dir: Path, source: str = "s3://models/tiny/") -> dict:
    """Publish the files under `layout_dir` as a checkpoint entry, as the loader does; returns
    the `entry.json` document."""
    files = sorted(p for p in layout_dir.rglob("*") if p.is_file())
    objects = [ObjectIdentity(str(p.relative_to(layout_dir)), p.stat().st_size, sha256_file(p))
               for p in files]
    identity = checkpoint_identity(source, objects)
    eid = entry_id(identity)

    def write(tmp: Path) -> list[FileRecord]:
        records = []
        for path in files:
            name = str(path.relative_to(layout_dir))
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, tmp / name)
            records.append(FileRecord(name, path.stat().st_size))
        return records

    path = publish_entry(root, eid, "checkpoint", identity, write,
                         expected_bytes=sum(p.stat().st_size for p in files), lock_timeout_s=10)
    return {"entry_id": eid, "kind": "checkpoint", "root": str(root), "path": str(path),
            "source": source}


def write_entry_file(directory: Path, entry: dict) -> Path:
    path = directory / "entry.json"
    path.write_text(json.dumps(entry))
    return path


def state_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)
