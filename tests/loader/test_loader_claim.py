"""A group member that gave up waiting for its group before the last one joined: the others,
now gathered, learn it left from the group's store (its claim says so) and apply the rendezvous
policy at once, instead of waiting for its claim until the fill's deadline."""

from __future__ import annotations

from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan, FaultProxy
from dlo_bench.s3server import S3Server
from support.loader_fleet import (
    Checkpoint,
    Fleet,
    entry_files,
    finish,
    included,
    wait_until,
)
from test_loader_shared_nodes import _waiting_for_group

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("policy", ["fail", "independent"])
def test_a_member_that_left_before_the_last_joined_ends_the_others_wait(
        policy: str, s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    with FaultProxy(s3.endpoint_url, FaultPlan()) as held, \
            FaultProxy(s3.endpoint_url, FaultPlan()) as direct:
        held.reads_open.clear()  # rank 0, fallen back to filling alone, stays in its fill
        fleet = Fleet(tmp_path, checkpoint.source, 2, [held.url, direct.url],
                      settings={"on_rendezvous_timeout": policy, "rendezvous_timeout_s": 600.0})
        alone = fleet.start(0, "--rendezvous-timeout", "1", "--on-rendezvous-timeout",
                            "independent")
        try:
            _waiting_for_group(alone)
            # Rank 0 gives up after 1 s; once it is fetching alone, rank 1 joins its store.
            wait_until(lambda: held.object_requests > 0 or alone.poll() is not None)
            late = finish(1, fleet.start(1))
        finally:
            held.reads_open.set()
            first = finish(0, alone)
    assert first.returncode == 0, first.stderr
    assert first.summary["mode"] == "independent"
    reason = (f"loader rank 0 left the group at 127.0.0.1:{fleet.master_port} before it formed: "
              "its rendezvous timed out")
    if policy == "fail":
        assert late.returncode == 1
        assert late.summary["error"].startswith(reason)
    else:
        assert late.returncode == 0, late.stderr
        assert late.summary["mode"] == "independent"
        assert f"{reason}; falling back to independent mode" in late.stderr
        assert entry_files(fleet.root(1)) == included(checkpoint.files)
    assert entry_files(fleet.root(0)) == included(checkpoint.files)
