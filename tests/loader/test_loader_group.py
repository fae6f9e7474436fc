"""Groups of real `dlo cache fill` processes against moto, each rank behind its own counting,
fault-injecting proxy: byte-identical entries, balanced reads, failing together, fallback."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FAULT_KINDS, FaultPlan, FaultProxy
from dlo_bench.s3server import S3Server
from dlo_contract.cache import (
    FileRecord,
    ObjectIdentity,
    Publication,
    begin_publication,
    checkpoint_identity,
    entry_id,
    open_entry,
    verify_entry,
)
from support.loader_fleet import (
    BUCKET,
    CHUNK_BYTES,
    PROCESS_TIMEOUT_S,
    Checkpoint,
    Fleet,
    OpenWatch,
    Outcome,
    ended,
    entry_files,
    finish,
    formed,
    included,
    no_entry,
    wait_until,
)

pytestmark = pytest.mark.slow
MODES = ("multi-reader", "single-reader", "independent")


@contextlib.contextmanager
def proxies(s3: S3Server, *plans: FaultPlan) -> Iterator[list[FaultProxy]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(FaultProxy(s3.endpoint_url, plan)) for plan in plans]


def total_bytes(checkpoint: Checkpoint) -> int:
    return sum(map(len, included(checkpoint.files).values()))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_fill_gives_every_node_the_same_bytes(
    mode: str, world: int, s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    with proxies(s3, *[FaultPlan()] * world) as counting:
        fleet = Fleet(tmp_path, checkpoint.source, world, [p.url for p in counting], mode=mode)
        outcomes = fleet.run()
    total = total_bytes(checkpoint)
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr
        rank, summary = outcome.rank, outcome.summary
        assert entry_files(fleet.root(rank)) == included(checkpoint.files)
        assert (summary["status"], summary["mode"], summary["rank"], summary["world_size"],
                summary["cached"]) == ("ok", mode, rank, world, False)
        assert summary["bytes_from_store"] == counting[rank].object_bytes
        assert summary["bytes_from_peers"] == total - summary["bytes_from_store"]
        assert summary["store_checksums"] == "all"  # the store's CRC32 (moto's default), combined
        node = fleet.tmp / f"node{rank}"
        assert json.loads((node / "termination-log").read_text()) == summary
        assert json.loads((node / "entry.json").read_text())["entry_id"] == summary["entry_id"]
    counted = [p.object_bytes for p in counting]
    if mode == "multi-reader":
        assert all(abs(c - total / world) <= 0.1 * total / world for c in counted), counted
    elif mode == "single-reader":
        assert counted == [total] + [0] * (world - 1)
    else:
        assert counted == [total] * world


@pytest.mark.usefixtures("aws_env")
def test_a_group_checks_a_multipart_objects_crc_of_its_parts(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Two ranks list the same parts (one HEAD each), cut the object at them alike (the plans
    agree: 5 MiB parts in chunks of 2.5 MiB, buffers of 4 MiB) and each checks the store's CRC
    of the parts' CRCs from the chunks it read and received."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    data = os.urandom(12 << 20)
    (tmp_path / "big.bin").write_bytes(data)
    boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1").upload_file(
        str(tmp_path / "big.bin"), BUCKET, "group-parts/big.bin",
        Config=TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20))
    with proxies(s3, FaultPlan(), FaultPlan()) as counting:
        fleet = Fleet(tmp_path, f"s3://{BUCKET}/group-parts/", 2, [p.url for p in counting],
                      settings={"chunk_bytes": 4 << 20, "memory_limit_bytes": 48 << 20,
                                "include": ["*.bin"]})
        outcomes = fleet.run()
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr
        assert outcome.summary["store_checksums"] == "all"
        assert entry_files(fleet.root(outcome.rank)) == {"big.bin": data}
        root, entry = fleet.root(outcome.rank), outcome.summary["entry_id"]
        assert verify_entry(root, entry, full=True) == []  # the manifest's 2.5 MiB chunks
        with open_entry(root, entry) as handle:
            assert handle.manifest.files[0].chunk_bytes == 5 << 19
    # Five chunks (2.5, 2.5, 2.5, 2.5 and 2 MiB), largest first to the least-loaded rank.
    assert [p.object_bytes for p in counting] == [7 << 20, 5 << 20]


def test_injected_faults_still_give_identical_bytes(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    plan = FaultPlan(kinds=FAULT_KINDS, every=2, limit=8)
    with proxies(s3, plan, plan) as faulty:
        # More attempts than faults: even if every fault hits the same range, it recovers.
        fleet = Fleet(tmp_path, checkpoint.source, 2, [p.url for p in faulty],
                      settings={"max_retries": 9})
        outcomes = fleet.run()
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr
        assert entry_files(fleet.root(outcome.rank)) == included(checkpoint.files)
    assert [set(p.faults) for p in faulty] == [set(FAULT_KINDS)] * 2


@pytest.mark.parametrize("in_flight", [1, 2])
def test_persistent_fault_fails_every_rank_and_publishes_nothing(
    in_flight: int, s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    memory = {1: 8, 2: 16}[in_flight] * CHUNK_BYTES
    with proxies(s3, FaultPlan(), FaultPlan(kinds=("slowdown",))) as pair:
        fleet = Fleet(tmp_path, checkpoint.source, 2, [p.url for p in pair],
                      settings={"max_retries": 3, "memory_limit_bytes": memory})
        first, second = fleet.run()
    assert (first.returncode, second.returncode) == (1, 1)
    assert f"exchange: {in_flight} round(s) in flight" in first.stderr
    assert first.summary == {
        "status": "error", "rank": 0,
        "error": "loader rank 1 (pod loader-1, node node1) failed; this loader stops too and "
                 "publishes nothing (hint: see the loader log of pod loader-1 for the cause, "
                 "then rerun)",
    }
    assert second.summary["error"].startswith("s3://models/tiny/transformer/")
    assert "gave up after 3 attempt(s); last error: SlowDown (503)" in second.summary["error"]
    assert no_entry(fleet.root(0)) and no_entry(fleet.root(1))


@pytest.mark.parametrize("mode", ["multi-reader", "single-reader"])
def test_two_rounds_in_flight_give_every_node_the_same_bytes(
    mode: str, s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """A budget for two rounds in flight (3N + 4 chunk slots): chunks, padding and round states
    of two rounds at once, each in its own buffers."""
    with proxies(s3, *[FaultPlan()] * 3) as counting:
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in counting], mode=mode,
                      settings={"memory_limit_bytes": 16 * CHUNK_BYTES})
        outcomes = fleet.run()
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr
        assert "exchange: 2 round(s) in flight" in outcome.stderr
        assert entry_files(fleet.root(outcome.rank)) == included(checkpoint.files)
        assert outcome.summary["bytes_from_store"] == counting[outcome.rank].object_bytes


class Watched:
    """A running loader whose output is read as it comes (two threads), so a test can wait for
    a line it prints before the loader ends."""

    def __init__(self, rank: int, process: subprocess.Popen[str]) -> None:
        self.rank, self.process = rank, process
        self._cond = threading.Condition()
        self._lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._threads = [threading.Thread(target=self._read, args=(name,), daemon=True)
                         for name in self._lines]
        for thread in self._threads:
            thread.start()

    def _read(self, name: str) -> None:
        for line in getattr(self.process, name):
            with self._cond:
                self._lines[name].append(line)
                self._cond.notify_all()

    def wait_for(self, text: str, timeout_s: float = 60.0) -> None:
        """Return once a stderr line holds `text` (a hang guard bounds the wait)."""
        with self._cond:
            if not self._cond.wait_for(
                    lambda: any(text in line for line in self._lines["stderr"]), timeout_s):
                tail = "".join(self._lines["stderr"][-20:])
                raise AssertionError(f"rank {self.rank} did not print {text!r}:\n{tail}")

    def finish(self) -> Outcome:
        returncode = self.process.wait(timeout=PROCESS_TIMEOUT_S)
        for thread in self._threads:
            thread.join()
        self.process.stdout.close()  # type: ignore[union-attr]  (both are pipes)
        self.process.stderr.close()  # type: ignore[union-attr]
        stdout, stderr = ("".join(self._lines[name]) for name in ("stdout", "stderr"))
        lines = stdout.strip().splitlines()
        summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
        return Outcome(self.rank, returncode, stdout, stderr, summary)


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_rank_late_for_a_round_makes_every_rank_run_it_again(
    in_flight: int, s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Rank 1's store answers no read until rank 0 has seen rank 1 late for a round (its chunk
    not complete `LATE_AFTER_S` after it joined the round): rank 0 waits that long inside the
    round, both learn rank 1 is late, settle what is in flight, wait for it with status
    exchanges, run the round again once its reads come, and publish the same bytes."""
    from dlo_loader.exchange import LATE_AFTER_S

    late = f"loader rank(s) 1 not ready after {LATE_AFTER_S:g} s; the round runs again"
    memory = {1: 8, 2: 16}[in_flight] * CHUNK_BYTES
    with proxies(s3, FaultPlan(), FaultPlan()) as pair:
        pair[1].reads_open.clear()  # rank 1 reads nothing, before the group or in it
        fleet = Fleet(tmp_path, checkpoint.source, 2, [p.url for p in pair],
                      settings={"memory_limit_bytes": memory})
        loaders = [Watched(rank, fleet.start(rank)) for rank in range(2)]
        try:
            loaders[0].wait_for("not ready after")  # rank 0 has seen a rank late for a round
        finally:
            pair[1].reads_open.set()
            outcomes = [loader.finish() for loader in loaders]
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr
        assert f"exchange: {in_flight} round(s) in flight" in outcome.stderr
        assert entry_files(fleet.root(outcome.rank)) == included(checkpoint.files)
        assert f"{late} once every rank is" in outcome.stderr
        assert "loader rank(s) 0 not ready" not in outcome.stderr


