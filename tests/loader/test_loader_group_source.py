"""Where a loader learns its fill group: flags, then RANK/WORLD_SIZE, then the operator's
fill-group document (a member of an open group of its revision joins; anyone else fills alone)."""

from __future__ import annotations

import pytest
from dlo_contract.fill_group import FillGroup
from dlo_contract.settings import SettingsError
from dlo_loader.group_source import Placement, resolve_placement

GROUP = FillGroup(revision="r1", members={"flux-2": 0, "flux-3": 1},
                  master_addr="flux-2.flux-peers.ns.svc.cluster.local", master_port=29600)


def place(monkeypatch: pytest.MonkeyPatch, **env: str) -> Placement:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DLO_FILL_GROUP",
                 "DLO_POD_NAME", "DLO_REVISION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return resolve_placement(rank=None, world_size=None, master_addr=None, master_port=None)


def test_a_member_of_the_open_group_joins_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert place(monkeypatch, DLO_FILL_GROUP=GROUP.to_json(), DLO_POD_NAME="flux-3",
                 DLO_REVISION="r1") == Placement(
        rank=1, world_size=2, master_addr="flux-2.flux-peers.ns.svc.cluster.local",
        master_port=29600, origin="fill-group")


@pytest.mark.parametrize(("pod", "revision", "document"), [
    ("flux-0", "r1", GROUP.to_json()),        # a serving pod recreated: not a member
    ("flux-3", "r0", GROUP.to_json()),        # a pod of another revision
    ("flux-3", "r1", FillGroup().to_json()),  # the group closed once its members finished
    ("flux-3", "r1", ""),                     # no document (optional ConfigMap key absent)
])
def test_anyone_else_fills_alone(monkeypatch: pytest.MonkeyPatch, pod: str, revision: str,
                                 document: str) -> None:
    assert place(monkeypatch, DLO_FILL_GROUP=document, DLO_POD_NAME=pod,
                 DLO_REVISION=revision) == Placement()


def test_the_torch_environment_wins_over_the_document(monkeypatch: pytest.MonkeyPatch) -> None:
    placement = place(monkeypatch, RANK="1", WORLD_SIZE="3", MASTER_ADDR="job-0.svc",
                      DLO_FILL_GROUP=GROUP.to_json(), DLO_POD_NAME="flux-3", DLO_REVISION="r1")
    assert (placement.rank, placement.world_size, placement.master_addr, placement.origin) == (
        1, 3, "job-0.svc", "environment")


def test_a_broken_document_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError) as caught:
        place(monkeypatch, DLO_FILL_GROUP='{"members": {"a": 1}}', DLO_POD_NAME="a")
    assert str(caught.value).startswith(
        "environment variable DLO_FILL_GROUP is not a fill group document: fill group members "
        "must map pod names to ranks 0..n-1, found {'a': 1}")
