"""The cross-plane documents and names: one shape for writer and readers, one home per literal."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dlo_contract import names
from dlo_contract.documents import (
    MAX_PEERS_LISTED,
    DocumentError,
    EntryDocument,
    FillStatus,
    FillSummary,
    GroupMember,
    PeerBytes,
)

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("contract", "cli", "runtime", "loader_image", "operator", "bench")


def test_entry_document_round_trips() -> None:
    doc = EntryDocument(entry_id="e" * 64, kind="checkpoint", root="/c", path="/c/v1/entries/e",
                        source="s3://b/p/")
    assert EntryDocument.from_json(doc.to_json()) == doc


def test_fill_summary_round_trips_and_leaves_out_what_it_does_not_know() -> None:
    ok = FillSummary(status=FillStatus.OK, entry_id="e", rank=1, world_size=2, mode="multi-reader",
                     bytes_from_store=10, bytes_from_peers=20, bytes_to_peers=5, seconds=1.5,
                     cached=False)
    failed = FillSummary(status=FillStatus.ERROR, rank=0, error="listing s3://b/p/: denied")
    assert FillSummary.from_json(ok.to_json()) == ok
    assert failed.to_dict() == {"status": "error", "rank": 0, "error": "listing s3://b/p/: denied"}
    assert (ok.ok, failed.ok) == (True, False)


def test_the_members_lost_and_the_bytes_by_peer_round_trip_as_records() -> None:
    survivor = FillSummary(status=FillStatus.OK, rank=0, world_size=3, without=[2],
                           bytes_read_again=7, lost=[GroupMember(rank=2, pod="p-2", node="n2")])
    refill = FillSummary(status=FillStatus.OK, world_size=1, bytes_from_peers=30,
                         bytes_by_peer=[PeerBytes(node="n0", bytes=20), PeerBytes(node="n1",
                                                                                  bytes=10)])
    assert survivor.to_dict()["lost"] == [{"rank": 2, "pod": "p-2", "node": "n2"}]
    assert FillSummary.from_json(survivor.to_json()) == survivor
    assert FillSummary.from_json(refill.to_json()) == refill


def test_the_largest_summary_fits_a_termination_message() -> None:
    """Kubernetes keeps 4 KiB of a termination message: a summary with every figure, a lost
    member and as many holders as it lists, each name as long as a node's may be, fits."""
    name = "n" * 63
    summary = FillSummary(
        status=FillStatus.OK, rank=255, world_size=256, entry_id="e" * 64, mode="multi-reader",
        bytes_from_store=1 << 50, bytes_from_peers=1 << 50, bytes_to_peers=1 << 50,
        seconds=1e6, cached=False, store_checksums="some",
        stage_seconds={k: 1e6 for k in ("get", "digest", "write", "exchange")},
        wait_seconds={k: 1e6 for k in ("group", "turn", "publication", "room")},
        without=[254], bytes_read_again=1 << 50,
        lost=[GroupMember(rank=254, pod=name, node=name)],
        bytes_by_peer=[PeerBytes(node=name, bytes=1 << 50)] * MAX_PEERS_LISTED)
    assert len(summary.to_json().encode()) <= 4096


@pytest.mark.parametrize("text, message", [
    ('{"status": "ok", "lost": {"rank": 2}}', "fill summary's lost must be a list, got dict"),
    ('{"status": "ok", "bytes_by_peer": [{"node": "n0"}]}',
     "fill summary's bytes_by_peer lacks 'bytes'"),
])
def test_malformed_records_are_refused_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(DocumentError) as caught:
        FillSummary.from_json(text)
    assert str(caught.value) == message


def test_a_newer_writer_s_extra_keys_are_ignored() -> None:
    summary = FillSummary.from_dict({"status": "ok", "entry_id": "e", "gpu_temperature": 3})
    assert summary == FillSummary(status=FillStatus.OK, entry_id="e")


@pytest.mark.parametrize("text, message", [
    ("[1]", "fill summary must be a JSON object, got list"),
    ('{"status": "maybe"}', "fill summary: status 'maybe' is not one of ['ok', 'error']"),
    ('{"rank": 1}', "fill summary lacks 'status'"),
    ("{", "fill summary is not JSON: Expecting property name enclosed in double quotes: "
          "line 1 column 2 (char 1)"),
])
def test_malformed_summaries_are_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(DocumentError) as caught:
        FillSummary.from_json(text)
    assert str(caught.value) == message


def _literals(path: Path) -> set[str]:
    """String constants in code, leaving out docstrings (they may name what they document)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings}


CROSS_PLANE = {
    "DLO_CONFIG": names.CONFIG_ENV, "DLO_ENTRY_FILE": names.ENTRY_FILE_ENV,
    "/etc/dlo": names.SETTINGS_MOUNT, "/run/dlo": names.RUN_DIR,
    "/dev/termination-log": names.DEFAULT_SUMMARY_FILE, "/var/lib/dlo/cache": names.DEFAULT_CACHE_ROOT,
}


def test_each_cross_plane_literal_lives_in_the_names_module_only() -> None:
    assert CROSS_PLANE == {k: k for k in CROSS_PLANE}  # the table above names the real values
    homes: dict[str, list[str]] = {}
    for folder in PRODUCT:
        for path in sorted((REPO / folder).rglob("*.py")):
            found = _literals(path)
            for literal in CROSS_PLANE:
                if any(literal in text for text in found):
                    homes.setdefault(literal, []).append(str(path.relative_to(REPO)))
    assert homes == {literal: ["contract/dlo_contract/names.py"] for literal in CROSS_PLANE}


def test_the_rendezvous_port_has_one_home() -> None:
    homes = []
    for folder in PRODUCT:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            if any(isinstance(n, ast.Constant) and n.value == names.DEFAULT_RENDEZVOUS_PORT
                   for n in ast.walk(tree)):
                homes.append(str(path.relative_to(REPO)))
    assert homes == ["contract/dlo_contract/names.py"]