PEER_TIMEOUT_S = 3.0
PATIENT = {"timeout_s": 3600.0, "peer_timeout_s": PEER_TIMEOUT_S}
"""A fill deadline (and with it gloo's timeout) far beyond the process guard, and a short
heartbeat bound: only the heartbeat can end a survivor's wait in time."""
LOST = {
    "died": "died: its connections to the group closed and it sent no heartbeat for 3 s "
            "(loader.peer_timeout_s)",
    "silent": "sent no heartbeat for 3 s (loader.peer_timeout_s): it died, was stopped or is "
              "cut off",
    "host died": "died: the group's store it hosts closed this loader's connection",
    "store": "stopped answering: the group's store it hosts has not answered for 3 s "
             "(loader.peer_timeout_s); it was stopped, frozen or cut off",
}
"""How a survivor says how the group lost a member (see [Note: heartbeat] in `peers`)."""


def lost_error(rank: int, how: str) -> str:
    """Every survivor's error for the loss of `rank`."""
    return (f"loader rank {rank} (pod {Fleet.pod(rank)}, node {Fleet.node(rank)}) {how}; this "
            f"loader stops too and publishes nothing (hint: see the loader log of pod "
            f"{Fleet.pod(rank)} and the state of node {Fleet.node(rank)}, then rerun every "
            "loader of the group)")


