"""AllGather mode across real gloo processes: offloaded forwards equal the resident model bit for
bit over a DP group and over an SP group (dp=1), each rank holds 1/G of the streamed bytes in one
host arena per dtype, and on-demand modules stay whole and rank-local.

Processes start once per world size and run every case (see `runtime_dist_worker.py`)."""

from __future__ import annotations

from typing import Any

import pytest
from support import runtime_dist_worker
from support.gloo_world import run_world

pytestmark = pytest.mark.slow

CASES = (
    "flux-dp", "sd3-dp", "wan-dp", "wan-bf16-mixed-dp", "flux-sp", "wan-sp", "sd3-plan-dp",
    "wan-dp-default-group", "flux-mapped-plan-dp",
)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"world{world}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """Outcomes of every case on every rank of one gloo world."""
    world = request.param
    out_dir = tmp_path_factory.mktemp(f"world{world}")
    return run_world(runtime_dist_worker.main, world, out_dir)


def test_every_case_ran_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for outcomes in ranks:
        assert sorted(outcomes) == sorted(
            [*CASES, "group-size-error", "mapped-plan-released", "on-demand-dp"]
        )
        assert {outcomes[case]["mode"] for case in CASES} == {"allgather"}
        assert {outcomes[case]["shard_count"] for case in CASES} == {len(ranks)}


def test_mapped_sources_are_released_once_sharded(ranks: list[dict[str, Any]]) -> None:
    assert [outcomes["mapped-plan-released"] for outcomes in ranks] == [True] * len(ranks)


def test_on_demand_modules_are_whole_and_rank_local_in_allgather_mode(
    ranks: list[dict[str, Any]],
) -> None:
    for outcomes in ranks:
        outcome = outcomes["on-demand-dp"]
        assert outcome["mode"] == "allgather"
        assert outcome["released_while_enabled"]
        assert (outcome["equal"], outcome["equal_second_step"], outcome["equal_after_disable"]) == (
            True, True, True,
        )
        assert outcome["on_demand_host_bytes"] == outcome["on_demand_bytes"] == 25152


def test_a_group_of_the_wrong_size_is_refused(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    for outcomes in ranks:
        assert outcomes["group-size-error"] == (
            f"the group passed has {world} ranks, but parallel.dp={world + 1} selects a DLO "
            f"group of {world + 1}"
        )


@pytest.mark.parametrize("case", CASES)
def test_offloaded_forward_equals_resident_forward(ranks: list[dict[str, Any]], case: str) -> None:
    for outcomes in ranks:
        assert outcomes[case]["equal"]
        assert outcomes[case]["equal_second_step"]
        assert outcomes[case]["equal_after_disable"]


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_its_share_of_the_streamed_bytes(
    ranks: list[dict[str, Any]], case: str
) -> None:
    for outcomes in ranks:
        outcome = outcomes[case]
        share = outcome["streamed_bytes"] / len(ranks)
        assert share <= outcome["host_bytes"] <= share * 1.02


@pytest.mark.parametrize("case", CASES)
def test_all_shards_of_a_dtype_share_one_host_arena(
    ranks: list[dict[str, Any]], case: str
) -> None:
    for outcomes in ranks:
        assert outcomes[case]["shard_storages"] == outcomes[case]["shard_dtypes"]


@pytest.mark.parametrize("case", CASES)
def test_device_slots_hold_two_largest_blocks(ranks: list[dict[str, Any]], case: str) -> None:
    for outcomes in ranks:
        outcome = outcomes[case]
        assert outcome["slot_bytes"] == 2 * outcome["largest_block_bytes"]
        assert outcome["largest_block_bytes"] <= outcome["largest_block_tensor_bytes"] * 1.02
