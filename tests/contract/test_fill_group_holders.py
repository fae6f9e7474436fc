"""The fill-group document's holders: the nodes that hold the entry and where their loaders
serve it, round-tripped as the operator writes and the loader reads them."""

from __future__ import annotations

import json

import pytest

from dlo_contract.fill_group import CLOSED, FillGroup, Holder


def test_holders_round_trip_with_or_without_an_open_group() -> None:
    holders = (Holder("node-a", "m-0.m-peers.ns.svc", 9400), Holder("node-b", "10.0.0.7", 9401))
    for group in (FillGroup(holders=holders), FillGroup(
            revision="r1", members={"m-2": 0, "m-3": 1}, master_addr="m-2", holders=holders)):
        assert FillGroup.from_json(group.to_json()) == group


def test_a_document_without_holders_reads_as_none_and_is_written_as_before() -> None:
    assert FillGroup.from_json(CLOSED.to_json()).holders == ()
    assert "holders" not in json.loads(CLOSED.to_json())


@pytest.mark.parametrize("holder", [{"node": "a", "port": 9400}, {"node": "a", "address": "x"},
                                    {"node": "a", "address": "x", "port": 0}, "node-a"])
def test_a_holder_without_an_address_and_port_is_refused(holder: object) -> None:
    with pytest.raises(ValueError, match="holder must name node, address and port"):
        FillGroup.from_json(json.dumps({"members": {}, "holders": [holder]}))