def signalled_mid_fill(fleet: Fleet, slow: list[FaultProxy], victim: int,
                       signum: signal.Signals) -> list[Outcome]:
    """Start every rank, signal `victim` once the group is up and it reads, and return the
    others' outcomes; the fill's deadline (and with it gloo's timeout) is far beyond the
    process guard, so only the heartbeat can end the survivors' waits in time."""
    fleet.settings |= PATIENT
    processes = {rank: fleet.start(rank) for rank in range(fleet.world)}
    with ended(*processes.values()):
        # Ranks read before the group forms: signal the victim once the group is up and it reads.
        wait_until(lambda: formed(fleet.master_port) == fleet.world
                   and slow[victim].object_requests >= 1)
        os.kill(processes[victim].pid, signum)
        return [finish(rank, processes[rank]) for rank in processes if rank != victim]


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_killed_store_host_is_named_and_survived_and_a_rerun_fills_its_node(
    in_flight: int, s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Rank 0 hosts the store every member joined: the others name it, its pod and node, from
    the heartbeat, and go on at rank 1's store (`group_stores`; what they publish, and a
    stopped rank 0, are `test_loader_survive_losses`'s); a rerun fills rank 0's node."""
    memory = {1: 8, 2: 16}[in_flight] * CHUNK_BYTES
    # Rank 0's store answers every read after 5 s, so the fill cannot end before the kill.
    with proxies(s3, FaultPlan(delay_s=5.0), FaultPlan(), FaultPlan()) as slow:
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in slow],
                      settings={"memory_limit_bytes": memory})
        outcomes = signalled_mid_fill(fleet, slow, 0, signal.SIGKILL)
    named = f"loader rank 0 (pod {Fleet.pod(0)}, node {Fleet.node(0)}) {LOST['host died']}"
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr[-3000:]
        assert f"exchange: {in_flight} round(s) in flight" in outcome.stderr
        assert outcome.summary["without"] == [0]
        assert named in outcome.stderr
    assert not any((fleet.root(0) / "v1" / "entries").iterdir())
    with proxies(s3, *[FaultPlan()] * 3) as counting:
        rerun = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in counting])
        for outcome in rerun.run():
            assert outcome.returncode == 0, outcome.stderr
            assert entry_files(rerun.root(outcome.rank)) == included(checkpoint.files)
    assert not any((rerun.root(0) / "v1" / "tmp").iterdir())  # the dead rank's tmp dir is gone


def test_a_member_killed_before_its_claim_is_named_within_the_peer_timeout(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Rank 1 has joined and waits for its node's publication lock (held here) when it is
    killed: the others, waiting for its claim, name it within the peer timeout, not at the
    fill's deadline."""
    files = included(checkpoint.files)
    objects = [ObjectIdentity(k, len(v), hashlib.md5(v).hexdigest()) for k, v in files.items()]
    eid = entry_id(checkpoint_identity("s3://models/tiny/", objects))
    fleet = Fleet(tmp_path, checkpoint.source, 3, [s3.endpoint_url] * 3, settings=PATIENT)
    with begin_publication(fleet.root(1), eid, expected_bytes=0, lock_timeout_s=60):
        watch = OpenWatch(fleet.root(1) / "v1" / "locks" / f"{eid}.publish")
        processes = {rank: fleet.start(rank) for rank in range(3)}
        with ended(*processes.values()):
            watch.wait()  # rank 1 has joined, and waits for the lock
            watch.close()
            os.kill(processes[1].pid, signal.SIGKILL)
            outcomes = [finish(rank, processes[rank]) for rank in (0, 2)]
    for outcome in outcomes:
        assert outcome.returncode == 1, outcome.stderr
        assert outcome.summary == {"status": "error", "rank": outcome.rank,
                                   "error": lost_error(1, LOST["silent"])}
        assert no_entry(fleet.root(outcome.rank))


def accepts(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port`."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


def test_rank_zero_listens_for_the_group_while_it_lists(tmp_path: Path) -> None:
    # Rank 0's store takes connections and never answers, so its listing cannot end: its
    # rendezvous store must listen already (others that join early connect at once, not after
    # the store client's backoff).
    with socket.create_server(("127.0.0.1", 0)) as silent:
        store = f"http://127.0.0.1:{silent.getsockname()[1]}"
        fleet = Fleet(tmp_path, f"s3://{BUCKET}/tiny/", 2, [store, store])
        loader = fleet.start(0)
        try:
            wait_until(lambda: accepts(fleet.master_port) or loader.poll() is not None)
            assert loader.poll() is None, loader.communicate()
        finally:
            loader.kill()
            loader.communicate()


def test_late_loader_falls_back_to_filling_alone(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    with proxies(s3, FaultPlan(), FaultPlan()) as counting:
        late = Fleet(tmp_path / "late", checkpoint.source, 2, [p.url for p in counting])
        strict = Fleet(tmp_path / "strict", checkpoint.source, 2, [p.url for p in counting])
        started = [late.start(1, "--rendezvous-timeout", "3"),
                   strict.start(0, "--rendezvous-timeout", "2", "--on-rendezvous-timeout", "fail")]
        alone, refused = finish(1, started[0]), finish(0, started[1])
    assert alone.returncode == 0, alone.stderr
    assert (alone.summary["mode"], alone.summary["bytes_from_store"]) == (
        "independent", total_bytes(checkpoint))
    assert entry_files(late.root(1)) == included(checkpoint.files)
    assert refused.returncode == 1
    assert refused.summary["error"].startswith(
        f"rendezvous of 2 loaders at 127.0.0.1:{strict.master_port} did not complete within 2 s")
    assert no_entry(strict.root(0))


def test_node_that_holds_the_entry_serves_its_share_from_disk(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    files = included(checkpoint.files)
    objects = [ObjectIdentity(k, len(v), hashlib.md5(v).hexdigest()) for k, v in files.items()]
    eid = entry_id(checkpoint_identity("s3://models/tiny/", objects))
    with proxies(s3, FaultPlan(), FaultPlan()) as counting:
        fleet = Fleet(tmp_path, checkpoint.source, 2, [p.url for p in counting])
        with begin_publication(fleet.root(0), eid, expected_bytes=0, lock_timeout_s=60) as pub:
            watch = OpenWatch(fleet.root(0) / "v1" / "locks" / f"{eid}.publish")
            processes = {rank: fleet.start(rank) for rank in range(2)}
            watch.wait()  # rank 0 found no entry and now waits for this publication's lock
            watch.close()
            _publish_copy(pub, files, objects)
        outcomes = [finish(rank, process) for rank, process in processes.items()]
    holder, reader = outcomes
    assert holder.returncode == 0 and reader.returncode == 0, holder.stderr + reader.stderr
    assert (holder.summary["cached"], counting[0].object_bytes) == (True, 0)
    assert reader.summary["bytes_from_peers"] == holder.summary["bytes_to_peers"] > 0
    assert counting[1].object_bytes == reader.summary["bytes_from_store"] < total_bytes(checkpoint)
    assert entry_files(fleet.root(1)) == files


def _publish_copy(pub: Publication, files: dict[str, bytes], objects: list[ObjectIdentity]) -> None:
    assert pub.tmp_dir is not None
    for name, data in files.items():
        (pub.tmp_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (pub.tmp_dir / name).write_bytes(data)
    pub.commit("checkpoint", checkpoint_identity("s3://models/tiny/", objects),
               [FileRecord(name, len(data)) for name, data in files.items()])
