"""SIGTERM (the pod deleted) to a real `dlo cache fill` process: mid-fill it stops reading, removes
its temporary files, drops its reservation, writes its summary and termination message and exits
with `EXIT_TERMINATED`; once the entry is published, it only ends the sidecar's stay."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan, FaultProxy
from dlo_bench.s3server import S3Server
from dlo_loader.termination import EXIT_TERMINATED, TERMINATED_MESSAGE
from support.loader_fleet import (
    Checkpoint,
    Fleet,
    ended,
    entry_files,
    finish,
    formed,
    included,
    no_entry,
    wait_until,
)

pytestmark = pytest.mark.slow


def tmp_files(root: Path) -> list[Path]:
    return [path for path in (root / "v1" / "tmp").rglob("*") if path.is_file()]


def reservations(root: Path) -> list[str]:
    """The reservation files under the root, live or left by a dead owner (none is reclaimed
    by looking; dot names are the room's lock and files being written)."""
    return [name for name in os.listdir(root / "v1" / "reservations")
            if not name.startswith(".")]


def test_sigterm_mid_fill_cleans_up_and_reports(
        s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    # Every read waits 5 s: the fill is still reading when the signal comes.
    with FaultProxy(s3.endpoint_url, FaultPlan(delay_s=5.0)) as slow:
        fleet = Fleet(tmp_path, checkpoint.source, 1, [slow.url])
        process = fleet.start(0)
        with ended(process):
            wait_until(lambda: slow.object_requests >= 1 or process.poll() is not None)
            root = fleet.root(0)
            assert tmp_files(root) and reservations(root), "the fill had not begun writing"
            process.send_signal(signal.SIGTERM)
            outcome = finish(0, process)
    assert outcome.returncode == EXIT_TERMINATED == 143, outcome.stderr
    assert outcome.summary == {"status": "error", "rank": 0, "error": TERMINATED_MESSAGE}
    termination_message = tmp_path / "node0" / "termination-log"
    assert json.loads(termination_message.read_text()) == outcome.summary
    assert no_entry(root) and tmp_files(root) == [] and reservations(root) == []
    assert not (tmp_path / "node0" / "entry.json").exists()
    assert "Traceback" not in outcome.stderr


def test_sigterm_to_a_group_member_mid_fill_lets_the_other_finish_without_it(
        s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    """The terminated member posts why it left (see [Note: heartbeat] in `peers`): the other
    learns it at once and finishes the fill without it (`survive`), reading its share again."""
    with FaultProxy(s3.endpoint_url, FaultPlan()) as fast, \
            FaultProxy(s3.endpoint_url, FaultPlan(delay_s=5.0)) as slow:
        fleet = Fleet(tmp_path, checkpoint.source, 2, [fast.url, slow.url],
                      settings={"timeout_s": 3600.0})
        processes = {rank: fleet.start(rank) for rank in range(2)}
        with ended(*processes.values()):
            wait_until(lambda: slow.object_requests >= 1 and tmp_files(fleet.root(1)) != [])
            # The share is read before the group forms: a SIGTERM then is a loss while the
            # group forms, which fails every member. Wait until both formed it.
            wait_until(lambda: formed(fleet.master_port) == 2)
            processes[1].send_signal(signal.SIGTERM)
            terminated, other = finish(1, processes[1]), finish(0, processes[0])
    assert terminated.returncode == EXIT_TERMINATED, terminated.stderr
    assert terminated.summary == {"status": "error", "rank": 1, "error": TERMINATED_MESSAGE}
    assert other.returncode == 0, other.stderr
    assert other.summary["without"] == [1] and other.summary["bytes_read_again"] > 0
    assert (f"loader rank 1 (pod {Fleet.pod(1)}, node {Fleet.node(1)}) left the group: "
            f"{TERMINATED_MESSAGE}") in other.stderr
    assert entry_files(fleet.root(0)) == included(checkpoint.files)
    assert no_entry(fleet.root(1)) and reservations(fleet.root(1)) == []


@pytest.mark.usefixtures("aws_env")
def test_sigterm_right_after_the_entry_ends_a_sidecar_with_status_0(
        s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    """The handler is the process's from its start: a SIGTERM the moment the entry document
    appears (before the summary, the endpoint's summary and the garbage collection that come
    before the sidecar idles) ends the stay, not the process."""
    fleet = Fleet(tmp_path, checkpoint.source, 1, [s3.endpoint_url],
                  settings={"metrics_port": 0})
    entry_file = tmp_path / "node0" / "entry.json"
    process = fleet.start(0, "--keep-running")
    with ended(process):
        wait_until(lambda: entry_file.exists() or process.poll() is not None)
        process.send_signal(signal.SIGTERM)
        outcome = finish(0, process)
    assert outcome.returncode == 0, outcome.stderr
    assert outcome.summary["status"] == "ok"
    assert json.loads(entry_file.read_text())["entry_id"] == outcome.summary["entry_id"]



def test_sigterm_while_the_group_gathers_ends_the_loader_at_once(
        s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    """Rank 1 of 2 waits for a rank 0 that never starts (the rendezvous timeout is an hour):
    SIGTERM ends the wait, the loader holding nothing."""
    fleet = Fleet(tmp_path, checkpoint.source, 2, [s3.endpoint_url] * 2,
                  settings={"rendezvous_timeout_s": 3600.0})
    process = fleet.start(1)
    with ended(process):
        assert process.stdout is not None
        for _ in range(2):  # the second "waiting" line comes from inside the rendezvous
            line = process.stdout.readline()
            assert "waiting for 2 loaders" in line, line
        process.send_signal(signal.SIGTERM)
        outcome = finish(1, process)
    assert outcome.returncode == EXIT_TERMINATED, outcome.stderr
    assert outcome.summary == {"status": "error", "rank": 1, "error": TERMINATED_MESSAGE}
    assert no_entry(fleet.root(1))
