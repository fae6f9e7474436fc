"""`dlo bench cluster --kill-at F --kill-rank R`: a fill group that loses a member mid-fill, on
the same simulated nodes and shaped links as the group fills (`cluster`).

At each node count N, in one cluster and against one store: a multi-reader fill without fault
(the baseline), then the same fill whose rank R is SIGKILLed once the loaders' own progress
reaches F of what they write in all (each node writes the whole model, so N x the model; read
from each loader's /metrics, on its node's loopback, see `ProgressWatch`): a decision made from
bytes moved, not from a clock. The survivors must finish without R and publish entries
byte-identical to the source; R's node must hold no entry. The figures: the survivors'
publication time over the baseline's fill time, and the bytes the store's links carried to all
N nodes (the kernel's counters, headers included, R's reads before its death too) over the
model's bytes. Called by `cluster.run`; removes everything it made, as `cluster` does.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dlo_bench import cluster_nodes, netns, provenance
from dlo_bench.cluster_report import RankResult
from dlo_contract.cache import find_entry
from dlo_contract.settings import Settings

GOAL_PUBLISH_OVER_NO_FAULT = 1.3
"""The survivors publish within this multiple of the fill time without a fault."""
GOAL_STORE_OVER_MODEL = 1.2
"""The store's links carry at most this multiple of the model in all."""
_METRICS = {"done": "dlo_loader_bytes_done_bytes", "total": "dlo_loader_bytes_total_bytes",
            "from_store": "dlo_loader_bytes_from_store_total"}
_POLL_S = 0.1
_REGROUPED = "the group continues without"
"""The survivors' log line once they agreed on who is left (`dlo_loader.regroup`)."""


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabelled samples of `_METRICS` in a Prometheus text page, by their short names."""
    wanted = {name: short for short, name in _METRICS.items()}
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[wanted[name]] = float(value)
    return found


def fraction_done(latest: list[dict[str, float]]) -> float | None:
    """Bytes written by every loader over what they write in all; None until each has listed
    the source (its total is known)."""
    totals = [values.get("total", 0.0) for values in latest]
    if not all(totals):
        return None
    return sum(values.get("done", 0.0) for values in latest) / sum(totals)


class ProgressWatch:
    """Each loader's latest progress figures, read every `_POLL_S` from its /metrics by a
    thread inside its node's namespace (loopback: no byte crosses a shaped link). A loader
    that is gone keeps its last figures."""

    def __init__(self, nodes: netns.Cluster, count: int, port: int) -> None:
        self._latest: list[dict[str, float]] = [{} for _ in range(count)]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for rank in range(count):
            netns.thread_in(nodes.node_ns[rank], lambda rank=rank: self._poll(rank, port),
                            name=f"dlo-bench-progress-{rank}")

    def _poll(self, rank: int, port: int) -> None:
        while not self._stop.wait(_POLL_S):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
            try:
                connection.request("GET", "/metrics")
                values = parse_metrics(connection.getresponse().read().decode())
            except (OSError, http.client.HTTPException):
                continue  # not serving yet, or gone
            finally:
                connection.close()
            with self._lock:
                self._latest[rank] = values

    def latest(self) -> list[dict[str, float]]:
        with self._lock:
            return [dict(values) for values in self._latest]

    def stop(self) -> None:
        self._stop.set()


@dataclass(frozen=True, kw_only=True)
class Kill:
    """One loader's SIGKILL mid-fill, as the benchmark sent it."""

    rank: int
    at_fraction: float
    """The loaders' progress when the kill was sent."""
    after_s: float
    """Seconds from the loaders' release to the kill."""
    from_store_before: int
    """Bytes the killed loader had read from the store, as its last /metrics said."""
    at_unix: float
    """When the kill was sent (the clock of the loaders' log lines)."""


