"""AllGather ranks that drift apart, over two real gloo processes: when rank 0 starts one forward
more than rank 1, which disables, both fail with an `OffloadError` naming every rank's forward,
neither hangs nor aborts, and a DiT disabled without restore refuses its forwards by name; a
forward the other ranks do not answer fails after `offload.group_wait_timeout_s`.

Every group waits an hour (its own timeout, and `offload.group_wait_timeout_s` but in the last
case), so a check that did not end a case would fail it by the test's timeout, never pass it
(see `lockstep_dist_worker.py`)."""

from __future__ import annotations

from typing import Any

import pytest
from support import lockstep_dist_worker
from support.gloo_world import run_world

WORLD = 2
DRIFT = ("the ranks of the DLO group of FluxTransformer2DModel are not at the same forward: "
         "rank 0 starts forward 3, rank 1 disables after 2 forwards; their AllGather loads "
         "would go out of step")
RELEASED = ("FluxTransformer2DModel was disabled with restore=False, so its streamed tensors "
            "are empty placeholders")

DISABLED_AT_THE_DRIFT = {
    "equal": [True, True], "disable": DRIFT, "disable_again": "ok", "call_after_disable": RELEASED,
}
"""Rank 1, whose disable meets rank 0's extra forward: the drift, then a torn-down DiT."""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Outcomes of every case on both ranks; a rank that aborted fails the spawn."""
    return run_world(lockstep_dist_worker.main, WORLD, tmp_path_factory.mktemp("lockstep"))


def test_ranks_in_step_disable_and_restore_without_error(ranks: list[dict[str, Any]]) -> None:
    assert [outcomes["in-step"] for outcomes in ranks] == [
        {"disable": "ok", "equal_after_disable": True}
    ] * WORLD


def test_an_extra_forward_fails_on_every_rank_naming_the_ranks_and_their_forwards(
    ranks: list[dict[str, Any]],
) -> None:
    """Rank 0 starts forward 3 while rank 1 closes (disable without restore): rank 0's forward
    and rank 1's disable raise the same error; rank 0's next forward raises it again without a
    collective, and its own close then tears down alone without raising."""
    rank0, rank1 = (outcomes["drift-close"] for outcomes in ranks)
    assert rank0 == {
        "equal": [True, True],
        "extra_forward": DRIFT,
        "forward_again": DRIFT,
        "disable": "ok",
        "disable_again": "ok",
        "call_after_disable": RELEASED,
    }
    assert rank1 == DISABLED_AT_THE_DRIFT


def test_a_restoring_disable_after_a_drift_tears_down_and_says_it_did_not_restore(
    ranks: list[dict[str, Any]],
) -> None:
    """Rank 1 disables with restore (which gathers every block) while rank 0 starts forward 3:
    nothing is gathered, both raise, and both DiTs refuse forwards instead of running on empty
    placeholders."""
    rank0, rank1 = (outcomes["drift-restore"] for outcomes in ranks)
    assert rank0 == {
        "equal": [True, True],
        "extra_forward": DRIFT,
        "forward_again": DRIFT,
        "disable": "FluxTransformer2DModel was not restored: its DLO group drifted at forward "
                   "3, so its blocks cannot be gathered; its streamed tensors are empty "
                   "placeholders",
        "disable_again": "ok",
        "call_after_disable": RELEASED,
    }
    assert rank1 == DISABLED_AT_THE_DRIFT


def test_a_forward_the_others_do_not_answer_fails_within_the_group_wait_timeout(
    ranks: list[dict[str, Any]],
) -> None:
    """Rank 1 waits elsewhere while rank 0 starts forward 3 with a one-second wait: rank 0 fails
    naming its forward and the setting. Rank 1's disable then meets rank 0's post, which its
    group still holds, so rank 1 learns of the drift too; rank 0 disables alone."""
    assert [outcomes["unanswered"] for outcomes in ranks] == [
        {"extra_forward": "rank 0 of the DLO group of FluxTransformer2DModel starts forward 3 "
                          "but the other ranks did not answer within 1 s "
                          "(offload.group_wait_timeout_s)",
         "disable": "ok"},
        {"disable": DRIFT},
    ]


def test_a_rank_that_left_the_group_fails_the_next_forward_by_name(
    ranks: list[dict[str, Any]],
) -> None:
    """Rank 1 closes its end of the group (as a process that died would) while rank 0 starts
    forward 3, which would wait an hour: it fails at once naming its forward (not with gloo's
    text), then disables alone."""
    rank0, rank1 = (outcomes["left"] for outcomes in ranks)
    assert rank0 == {
        "extra_forward": "rank 0 of the DLO group of FluxTransformer2DModel starts forward 3 but "
                         "the check's collective failed (a rank stopped or left the group, or "
                         "the group's own timeout ran out)",
        "disable": "ok",
    }
    assert rank1 == {}
