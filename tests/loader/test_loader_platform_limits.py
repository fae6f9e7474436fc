"""Attack 7 of issue 33: one DOD's `cache.maxBytes: 1` made its loader evict every unused entry
on the node, other teams' included. Now only the platform's node limits (chart values
`nodeCache.maxBytes`, `nodeCache.minFreeBytes`, written into every pod's settings by the
operator) evict; a DOD's own `cache.maxBytes` caps its own entry and `cache.minFreeBytes` raises
its own floor, both without evicting anything. Real `dlo cache fill` processes read the settings
document `dlo render` writes for the DOD's pods."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dlo_bench.s3server import DUMMY_CREDENTIALS, S3Server
from safetensors.numpy import save_file
from support.cache_helpers import publish_files
from support.loader_fleet import LOADER_SETTINGS, finish, upload_files

from dlo_contract.cache import CacheRoot, CacheSpaceError, list_entries
from dlo_contract.settings import CacheConfig
from dlo_contract.validation import document_names
from dlo_loader.room import make_room_within
from dlo_operator.installation import InstallationConfig
from dlo_operator.naming import SETTINGS_KEY
from dlo_operator.render import render_document

OTHER_TEAMS = {"s3://team-b/model/": 300_000, "s3://team-c/model/": 200_000}


def _checkpoint(tmp: Path, s3: S3Server) -> tuple[str, int]:
    local = tmp / "ckpt"
    local.mkdir()
    rng = np.random.default_rng(7)
    save_file({"w": rng.standard_normal(36_000, dtype=np.float32)}, str(local / "m.safetensors"))
    data = (local / "m.safetensors").read_bytes()
    return upload_files(s3, "team-a", {"m.safetensors": data}, tmp / "up"), len(data)


def _pod_settings(cache: dict[str, Any], installation: InstallationConfig) -> dict[str, Any]:
    """The settings document of a DOD in namespace team-a, as its pods read it."""
    dod = {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
           "metadata": {"name": "flux", "namespace": "team-a"},
           "spec": {"model": {"source": "s3://team-a/x/"}, "inference": {"image": "s:1"},
                    "cache": cache}}
    children = render_document(dod, "team-a", installation)
    return json.loads(next(c["data"][SETTINGS_KEY] for c in children
                           if SETTINGS_KEY in c.get("data", {})))


def _fill(tmp: Path, s3: S3Server, root: Path, source: str, settings: dict[str, Any]) -> dict:
    """`dlo cache fill` as the pod runs it, on `settings` with this test's store and root."""
    settings["loader"] |= LOADER_SETTINGS | {"source": source}
    settings["cache"]["root"] = str(root)
    config = tmp / "settings.json"
    config.write_text(json.dumps(settings))
    process = subprocess.Popen(
        [sys.executable, "-m", "dlo_cli.main", "cache", "fill", "--config", str(config),
         "--endpoint-url", s3.endpoint_url, "--entry-file", str(tmp / "entry.json"),
         "--summary-file", str(tmp / "summary")],
        env={**DUMMY_CREDENTIALS, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    outcome = finish(0, process)
    assert outcome.summary, (outcome.stdout, outcome.stderr)
    return outcome.summary


def _other_teams(root: CacheRoot) -> dict[str, str]:
    """Unused entries of two other teams' models, team B's the least recently used."""
    return {source: publish_files(root, source, {"w.bin": b"x" * size})
            for source, size in OTHER_TEAMS.items()}


@pytest.mark.usefixtures("aws_env")
def test_a_dod_asking_for_one_byte_fails_its_own_fill_and_evicts_nobody(
        s3: S3Server, tmp_path: Path) -> None:
    root = CacheRoot(tmp_path / "cache")
    others = set(_other_teams(root).values())
    source, size = _checkpoint(tmp_path, s3)
    settings = _pod_settings({"maxBytes": 1}, InstallationConfig())

    summary = _fill(tmp_path, s3, root.path, source, settings)

    assert summary["status"] == "error"
    assert (f" needs {size} bytes, more than spec.cache.maxBytes=1 this deployment allows its "
            "own entry; nothing was evicted (hint: raise spec.cache.maxBytes (at most the "
            "platform's nodeCache.maxBytes, no limit; 0 takes it) or narrow "
            "spec.model.include)") in summary["error"]
    assert {info.entry_id for info in list_entries(root)} == others


@pytest.mark.usefixtures("aws_env")
def test_a_dods_own_limit_below_the_cache_total_evicts_nobody(
        s3: S3Server, tmp_path: Path) -> None:
    """Before: `cache.maxBytes` of the entry's size evicted both other teams' entries."""
    root = CacheRoot(tmp_path / "cache")
    others = set(_other_teams(root).values())
    source, size = _checkpoint(tmp_path, s3)
    settings = _pod_settings({"maxBytes": size + 1000}, InstallationConfig())
    assert settings["cache"] | {"root": None} == {
        "max_bytes": size + 1000, "min_free_bytes": 0, "node_max_bytes": 0,
        "node_min_free_bytes": 0, "root": None, "verify": "sizes"}

    summary = _fill(tmp_path, s3, root.path, source, settings)

    assert summary["status"] == "ok", summary
    assert {info.entry_id for info in list_entries(root)} == others | {summary["entry_id"]}


@pytest.mark.usefixtures("aws_env")
def test_the_platforms_limit_evicts_the_least_recently_used_entry_only(
        s3: S3Server, tmp_path: Path) -> None:
    root = CacheRoot(tmp_path / "cache")
    others = _other_teams(root)
    source, size = _checkpoint(tmp_path, s3)
    limit = size + OTHER_TEAMS["s3://team-c/model/"] + 1000  # the entry and team C's
    settings = _pod_settings({}, InstallationConfig(node_cache_max_bytes=limit))
    assert (settings["cache"]["max_bytes"], settings["cache"]["node_max_bytes"]) == (limit, limit)

    summary = _fill(tmp_path, s3, root.path, source, settings)

    assert summary["status"] == "ok", summary
    assert {info.entry_id for info in list_entries(root)} == {
        others["s3://team-c/model/"], summary["entry_id"]}


def test_a_dods_higher_floor_fails_its_fill_instead_of_evicting(tmp_path: Path) -> None:
    root = CacheRoot(tmp_path / "cache")
    others = set(_other_teams(root).values())
    floor = 1 << 62  # more than any disk has free
    cache = CacheConfig(root=str(root.path), min_free_bytes=floor, node_min_free_bytes=0,
                        node_max_bytes=0)
    with pytest.raises(CacheSpaceError) as info:
        make_room_within(root, "f" * 64, incoming_bytes=1000, cache=cache, names=document_names)
    assert str(info.value).startswith(f"cache entry {'f' * 64} (1000 bytes) would leave ")
    assert str(info.value).endswith(
        f"less than cache.min_free_bytes={floor} this deployment asks for; eviction keeps only "
        "the platform's floor (nodeCache.minFreeBytes=0)")
    assert info.value.hint == ("lower cache.min_free_bytes (0 takes the platform's floor) or "
                               "ask the cluster administrator for more room on the node")
    assert {info.entry_id for info in list_entries(root)} == others