def _kill_when(procs: list[subprocess.Popen[bytes]], watch: ProgressWatch, *, at: float,
               rank: int, started: float, timeout_s: float) -> Kill:
    """SIGKILL `procs[rank]` once the loaders' progress reaches `at` (see `fraction_done`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        latest = watch.latest()
        done = fraction_done(latest)
        if done is not None and done >= at:
            procs[rank].send_signal(signal.SIGKILL)
            return Kill(rank=rank, at_fraction=round(done, 3),
                        after_s=round(time.perf_counter() - started, 3),
                        from_store_before=int(latest[rank].get("from_store", 0)),
                        at_unix=time.time())
        ended = [r for r, p in enumerate(procs) if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            raise cluster_nodes.ClusterBenchError(
                f"loaders {ended or 'all'} ended (or the fill timed out) before the progress "
                f"reached {at:g} (last {done})",
                hint="a larger --head-dim or a slower --store-mbit gives the kill time to land")
        time.sleep(_POLL_S / 2)


def measure(args: argparse.Namespace, nodes: list[int], links: netns.LinkConfig,
            ) -> dict[str, Any]:
    """At each node count: a fill without fault and one that loses `args.kill_rank`, checked;
    their figures (see the module docstring)."""
    if not 0 < args.kill_at < 1 or not 0 <= args.kill_rank < min(nodes):
        raise cluster_nodes.ClusterBenchError(
            f"--kill-at {args.kill_at:g} / --kill-rank {args.kill_rank} invalid",
            hint=f"a fraction between 0 and 1, and a rank below the smallest node count "
                 f"({min(nodes)})")
    with tempfile.TemporaryDirectory(prefix="dlo-cluster-fault-") as tmp:
        work = Path(tmp)
        model_dir = cluster_nodes.write_model(work / "model", args.head_dim)
        digests = cluster_nodes.model_digests(model_dir)
        with netns.cluster(max(nodes), links) as made, \
                cluster_nodes.serve_model(made, args.ministack, model_dir) as store:
            probe = cluster_nodes.probe_links(made)
            results = []
            for index, n in enumerate(nodes):
                baseline = cluster_nodes.fill(made, store, n, "multi-reader", work / f"plain-{n}",
                                         2 * index, digests, args)
                fault = _fault_fill(made, store, n, work / f"fault-{n}", 2 * index + 1,
                                    digests, args)
                results.append(judge(store["bytes"], baseline.fill_s,
                                     sum(r.wire_from_store for r in baseline.ranks), **fault))
    return {
        "model_bytes": store["bytes"], "link_probe": probe, "results": results,
        "parameters": {
            "nodes": nodes, "kill_at": args.kill_at, "kill_rank": args.kill_rank,
            "store_mbit": links.store_mbit, "peer_mbit": links.peer_mbit,
            "head_dim": args.head_dim, "chunk_bytes": args.chunk_bytes, "readers": args.readers,
            "peer_timeout_s": args.peer_timeout or Settings().loader.peer_timeout_s,
            "command": shlex.join(["dlo", *sys.argv[1:]]),
        },
        "commit": provenance.commit(), "machine": provenance.machine(),
    }


def judge(model_bytes: int, no_fault_s: float, no_fault_wire: int, *, kill: Kill,
          survivors: list[RankResult], wire_from_store: int,
          regrouped_after_s: float | None) -> dict[str, Any]:
    """The figures of one fault fill against its baseline and the goals."""
    publish_s = max(rank.seconds for rank in survivors)
    to_baseline = round(publish_s / no_fault_s, 3)
    store_ratio = round(wire_from_store / model_bytes, 3)
    return {
        "nodes": len(survivors) + 1, "no_fault_fill_s": no_fault_s,
        "survivors_publish_s": publish_s,
        "survivors_publish_over_no_fault": to_baseline,
        "store_wire_bytes": wire_from_store, "store_bytes_over_model": store_ratio,
        "no_fault_store_bytes_over_model": round(no_fault_wire / model_bytes, 3),
        "store_payload_over_model": round(
            (sum(rank.bytes_from_store for rank in survivors) + kill.from_store_before)
            / model_bytes, 3),
        "kill": asdict(kill),
        "regrouped_after_kill_s": regrouped_after_s,
        "goal": {"survivors_publish_over_no_fault_max": GOAL_PUBLISH_OVER_NO_FAULT,
                 "store_bytes_over_model_max": GOAL_STORE_OVER_MODEL,
                 "publish_met": to_baseline <= GOAL_PUBLISH_OVER_NO_FAULT,
                 "store_met": store_ratio <= GOAL_STORE_OVER_MODEL},
        "survivors": [asdict(rank) for rank in survivors],
    }


def _fault_fill(made: netns.Cluster, store: dict[str, Any], nodes: int, work: Path, index: int,
                digests: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """One multi-reader fill whose rank `args.kill_rank` is killed mid-fill; the survivors
    checked (see `_check_survivors`), everything removed."""
    roots = [work / f"node{rank}" for rank in range(nodes)]
    procs: list[subprocess.Popen[bytes]] = []
    watch = ProgressWatch(made, nodes, Settings().loader.metrics_port)
    try:
        cluster_nodes.launch(made, store, roots, "multi-reader", index, args, procs)
        before = [netns.node_traffic(made, rank) for rank in range(nodes)]
        started = cluster_nodes.start_together(procs, roots, args.fill_timeout_s)
        kill = _kill_when(procs, watch, at=args.kill_at, rank=args.kill_rank, started=started,
                          timeout_s=args.fill_timeout_s)
        codes = [p.wait(timeout=args.fill_timeout_s) for p in procs]
    finally:
        watch.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    traffic = [netns.node_traffic(made, r).minus(before[r]) for r in range(nodes)]
    cluster_nodes.keep_logs(roots, args, work.name)
    survivors = _check_survivors(roots, codes, kill.rank, digests, traffic)
    regrouped = regrouped_after(roots, kill)
    shutil.rmtree(work)
    print(f"N={nodes} rank {kill.rank} killed at {kill.at_fraction:.0%} ({kill.after_s:.2f} s): "
          f"survivors regrouped {regrouped} s after it and published in "
          f"{max(r.seconds for r in survivors):.2f} s; store wire bytes "
          f"{sum(t.from_store for t in traffic)}", flush=True)
    return {"kill": kill, "survivors": survivors,
            "wire_from_store": sum(t.from_store for t in traffic),
            "regrouped_after_s": regrouped}


def regrouped_after(roots: list[Path], kill: Kill) -> float | None:
    """Seconds from the kill to the last survivor's line saying the group goes on without the
    lost member (how long finding the loss took); None where a survivor has no such line."""
    seen = []
    for rank, root in enumerate(roots):
        if rank == kill.rank:
            continue
        lines = [line for line in (root / "stderr").read_text(errors="replace").splitlines()
                 if _REGROUPED in line]
        if not lines:
            return None
        stamp = datetime.datetime.strptime(lines[0][:23], "%Y-%m-%d %H:%M:%S,%f")
        seen.append(stamp.timestamp() - kill.at_unix)
    return round(max(seen), 3)


def _check_survivors(roots: list[Path], codes: list[int], killed: int,
                     digests: dict[str, str], traffic: list[netns.NodeTraffic],
                     ) -> list[RankResult]:
    """Every other rank published a byte-identical entry, exited 0 and finished without
    `killed` (its summary says so), and `killed`'s node holds no entry."""
    survivors = []
    for rank, (root, code) in enumerate(zip(roots, codes)):
        if rank == killed:
            continue
        survivors.append(cluster_nodes.check_rank(root, rank, code, "multi-reader", digests,
                                            traffic[rank]))
        without = cluster_nodes.summary_of(root).get("without")
        if without != [killed]:
            raise cluster_nodes.ClusterBenchError(f"rank {rank} finished without {without}, not "
                                            f"[{killed}]: the kill missed the exchange")
    entry_id = cluster_nodes.summary_of(roots[0 if killed else 1])["entry_id"]
    lost = roots[killed]
    if codes[killed] != -signal.SIGKILL or (lost / "entry.json").exists() \
            or find_entry(lost / "cache", entry_id) is not None:
        raise cluster_nodes.ClusterBenchError(f"rank {killed}: exit {codes[killed]}, yet its node "
                                        "holds an entry or an entry file")
    return survivors
