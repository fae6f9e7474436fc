"""Shared helpers of the host-storage tests: settings, published checkpoint entries, fakes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dlo_bench.entries import publish_layout, rank_local_settings
from dlo_contract.settings import Settings, replace_path


def settings_with(**fields: Any) -> Settings:
    """Default settings with dotted fields replaced, e.g. `settings_with(**{"parallel.tp": 2})`."""
    settings = Settings()
    for dotted, value in fields.items():
        settings = replace_path(settings, dotted, value)
    return settings


def rank_local(root: Path, **fields: Any) -> Settings:
    """Rank-local offload over the cache at `root`."""
    return rank_local_settings(root, **fields)


def publish_checkpoint(root: Path, layout_dir: Path, source: str = "s3://models/tiny/") -> dict:
    """Publish the files under `layout_dir` as a checkpoint entry, as the loader does; returns
    the `entry.json` document."""
    return publish_layout(root, layout_dir, source).to_dict()


def write_entry_file(directory: Path, entry: dict) -> Path:
    path = directory / "entry.json"
    path.write_text(json.dumps(entry))
    return path


def state_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)
